"""The MPMD runtime: plan compiler, instruction set, replay, executor."""

from piper_jax.mpmd_runtime.executor import Executor
from piper_jax.mpmd_runtime.instructions import Instruction, Step, parse, parse_step
from piper_jax.mpmd_runtime.plans import Plans, compile_plans
from piper_jax.mpmd_runtime.replay import dry_run, replay

__all__ = [
    "Executor",
    "Instruction",
    "Plans",
    "Step",
    "compile_plans",
    "dry_run",
    "parse",
    "parse_step",
    "replay",
]
