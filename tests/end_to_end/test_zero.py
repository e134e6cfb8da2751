"""ZeRO-2/3 (replicate with shard_grads / shard_params) against the single-device oracle,
and the memory each saves (see Note [ZeRO in piper-jax])."""

from __future__ import annotations

import optax
import pytest
from helpers import StageMLP, check_mlp_strategy, mlp_batches, mlp_loss, reference_run
from piper_jax.mpmd_runtime import zero

import piper_jax as piper
from piper_jax import schedules

# clip_by_global_norm needs the norm over all stages and shards; 0.05 is below the
# gradient norm of every step here, so the clip is active (checked below)
OPT = optax.chain(
    optax.clip_by_global_norm(0.05),
    optax.adamw(optax.linear_schedule(1e-2, 1e-3, 3), weight_decay=0.1),
)
ZERO = {"zero2": {"shard_grads": True}, "zero3": {"shard_params": True}}


def dp4(flags: dict) -> list:
    return [
        piper.split({"PP": "*"}, num_microbatches=2),
        piper.replicate({"PP": "*"}, [0, 1, 2, 3], **flags),
    ]


def pp2_dp2(flags: dict) -> list:
    directives = [piper.split({"PP": "*"}, num_microbatches=2)]
    for s in range(2):  # the tied embedding is shared by both stages: a cross-group sum
        directives += [
            piper.place({"PP": s}, [s, s + 2]),
            piper.replicate({"PP": s}, [s, s + 2], **flags),
        ]
    return directives + schedules.one_f_one_b(2, 2)


@pytest.mark.parametrize("layout", [dp4, pp2_dp2])
@pytest.mark.parametrize("stage", sorted(ZERO))
def test_zero_matches_single_device(stage: str, layout) -> None:
    check_mlp_strategy(layout(ZERO[stage]), OPT)


@pytest.mark.parametrize("layout", [dp4, pp2_dp2])
@pytest.mark.parametrize("stage", sorted(ZERO))
def test_zero_with_a_collective_per_parameter(
    stage: str, layout, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The MLP's parameters are too small to get a collective each (Note [one collective
    for many parameters]); with the threshold at 0 they do, and train the same."""
    monkeypatch.setattr(zero, "OWN_COLLECTIVE_MEAN", 0)
    check_mlp_strategy(layout(ZERO[stage]), OPT)


# Adam hides a wrong clip factor (it is nearly invariant to scaling its gradients); with
# SGD every error in the global norm changes the step, so the norm itself is checked here.
CLIP_SGD = optax.chain(optax.clip_by_global_norm(0.05), optax.sgd(0.5))


def test_the_clip_is_active() -> None:
    clipped, _ = reference_run(mlp_loss, StageMLP(2), CLIP_SGD, mlp_batches(3))
    plain, _ = reference_run(mlp_loss, StageMLP(2), optax.sgd(0.5), mlp_batches(3))
    assert abs(clipped[-1] - plain[-1]) > 1e-2


@pytest.mark.parametrize("layout", [dp4, pp2_dp2])
@pytest.mark.parametrize("stage", sorted(ZERO))
def test_global_norm_over_stages_and_shards(stage: str, layout) -> None:
    check_mlp_strategy(layout(ZERO[stage]), CLIP_SGD)


def memory(flags: dict) -> dict[str, int]:
    step = piper.compile(
        mlp_loss, StageMLP(2, width=64), optax.adam(1e-3), mlp_batches(1)[0], dp4(flags)
    )
    table = step.memory()
    assert sorted(table) == [0, 1, 2, 3]
    return table[0]


def test_zero_memory_per_device() -> None:
    dp, zero2, zero3 = memory({}), memory(ZERO["zero2"]), memory(ZERO["zero3"])
    small = 1024  # padding to a multiple of 4 and optimizer step counters
    assert zero2["grads"] <= dp["grads"] / 4 + small
    assert zero2["opt_state"] <= dp["opt_state"] / 4 + small
    assert zero2["params"] == dp["params"]
    assert zero3["params"] + zero3["opt_state"] <= (dp["params"] + dp["opt_state"]) / 4 + small
    assert zero3["grads"] <= dp["grads"] / 4 + small
    # no residual keeps a (gathered) weight, under ZeRO-3 or not: the same activations
    assert zero3["activations"] == dp["activations"]


@pytest.mark.parametrize("layout", [dp4, pp2_dp2])
def test_zero3_with_recompute_matches_single_device(layout) -> None:
    """F keeps only the region inputs and B gathers the parameters again to recompute."""
    step = check_mlp_strategy(layout(ZERO["zero3"]) + [piper.recompute({"PP": "*"})], OPT)
    assert all(n.recompute for n in step.dag.compute_nodes() if n.pass_ == "B")


def _zb_h1(flags: dict) -> tuple[int, list]:
    directives = [piper.split({"PP": "*"}, num_microbatches=4)]
    for s in range(2):
        directives += [
            piper.place({"PP": s}, [s, s + 2]),
            piper.replicate({"PP": s}, [s, s + 2], **flags),
        ]
    return 2, directives + schedules.zero_bubble_h1(2, 4)


def _dualpipev(flags: dict) -> tuple[int, list]:
    """2 ranks of 2 replicas each; rank r holds stages r and 3 - r."""
    directives = [piper.split({"PP": "*"}, num_microbatches=4)]
    for s in range(4):
        rank = min(s, 3 - s)
        directives += [
            piper.place({"PP": s}, [rank, rank + 2]),
            piper.replicate({"PP": s}, [rank, rank + 2], **flags),
        ]
    return 4, directives + schedules.dualpipev(2, 4)


@pytest.mark.parametrize("layout", [_zb_h1, _dualpipev], ids=["zb_h1", "dualpipev"])
@pytest.mark.parametrize("stage", sorted(ZERO))
def test_zero_with_split_backward_schedules_matches_single_device(stage: str, layout) -> None:
    """ZB-H1 and DualPipeV split each backward into BI and BW (DualPipeV also fuses F&B
    pairs into one program); under ZeRO-3 both BI and BW gather the parameters F dropped,
    and BW reduce-scatters the weight gradients."""
    num_stages, directives = layout(ZERO[stage])
    step = check_mlp_strategy(directives, OPT, num_stages)
    assert {n.pass_ for n in step.dag.compute_nodes()} >= {"BI", "BW"}


@pytest.mark.parametrize("stage", sorted(ZERO))
def test_zero_on_single_device_groups_sharing_a_tied_weight(stage: str) -> None:
    """Groups of one replica still keep ZeRO's (1, k) shard rows; the tied embedding's
    gradient is summed across the two groups shard by shard."""
    directives = [piper.split({"PP": "*"}, num_microbatches=2)]
    for s in range(2):
        directives += [piper.place({"PP": s}, [s]), piper.replicate({"PP": s}, [s], **ZERO[stage])]
    check_mlp_strategy(directives + schedules.one_f_one_b(2, 2), OPT)


@pytest.mark.parametrize("stage", sorted(ZERO))
def test_bucket_size_cuts_zero_reduce_scatters(stage: str) -> None:
    """Under ZeRO, bucket_size cuts each backward's reduce-scatter into collectives of at
    most that many MB (as the reference does), with the same training."""
    directives = [
        piper.split({"PP": "*"}, num_microbatches=2),
        piper.replicate({"PP": "*"}, [0, 1], bucket_size=0.0005, **ZERO[stage]),
    ]  # ~500 bytes: a 16 x 16 kernel alone
    step = check_mlp_strategy(directives, OPT)
    text = step.explain()
    assert "REDUCE_SCATTER grad[B1.0]/0 d0,1" in text and "REDUCE_SCATTER grad[B1.0]/1" in text
