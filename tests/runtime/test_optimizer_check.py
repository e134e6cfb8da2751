"""The optimizer check: per-element optimizers are proven from their traces alone; the
rest (couplings, shape-dependent masks, positions) still go to the proxies, which find
the global-norm carrier or refuse the optimizer."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import optax
import pytest
from flax import nnx

import piper_jax as piper
from piper_jax import optimizer_check
from piper_jax.optimizer_trace import updates_are_per_element
from piper_jax.param_tree import ParamTree, leaf_name


class TwoLayers(nnx.Module):
    def __init__(self):
        rngs = nnx.Rngs(0)
        self.first = nnx.Linear(4, 3, rngs=rngs)
        self.second = nnx.Linear(3, 3, rngs=rngs)


def _tree() -> tuple[ParamTree, dict[str, jax.Array]]:
    params = nnx.state(TwoLayers(), nnx.Param)
    leaves = {leaf_name(p): v for p, v in jax.tree_util.tree_flatten_with_path(params)[0]}
    return ParamTree(params), leaves


def _by_path(params):
    return jax.tree_util.tree_map_with_path(
        lambda path, _: "bias" not in jax.tree_util.keystr(path), params
    )


def _by_ndim(params):
    return jax.tree.map(lambda x: x.ndim > 1, params)


def _stateless(update) -> optax.GradientTransformation:
    return optax.GradientTransformation(lambda p: optax.EmptyState(), update)


def _swap(grads, state, params=None):
    """Each kernel updated from the other layer's kernel gradient (the proxies' kernels
    have one shape): couples two leaves."""
    leaves, treedef = jax.tree.flatten(grads)
    leaves[1], leaves[-1] = leaves[-1], leaves[1]
    return jax.tree.unflatten(treedef, leaves), state


def _by_position(grads, state, params=None):
    """Scales each element by its flat index: differs on a ZeRO shard."""
    return jax.tree.map(lambda g: g * jnp.arange(g.size).reshape(g.shape), grads), state


def _by_size(grads, state, params=None):
    """Scales each leaf by 1 / its size, read in Python: differs on a ZeRO shard."""
    return jax.tree.map(lambda g: g / g.size, grads), state


def _remembers_another_leaf() -> optax.GradientTransformation:
    """Adds to each gradient the last step's gradient of another leaf, kept in the state:
    per-element in a first update, coupling two leaves from the second on."""

    def update(grads, state, params=None):
        return jax.tree.map(jnp.add, grads, state), _swap(grads, None)[0]

    return optax.GradientTransformation(lambda p: jax.tree.map(jnp.zeros_like, p), update)


def _state_changes_type() -> optax.GradientTransformation:
    """Per-element, but an update turns its integer counter into a float: one traced
    update no longer stands for the next, so the proof leaves it to the proxies."""

    def update(grads, state, params=None):
        return grads, state.astype(jnp.float32) + 1

    return optax.GradientTransformation(lambda p: jnp.zeros((), jnp.int32), update)


PER_ELEMENT = {
    "sgd": optax.sgd(1e-2, momentum=0.9),
    "adamw_schedule": optax.adamw(optax.linear_schedule(1e-2, 1e-3, 3), weight_decay=0.1),
    "adamw_masked_by_path": optax.adamw(1e-2, weight_decay=0.5, mask=_by_path),
    "clip_per_element": optax.chain(optax.clip(0.1), optax.adam(1e-2)),
    "labels_by_path": optax.multi_transform(
        {"decay": optax.adamw(1e-2, weight_decay=0.1), "plain": optax.sgd(1e-2)},
        lambda p: jax.tree.map(lambda keep: "decay" if keep else "plain", _by_path(p)),
    ),
}


@pytest.mark.parametrize("name", sorted(PER_ELEMENT))
@pytest.mark.parametrize("sharded", [False, True])
def test_per_element_optimizers_are_proven_from_their_traces(
    name: str, sharded: bool, monkeypatch: pytest.MonkeyPatch
) -> None:
    tree, leaves = _tree()
    names = list(leaves)
    groups = [names] if sharded else [names[:2], names[2:]]

    def no_proxies(*args, **kwargs):
        raise AssertionError("the proxies ran for an optimizer the traces prove")

    monkeypatch.setattr(optimizer_check, "_runs", no_proxies)
    assert optimizer_check.plan_optimizer(PER_ELEMENT[name], tree, leaves, groups, sharded) is False


NOT_PROVEN = {  # optimizer, sharded, and what the proxies then decide
    "global_norm_clip": (
        optax.chain(optax.clip_by_global_norm(0.1), optax.adam(1e-2)),
        False,
        True,
    ),
    "global_norm_clip_zero": (
        optax.chain(optax.clip_by_global_norm(0.1), optax.adam(1e-2)),
        True,
        True,
    ),
    "lamb_per_group": (optax.lamb(1e-2), False, False),  # per leaf: groups keep whole leaves
    "lamb_zero": (optax.lamb(1e-2), True, "refused"),
    "mask_by_ndim_zero": (optax.adamw(1e-2, weight_decay=0.5, mask=_by_ndim), True, "refused"),
    "swapped_leaves": (_stateless(_swap), False, "refused"),
    # one group's shards: each replica holds shard i of both leaves, so this works; the
    # proof still leaves any coupling of two leaves to the proxies
    "swapped_leaves_zero": (_stateless(_swap), True, False),
    "remembers_another_leaf": (_remembers_another_leaf(), False, "refused"),
    "state_changes_type": (_state_changes_type(), False, False),
    "by_position_zero": (_stateless(_by_position), True, "refused"),
    "by_size_zero": (_stateless(_by_size), True, "refused"),
}


@pytest.mark.parametrize("name", sorted(NOT_PROVEN))
def test_what_the_traces_cannot_prove_goes_to_the_proxies(name: str) -> None:
    optimizer, sharded, verdict = NOT_PROVEN[name]
    tree, leaves = _tree()
    names = list(leaves)
    groups = [names] if sharded else [names[:2], names[2:]]
    shapes = {n: optimizer_check._proxy_shape(v.shape) for n, v in leaves.items()}
    assert not updates_are_per_element(optimizer, tree, shapes, groups, sharded)
    if verdict == "refused":
        with pytest.raises(piper.PiperError, match="couples parameters|failed when run"):
            optimizer_check.plan_optimizer(optimizer, tree, leaves, groups, sharded)
    else:  # True: the updates need the global-norm carrier
        assert optimizer_check.plan_optimizer(optimizer, tree, leaves, groups, sharded) is verdict
