"""Optimizers that select parameters by path see the model's own parameter tree, cut to
each group's leaves (paths unchanged): a weight-decay mask and multi_transform labels by
path train like single-device training under every strategy; a mask that reads leaf
shapes cannot be honoured on ZeRO's flat shards and is refused."""

from __future__ import annotations

import jax
import optax
import pytest
from helpers import check_mlp_strategy

import piper_jax as piper
from piper_jax import schedules


def _keys(path: tuple) -> list:
    """The model's own path of a leaf: ['blocks', 0, 'bias'] (as nnx.Optimizer sees it)."""
    return [k.key for k in path if isinstance(k, jax.tree_util.DictKey)]


def no_decay_on_biases(params):
    return jax.tree_util.tree_map_with_path(lambda p, _: _keys(p)[-1] != "bias", params)


def by_module(params):
    return jax.tree_util.tree_map_with_path(
        lambda p, _: "adam" if _keys(p)[0] == "blocks" else "sgd", params
    )


OPTIMIZERS = {
    "adamw_masked": optax.adamw(1e-2, weight_decay=0.5, mask=no_decay_on_biases),
    "multi_transform": optax.multi_transform(
        {"adam": optax.adam(1e-2), "sgd": optax.sgd(0.5)}, by_module
    ),
}


def pp2_dp2() -> list:
    directives = [piper.split({"PP": "*"}, num_microbatches=2)]
    for s in range(2):
        directives += [piper.place({"PP": s}, [s, s + 2]), piper.replicate({"PP": s}, [s, s + 2])]
    return directives + schedules.one_f_one_b(2, 2)


STRATEGIES = {
    "none": list,
    "pp2_dp2": pp2_dp2,
    "zero3_dp2": lambda: [piper.replicate({"PP": "*"}, [0, 1], shard_params=True)],
}


@pytest.mark.parametrize("strategy", sorted(STRATEGIES))
@pytest.mark.parametrize("optimizer", sorted(OPTIMIZERS))
def test_optimizer_by_path_matches_single_device(optimizer: str, strategy: str) -> None:
    check_mlp_strategy(STRATEGIES[strategy](), OPTIMIZERS[optimizer])


def test_mask_by_shape_under_zero_is_refused() -> None:
    """ZeRO's leaves are flat shards: a mask on ndim would decay the wrong leaves."""
    by_ndim = optax.adamw(
        1e-2, weight_decay=0.5, mask=lambda p: jax.tree.map(lambda x: x.ndim > 1, p)
    )
    with pytest.raises(piper.PiperError, match="mask that reads leaf shapes"):
        check_mlp_strategy(STRATEGIES["zero3_dp2"](), by_ndim)
    check_mlp_strategy(pp2_dp2(), by_ndim)  # whole leaves: honoured
