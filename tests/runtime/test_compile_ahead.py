"""Compiling ahead (Note [compiling ahead] in mpmd_runtime/compile_ahead.py): before the
first step the executor compiles every distinct program of the step from abstract values,
and the step then calls exactly those programs: none is compiled a second time because
the layouts guessed ahead differ from the arrays' (a transfer's result, a reduction over
groups, ZeRO shards, tp-split parameters)."""

from __future__ import annotations

import optax
import pytest
from helpers import DUALPIPEV_MLP4, StageMLP, mlp_batches, mlp_loss, xla_compilations

import piper_jax as piper
from piper_jax import schedules

MEGATRON_MLP = {"blocks/0": "colwise", "blocks/1": "rowwise"}
STRATEGIES = {
    "dp2_zero3": [piper.replicate({"PP": "*"}, [0, 1], shard_params=True)],
    "pp2_1f1b": [
        piper.split({"PP": "*"}, num_microbatches=4),
        piper.place({"PP": 0}, [0]),
        piper.place({"PP": 1}, [1]),
        *schedules.one_f_one_b(2, 4),
    ],
    "pp2_dp2_zero2": [
        piper.split({"PP": "*"}, num_microbatches=2),
        piper.place({"PP": 0}, [0, 2]),
        piper.replicate({"PP": 0}, [0, 2], shard_grads=True),
        piper.place({"PP": 1}, [1, 3]),
        piper.replicate({"PP": 1}, [1, 3], shard_grads=True),
        *schedules.one_f_one_b(2, 2),
    ],
    "tp2": [piper.shard_tensor({"PP": "*"}, [0, 1], params=MEGATRON_MLP)],
}


@pytest.mark.parametrize("name", sorted(STRATEGIES))
def test_the_first_step_calls_the_programs_compiled_ahead(name: str) -> None:
    batch = mlp_batches(1)[0]
    step = piper.compile(mlp_loss, StageMLP(2), optax.adam(1e-2), batch, STRATEGIES[name])
    executor = step._executor
    executor.compile_workers = 2  # this machine's default is to compile on first call
    names = {f"jit({program.__name__})" for program in executor._unit_programs.values()}
    before = xla_compilations(names)
    step(batch)
    distinct = len(executor._unit_programs)
    assert executor.compiled_ahead == distinct
    assert xla_compilations(names) - before == distinct


def test_program_names_say_what_runs_and_stay_short() -> None:
    """A program is named after its step (what profiles and XLA dumps show), short
    enough for JAX's compilation cache, which names a file after it."""
    from piper_jax.mpmd_runtime.executor import _program_name
    from piper_jax.mpmd_runtime.instructions import parse_step

    step = parse_step("F0.3 + B0.3 + ALL_REDUCE gnorm d0 + UPD0")
    assert _program_name(step) == "F0_B0_AR_UPD0"
    many = parse_step(" + ".join(f"F{r}.0 + REDUCE_SCATTER grad[B{r}.0] d0,1" for r in range(30)))
    assert len(_program_name(many)) <= 60


IDENTICAL_STAGES = {
    "dualpipev": DUALPIPEV_MLP4,  # the middle stages on device 1
    # stages 1-3 of one data-parallel group, their gradients in one all-reduced bucket
    "dp2": [piper.replicate({"PP": "*"}, [0, 1])],
}


@pytest.mark.parametrize("name", sorted(IDENTICAL_STAGES))
def test_identical_stages_compile_their_shared_update_once_ahead(name: str) -> None:
    """Note [updates of identical stages] ahead of the first step: identical stages'
    updates share one program, which compiles once."""
    batch = mlp_batches(1)[0]
    step = piper.compile(mlp_loss, StageMLP(4), optax.adam(1e-2), batch, IDENTICAL_STAGES[name])
    executor = step._executor
    executor.compile_workers = 2
    names = {f"jit({program.__name__})" for program in executor._unit_programs.values()}
    before = xla_compilations(names)
    step(batch)
    programs = set(executor._unit_programs.values())
    shared = {"dualpipev": 1, "dp2": 2}[name]  # UPD2 (and UPD3) run UPD1's program
    assert len(programs) == len(executor._unit_programs) - shared
    assert xla_compilations(names) - before == len(programs)
