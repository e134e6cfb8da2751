"""The pjit baselines (one jax.jit step, dp or fsdp) train like single-device training."""

from __future__ import annotations

import jax
import numpy as np
import optax
import pytest
from flax import nnx
from helpers import StageMLP, assert_matches_reference, mlp_batches, mlp_loss
from piper_jax.ir.errors import BatchError, DirectiveError, PiperError

from piper_jax.baselines import fsdp_spec, pjit_step

OPT = optax.adamw(1e-2, weight_decay=0.01)


def make_step(strategy: str, batch: dict | None = None):
    batch = batch if batch is not None else mlp_batches(1)[0]
    return pjit_step(mlp_loss, StageMLP(2), OPT, batch, jax.devices()[:4], strategy)


@pytest.mark.parametrize("strategy", ["dp", "fsdp"])
def test_pjit_matches_single_device(strategy: str) -> None:
    batches = mlp_batches(3)
    step = make_step(strategy, batches[0])
    assert_matches_reference(step, mlp_loss, lambda: StageMLP(2), OPT, batches)
    assert all(isinstance(x, np.ndarray) for x in jax.tree.leaves(step.params()))


def test_fsdp_holds_less_per_device_than_dp() -> None:
    dp, fsdp = make_step("dp").memory(), make_step("fsdp").memory()
    params_bytes = sum(x.nbytes for x in jax.tree.leaves(nnx.split(StageMLP(2), nnx.Param, ...)[1]))
    assert dp["params"] == params_bytes
    # every StageMLP leaf has an axis of 16 (or 8): all of them shard 4 ways
    assert fsdp["params"] == params_bytes // 4
    assert fsdp["opt_state"] < dp["opt_state"]


def test_fsdp_spec_picks_largest_divisible_axis() -> None:
    assert fsdp_spec((8, 16), 4) == jax.sharding.PartitionSpec(None, "data")
    assert fsdp_spec((6, 3), 4) == jax.sharding.PartitionSpec()
    assert fsdp_spec((), 4) == jax.sharding.PartitionSpec()


def test_user_errors_are_piper_errors() -> None:
    with pytest.raises(DirectiveError, match="unknown strategy 'zero9'.*dp, fsdp"):
        make_step("zero9")
    with pytest.raises(
        BatchError, match=r"batch size 6 .* not divisible by the devices of the data mesh = 4"
    ):
        make_step("dp", mlp_batches(1, batch_size=6)[0])
    step = make_step("dp")
    with pytest.raises(PiperError, match="batch size 8 differs"):
        step(mlp_batches(1, batch_size=8)[0])


def test_pjit_tensor_parallel_splits_as_shard_tensor_does() -> None:
    """The "tp" strategy: the leaves the Megatron map names split over tp, the rest whole."""
    batches = mlp_batches(3)
    split = {"blocks/0": "colwise", "blocks/1": "rowwise"}
    step = pjit_step(mlp_loss, StageMLP(2), OPT, batches[0], jax.devices()[:2], "tp", split)
    assert_matches_reference(step, mlp_loss, lambda: StageMLP(2), OPT, batches)
    specs = {s.spec for s in (x.sharding for x in step._params)}
    assert jax.sharding.PartitionSpec(None, "tp") in specs
    assert jax.sharding.PartitionSpec("tp", None) in specs
    # the optimizer's moments are split as their parameters
    opt_specs = {x.sharding.spec for x in jax.tree.leaves(step._opt_state)}
    assert jax.sharding.PartitionSpec(None, "tp") in opt_specs
