"""A region's forward and backward of one microbatch in one program (`fuse_passes`, Note
[a forward and its backward in one program] in mpmd_runtime/scheduler.py): where a group
runs B right after its F, the plans hold one step "F1.0 + B1.0", its program keeps the
residuals inside, and training still equals single-device value_and_grad."""

from __future__ import annotations

import optax
import pytest
from helpers import StageMLP, check_mlp_strategy, mlp_batches, mlp_loss
from piper_jax.mpmd_runtime import buffers as bf

import piper_jax as piper
from piper_jax import schedules

OPT = optax.adam(1e-2)


def pp2(m: int, schedule) -> list:
    return [
        piper.split({"PP": "*"}, num_microbatches=m),
        piper.place({"PP": 0}, [0]),
        piper.place({"PP": 1}, [1]),
        *schedule(2, m),
    ]


STRATEGIES = {
    # fused: F1+B1 (the loss region); F0 and B0 are apart
    "no_directives": ([], {(0,): ["F1.0 + B1.0"]}),
    "one_group_m2": (
        [piper.split({"PP": "*"}, num_microbatches=2)],
        {(0,): ["F1.0 + B1.0", "F1.1 + B1.1"]},
    ),
    # the last stage of 1F1B runs each microbatch's F and B back to back
    "pp2_1f1b_m4": (pp2(4, schedules.one_f_one_b), {(1,): [f"F1.{k} + B1.{k}" for k in range(4)]}),
    # ZeRO-2: the reduce-scatter of B's gradients joins the fused step
    "dp2_zero2": (
        [piper.replicate({"PP": "*"}, [0, 1], shard_grads=True)],
        {(0, 1): ["F1.0 + B1.0 + REDUCE_SCATTER grad[B1.0] d0,1"]},
    ),
    "recompute_dots": (
        [piper.recompute({"PP": "*"}, keep="dots")],
        {(0,): ["F1.0 + B1.0"]},
    ),
}


@pytest.mark.parametrize("name", sorted(STRATEGIES))
def test_fused_passes_match_single_device(name: str) -> None:
    directives, fused = STRATEGIES[name]
    step = check_mlp_strategy(directives, OPT, fuse_passes=True)
    for group, wanted in fused.items():
        texts = [str(s) for s in step.plans.steps[group]]
        assert [t for t in texts if " + B" in t] == wanted, texts
    for unit in step._executor._units.values():  # no program hands region 1's residuals out
        kept = [b for b in unit.outputs if b.kind is bf.Kind.RES and b.name.startswith("R1.")]
        assert not kept, (unit.group, kept)


def test_passes_stay_apart_unless_asked_on_the_cpu() -> None:
    batch = mlp_batches(1)[0]
    step = piper.compile(mlp_loss, StageMLP(2), OPT, batch)
    assert not any(" + B" in str(s) for s in step.plans.steps[(0,)])
    lowered = piper.lower(mlp_loss, StageMLP(2), OPT, batch, fuse_passes=True)
    assert "F1.0 + B1.0" in [str(s) for s in lowered.plans.steps[(0,)]]


def test_fused_program_fences_the_residuals_on_the_cpu() -> None:
    """On XLA:CPU the fused program hands the forward's residuals to the backward through
    an optimization barrier (Note [a forward and its backward in one program])."""
    batch = mlp_batches(1)[0]
    step = piper.compile(mlp_loss, StageMLP(2), OPT, batch, fuse_passes=True)
    step(batch)
    texts = step._executor.program_texts(optimized=False)
    fused = [t for label, t in texts.items() if "F1.0 + B1.0" in label]
    assert len(fused) == 1, list(texts)
    assert "optimization_barrier" in fused[0]
    apart = [t for label, t in texts.items() if label.endswith("F0.0")]
    assert apart and "optimization_barrier" not in apart[0], list(texts)
