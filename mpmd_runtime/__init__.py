"""The MPMD runtime: plan compiler, instruction set, executor."""

from piper_jax.mpmd_runtime.executor import Executor
from piper_jax.mpmd_runtime.instructions import Instruction, parse
from piper_jax.mpmd_runtime.plans import Plans, compile_plans, dry_run

__all__ = ["Executor", "Instruction", "Plans", "compile_plans", "dry_run", "parse"]
