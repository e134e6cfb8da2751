"""Lifting: regions from annotations, the unannotated-code rule, tied weights."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from helpers import StageMLP, mlp_batches, mlp_loss
from piper_jax.directives import apply_directives
from piper_jax.ir import AnnotationError, NodeKind, build_dag, lift

import piper_jax as piper
from piper_jax.annotate import reset_annotation_counters


def lift_fn(fn, *args):
    reset_annotation_counters()
    leaves = [jnp.asarray(a) for a in args]
    return lift(lambda p, b: fn(*p, *b), leaves, [], [f"p{i}" for i in range(len(args))], [])


def test_nested_and_automatic_indices() -> None:
    def fn(x):
        with piper.annotate("PP"):
            x = jnp.sin(x)
        with piper.annotate("PP"):
            with piper.annotate("EP"):
                x = jnp.cos(x)
            with piper.annotate("EP"):
                x = x * 2
        return jnp.sum(x)

    lifted = lift_fn(fn, np.ones(3, np.float32))
    keys = [r.key for r in lifted.regions]
    assert keys == [(("PP", 0),), (("PP", 1), ("EP", 0)), (("PP", 1), ("EP", 1))]
    assert lifted.loss_region == 2  # the trailing sum joins the last producing region


def test_explicit_index_and_region_functions_compose_to_the_loss() -> None:
    def fn(w, x):
        y = x * 3.0  # leading: joins the first region that consumes it
        with piper.annotate("PP", 0):
            y = jnp.tanh(y @ w)
        with piper.annotate("PP", 1):
            y = y @ w
        return jnp.mean(y**2)

    w = np.random.default_rng(0).normal(size=(4, 4)).astype(np.float32)
    x = np.ones((2, 4), np.float32)
    lifted = lift_fn(fn, w, x)
    r0, r1 = lifted.regions
    assert r0.param_ids == (0, 1) and r1.param_ids == (0,)
    assert lifted.param_users(0) == [0, 1]
    (a,) = r0.fn([w, x], [], [])
    (loss,) = r1.fn([w], [], [a])
    np.testing.assert_allclose(loss, fn(w, x), rtol=1e-6)


def test_non_scalar_loss_is_refused() -> None:
    with pytest.raises(AnnotationError, match="float scalar"):
        lift_fn(lambda x: x * 2, np.ones(3, np.float32))


def test_bad_tag_is_refused() -> None:
    with pytest.raises(AnnotationError, match="reserved"):
        with piper.annotate("MB"):
            pass
    with pytest.raises(AnnotationError, match="not a valid tag"):
        with piper.annotate("a/b"):
            pass


def test_dag_of_two_region_mlp() -> None:
    model = StageMLP(2)
    from flax import nnx

    graphdef, params, rest = nnx.split(model, nnx.Param, ...)
    leaves, treedef = jax.tree.flatten(params)
    batch = mlp_batches(1)[0]
    b_leaves, b_def = jax.tree.flatten(batch)

    def flat(p, b):
        m = nnx.merge(graphdef, jax.tree.unflatten(treedef, p), rest)
        return mlp_loss(m, jax.tree.unflatten(b_def, b))

    reset_annotation_counters()
    lifted = lift(flat, leaves, b_leaves, [str(i) for i in range(len(leaves))], ["x", "y"])
    dag = build_dag(lifted)
    labels = sorted(str(n) for n in dag.compute_nodes())
    assert labels == ["B0", "B1", "F0", "F1"]
    assert not list(dag.of_kind(NodeKind.UPD))  # the directive passes add the updates
    upd = list(apply_directives(dag, lifted, [], num_devices=1).of_kind(NodeKind.UPD))
    assert [n.region for n in upd] == [0, 1]  # the tied embedding is owned by region 0
    assert "F0" in dag.to_text() and '"kind": "COMPUTE"' in dag.to_json()
    assert dag.find_cycle() is None
