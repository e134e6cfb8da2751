"""Where the time to a first step goes: piper-jax next to pjit on the example GPT.

Builds each system from a fresh model and runs its first step, profiling piper-jax's to
split it into its phases: tracing the loss into regions (lift), the directive passes,
the optimizer check, the plan compiler, setting up the executor (parameters, optimizer
state, binding the steps) and the first step (XLA compiles every program while it
runs); then the time of a second step, which compiles nothing when every program's
inputs lie as the first step left them. The totals are timed without the profiler, the
breakdown comes from a second, profiled build (profiling slows the Python phases). One
run per system and strategy on 4 virtual CPU devices, about a minute.

Run: .venv/bin/python benchmarks/compile_time.py
"""

from __future__ import annotations

import cProfile
import functools
import os
import pstats
import sys
import time
from collections.abc import Callable

PHASES = {  # phase -> (file suffix, function) whose cumulative time it is
    "lift": ("ir/lift.py", "lift"),
    "directives": ("directives/apply.py", "apply_directives"),
    "optimizer check": ("piper_jax/optimizer_check.py", "plan_optimizer"),
    "plans": ("mpmd_runtime/plans.py", "compile_plans"),
    "executor set-up": ("mpmd_runtime/executor.py", "__init__"),
}


def phases(profile: cProfile.Profile) -> dict[str, float]:
    stats = pstats.Stats(profile).stats
    out = dict.fromkeys(PHASES, 0.0)
    for (path, _, name), (_, _, _, cumulative, _) in stats.items():
        for phase, (suffix, function) in PHASES.items():
            if path.endswith(suffix) and name == function:
                out[phase] += cumulative
    return out


def first_two_steps(build: Callable[[], Callable], batch: dict) -> tuple[float, float]:
    """Seconds to build a step and run it once, then seconds of a second step (which
    compiles nothing if every program's input layouts stay as the first step left them)."""
    t0 = time.perf_counter()
    step = build()
    step(batch)
    t1 = time.perf_counter()
    step(batch)
    return t1 - t0, time.perf_counter() - t1


def main() -> int:
    import jax

    jax.config.update("jax_platforms", "cpu")
    jax.config.update("jax_num_cpu_devices", 4)
    import optax
    from flax import nnx

    import piper_jax as piper
    from piper_jax.baselines import pjit_step

    here = os.path.dirname(os.path.abspath(__file__))
    sys.path.insert(0, os.path.join(here, "..", "examples"))
    from data import batches, encode, load_corpus
    from gpt import GPT, GPTConfig, loss_fn

    config = GPTConfig(seq_len=128, d_model=128, n_heads=4, n_layers=4, num_stages=1)
    batch = next(batches(encode(load_corpus(200_000)), 32, 128, 0))
    optimizer = optax.adamw(1e-3, weight_decay=0.01)
    print(f"{'strategy':<8}{'system':<7}{'total s':>9}{'2nd step s':>11}  breakdown (s)")
    for name, flags, strategy in (("DP", {}, "dp"), ("ZeRO-3", {"shard_params": True}, "fsdp")):
        model = GPT(config, rngs=nnx.Rngs(0))
        build = functools.partial(pjit_step, loss_fn, model, optimizer, batch, strategy=strategy)
        base, base_second = first_two_steps(build, batch)
        print(f"{name:<8}{'pjit':<7}{base:>9.2f}{base_second:>11.2f}")
        directives = [piper.replicate({"PP": "*"}, [0, 1, 2, 3], **flags)]
        model = GPT(config, rngs=nnx.Rngs(0))
        build = functools.partial(piper.compile, loss_fn, model, optimizer, batch, directives)
        total, second = first_two_steps(build, batch)
        # the breakdown from a second, profiled build (profiling slows the Python parts)
        profile = cProfile.Profile()
        profile.enable()
        step = piper.compile(loss_fn, GPT(config, rngs=nnx.Rngs(0)), optimizer, batch, directives)
        t1 = time.perf_counter()
        step(batch)
        profile.disable()
        parts = phases(profile) | {"first step": time.perf_counter() - t1}
        text = ", ".join(f"{k} {v:.2f}" for k, v in parts.items())
        print(
            f"{'':<8}{'piper':<7}{total:>9.2f}{second:>11.2f}  {text}  ({total / base:.2f}x pjit)"
        )
    return 0


if __name__ == "__main__":
    sys.exit(main())
