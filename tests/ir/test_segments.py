"""Cutting a loss into regions: unannotated code anywhere, and regions sharing a key."""

from __future__ import annotations

import inspect

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx
from piper_jax.directives.filters import matches
from piper_jax.ir import ActRef, lift
from piper_jax.ir.lift import describe_unannotated

import piper_jax as piper
from piper_jax.annotate import reset_annotation_counters


def lift_fn(fn, params, batch=()):
    reset_annotation_counters()
    p = [jnp.asarray(a) for a in params]
    b = [jnp.asarray(a) for a in batch]
    return lift(
        lambda p, b: fn(*p, *b), p, b, [f"p{i}" for i in range(len(p))], [f"b{i}" for i in b]
    )


def run_regions(lifted, params, batch=()):
    """Run the region functions one after another, as the runtime would: the loss."""
    outs = []
    for r in lifted.regions:
        acts = [outs[a.region][a.position] for a in r.act_inputs]
        outs.append(r.fn([params[i] for i in r.param_ids], [batch[i] for i in r.batch_ids], acts))
    region = lifted.regions[lifted.loss_region]
    return outs[lifted.loss_region][region.loss_position]


def line_of(text: str, fn) -> int:
    """The line number of the first source line of `fn` containing `text`."""
    lines, start = inspect.getsourcelines(fn)
    return start + next(i for i, line in enumerate(lines) if text in line)


W = np.random.default_rng(0).normal(size=(4, 4)).astype(np.float32)
X = np.random.default_rng(1).normal(size=(2, 4)).astype(np.float32)


def test_glue_between_regions_joins_the_region_it_feeds() -> None:
    def fn(w, x):
        with piper.annotate("PP"):
            h = jnp.tanh(x @ w)
        h = jnp.exp(h).reshape(4, 2).reshape(2, 4)  # glue: joins the region it feeds
        aux = jnp.sum(h)  # used only by the loss: joins the region it reads
        with piper.annotate("PP"):
            h = h @ w
        return jnp.mean(h**2) + aux

    lifted = lift_fn(fn, [W], [X])
    assert [r.key for r in lifted.regions] == [(("PP", 0),), (("PP", 1),)]
    r0, r1 = lifted.regions
    exp_line = line_of("jnp.exp(h)", fn)
    assert r1.absorbed[:2] == (
        f"exp at test_segments.py:{exp_line}",
        f"reshape at test_segments.py:{exp_line}",
    )
    assert f"reduce_sum at test_segments.py:{exp_line + 1}" in r1.absorbed
    assert r0.absorbed == ()
    np.testing.assert_allclose(run_regions(lifted, [W], [X]), fn(W, X), rtol=1e-6)
    (line,) = describe_unannotated(lifted)
    assert line == (
        f"region 1 {{PP:1}} absorbs unannotated code at test_segments.py:{exp_line} (exp, "
        f"reshape), test_segments.py:{exp_line + 1} (reduce_sum), test_segments.py:"
        f"{exp_line + 4} (integer_pow, reduce_sum, div, +1 more)"
    )


def test_describe_unannotated_shortens_long_lists() -> None:
    def fn(x):
        with piper.annotate("PP"):
            x = jnp.sin(x)
        x = jnp.cos(x)
        x = jnp.abs(x)
        x = jnp.tanh(x)
        return jnp.sum(x)

    (line,) = describe_unannotated(lift_fn(fn, [X]), limit=2)
    start = line_of("jnp.cos", fn)
    assert line == (
        f"region 0 {{PP:0}} absorbs unannotated code at test_segments.py:{start} (cos), "
        f"test_segments.py:{start + 1} (abs), +2 more"
    )


def test_mask_made_before_the_model_and_used_after_it() -> None:
    """The padding-mask pattern that crashed with KeyError: (): the mask feeds region 0
    (which absorbs it) and the trailing loss code reads it from there."""

    def fn(w, x):
        mask = (x > 0).astype(jnp.float32)
        with piper.annotate("PP"):
            h = jnp.tanh((x * mask) @ w)
        with piper.annotate("PP"):
            h = h @ w
        return jnp.sum(h**2 * mask) / jnp.sum(mask)

    lifted = lift_fn(fn, [W], [X])
    r0, r1 = lifted.regions
    # the mask feeds region 0; jnp.sum(mask) feeds only the loss and reads region 0
    assert [a.split(" at")[0] for a in r0.absorbed] == ["gt", "convert_element_type", "reduce_sum"]
    assert lifted.loss_region == 1
    assert [a.region for a in r1.act_inputs] == [0, 0, 0]  # h, mask, sum(mask)
    np.testing.assert_allclose(run_regions(lifted, [W], [X]), fn(W, X), rtol=1e-6)


def test_label_mask_used_only_by_the_loss_joins_the_loss_region() -> None:
    def fn(w, x, y):
        mask = y > 0  # reads no region and feeds no annotated code
        with piper.annotate("PP"):
            h = jnp.tanh(x @ w)
        with piper.annotate("PP"):
            h = h @ w
        return jnp.sum(jnp.where(mask, (h - y) ** 2, 0.0))

    y = -X
    lifted = lift_fn(fn, [W], [X, y])
    r0, r1 = lifted.regions
    assert r0.batch_ids == (0,) and r1.batch_ids == (1,)
    assert r1.absorbed[0].startswith("gt at ")
    np.testing.assert_allclose(run_regions(lifted, [W], [X, y]), fn(W, X, y), rtol=1e-6)


def test_value_made_before_the_first_region_consumed_in_the_middle_one() -> None:
    def fn(w, x):
        scale = jnp.mean(x) + 1.0
        with piper.annotate("PP"):
            h = jnp.tanh(x @ w)
        with piper.annotate("PP"):
            h = h * scale
        with piper.annotate("PP"):
            h = h @ w
        return jnp.mean(h**2)

    lifted = lift_fn(fn, [W], [X])
    r0, r1, r2 = lifted.regions
    assert r0.absorbed == ()
    assert [a.split(" at")[0] for a in r1.absorbed] == ["reduce_sum", "div", "add"]
    assert [a.split(" at")[0] for a in r2.absorbed] == ["integer_pow", "reduce_sum", "div"]
    assert r1.batch_ids == (0,)
    np.testing.assert_allclose(run_regions(lifted, [W], [X]), fn(W, X), rtol=1e-6)


def test_glue_feeding_a_later_region_skips_the_one_in_between() -> None:
    def fn(w, x):
        with piper.annotate("PP"):
            h = jnp.tanh(x @ w)
        skip = h * 2.0  # unannotated, read only by region 2
        with piper.annotate("PP"):
            h = jnp.sin(h)
        with piper.annotate("PP"):
            h = h @ w + skip
        return jnp.mean(h**2)

    lifted = lift_fn(fn, [W], [X])
    assert lifted.regions[2].absorbed[0].startswith("mul at ")
    assert lifted.regions[2].act_inputs == (ActRef(0, 0), ActRef(1, 0))
    np.testing.assert_allclose(run_regions(lifted, [W], [X]), fn(W, X), rtol=1e-6)


def test_absorbed_code_of_an_nnx_layer_points_at_the_model_line() -> None:
    """The location skips Flax's frames: the user's line, not flax/nnx/nn/linear.py."""

    class Model(nnx.Module):
        def __init__(self):
            self.a = nnx.Linear(4, 4, rngs=nnx.Rngs(0))
            self.b = nnx.Linear(4, 4, rngs=nnx.Rngs(1))

        def __call__(self, x):
            with piper.annotate("PP"):
                x = self.a(x)
            x = self.b(x)  # glue: a whole layer between regions
            with piper.annotate("PP"):
                x = self.a(x)
            return jnp.mean(x**2)

    model = Model()
    graphdef, params, rest = nnx.split(model, nnx.Param, ...)
    leaves, treedef = jax.tree.flatten(params)

    def flat(p, b):
        return nnx.merge(graphdef, jax.tree.unflatten(treedef, p), rest)(*b)

    reset_annotation_counters()
    lifted = lift(flat, leaves, [jnp.asarray(X)], [str(i) for i in range(len(leaves))], ["x"])
    line = line_of("x = self.b(x)", Model.__call__)
    assert lifted.regions[1].absorbed[0] == f"dot_general at test_segments.py:{line}"
    assert lifted.regions[1].param_ids == (0, 1, 2, 3)  # a's and b's kernel and bias


def test_nested_region_interrupts_its_outer_region() -> None:
    """PP0 code, an EP block inside PP0, more PP0 code, then PP1: four regions, two with
    key {PP:0}; {"PP": 0} matches three, {"EP": "*"} the nested one."""

    def fn(w, x):
        with piper.annotate("PP", 0):
            h = jnp.tanh(x @ w)
            with piper.annotate("EP"):
                e = jnp.sin(h) * 3.0
            h = h + e
        with piper.annotate("PP", 1):
            h = h @ w
        return jnp.mean(h**2)

    lifted = lift_fn(fn, [W], [X])
    keys = [r.key for r in lifted.regions]
    assert keys == [(("PP", 0),), (("PP", 0), ("EP", 0)), (("PP", 0),), (("PP", 1),)]
    assert [r.index for r in lifted.regions] == [0, 1, 2, 3]
    assert [matches({"PP": 0}, r.tags) for r in lifted.regions] == [True, True, True, False]
    assert [matches({"EP": "*"}, r.tags) for r in lifted.regions] == [False, True, False, False]
    r0, r1, r2, r3 = lifted.regions
    assert r1.act_inputs == (ActRef(0, 0),)
    assert r2.act_inputs == (ActRef(0, 0), ActRef(1, 0))  # h from region 0, e from 1
    assert r3.act_inputs == (ActRef(2, 0),)
    assert r0.param_ids == (0,) and r3.param_ids == (0,)
    assert str(r2) == "{PP:0}"
    np.testing.assert_allclose(run_regions(lifted, [W], [X]), fn(W, X), rtol=1e-6)


def test_region_key_can_return_after_another() -> None:
    """{PP:0}, {PP:1}, {PP:0} again: three regions in the order the model runs them."""

    def fn(w, x):
        with piper.annotate("PP", 0):
            h = jnp.tanh(x @ w)
        with piper.annotate("PP", 1):
            h = h @ w
        with piper.annotate("PP", 0):
            h = h @ w.T
        return jnp.mean(h**2)

    lifted = lift_fn(fn, [W], [X])
    assert [str(r) for r in lifted.regions] == ["{PP:0}", "{PP:1}", "{PP:0}"]
    np.testing.assert_allclose(run_regions(lifted, [W], [X]), fn(W, X), rtol=1e-6)
