"""Where the time to a first step goes: piper-jax next to pjit on the example GPT.

Builds each system from a fresh model and runs its first step, profiling piper-jax's to
split it into its phases: tracing the loss into regions (lift), the directive passes,
the optimizer check, the plan compiler, setting up the executor (parameters, optimizer
state, binding the steps) and the first step (XLA compiles every program while it
runs); then the time of a second step, which compiles nothing when every program's
inputs lie as the first step left them. The totals are timed without the profiler, the
breakdown comes from a second, profiled build (profiling slows the Python parts). For
both systems, "trace", "lower" and "XLA" are JAX's own seconds (jax.monitoring) spent
tracing programs to jaxprs, lowering them to StableHLO and compiling them with XLA during
the timed build and first step, summed over the programs.

Every measurement runs in a process of its own (JAX caches traces and programs within a
process, so a system built second would reuse what the first compiled), on 4 virtual CPU
devices, pjit and piper-jax taking turns first; over `--rounds` rounds the ratio is the
median of each round's piper / pjit, with its range. About 20 s per round.

Run: .venv/bin/python benchmarks/compile_time.py [--rounds 3]
"""

from __future__ import annotations

import argparse
import cProfile
import functools
import json
import os
import pstats
import statistics
import subprocess
import sys
import time
from collections.abc import Callable

STRATEGIES = {"DP": ({}, "dp"), "ZeRO-3": ({"shard_params": True}, "fsdp")}
SYSTEMS = ("pjit", "piper")
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


# JAX's own durations of what it does for each program (jax.monitoring events), summed
# over the programs: tracing to a jaxpr, lowering it to StableHLO, XLA's compile.
JAX_DURATIONS = {
    "/jax/core/compile/jaxpr_trace_duration": "trace",
    "/jax/core/compile/jaxpr_to_mlir_module_duration": "lower",
    "/jax/core/compile/backend_compile_duration": "XLA",
}


def first_two_steps(
    build: Callable[[], Callable], batch: dict
) -> tuple[float, float, dict[str, float]]:
    """Seconds to build a step and run it once, then seconds of a second step (which
    compiles nothing if every program's input layouts stay as the first step left them),
    and JAX's trace, lower and XLA-compile seconds of the build and first step."""
    import jax

    durations = dict.fromkeys(JAX_DURATIONS.values(), 0.0)
    timing = [True]

    def listener(event: str, seconds: float, **_: object) -> None:
        if timing[0] and event in JAX_DURATIONS:
            durations[JAX_DURATIONS[event]] += seconds

    jax.monitoring.register_event_duration_secs_listener(listener)
    t0 = time.perf_counter()
    step = build()
    step(batch)
    t1 = time.perf_counter()
    timing[0] = False
    step(batch)
    return t1 - t0, time.perf_counter() - t1, durations


def measure(system: str, strategy: str) -> dict:
    """One system's build + first step and second step (and piper-jax's phases)."""
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
    flags, pjit_strategy = STRATEGIES[strategy]
    model = GPT(config, rngs=nnx.Rngs(0))  # starts the backend and compiles the init
    if system == "pjit":
        build = functools.partial(
            pjit_step, loss_fn, model, optimizer, batch, strategy=pjit_strategy
        )
        total, second, jax_parts = first_two_steps(build, batch)
        return {"total": total, "second": second, "jax": jax_parts}
    directives = [piper.replicate({"PP": "*"}, [0, 1, 2, 3], **flags)]
    build = functools.partial(piper.compile, loss_fn, model, optimizer, batch, directives)
    total, second, jax_parts = first_two_steps(build, batch)
    # the breakdown from a second, profiled build (profiling slows the Python parts)
    profile = cProfile.Profile()
    profile.enable()
    step = piper.compile(loss_fn, GPT(config, rngs=nnx.Rngs(0)), optimizer, batch, directives)
    t1 = time.perf_counter()
    step(batch)
    profile.disable()
    parts = phases(profile) | {"first step": time.perf_counter() - t1}
    return {"total": total, "second": second, "jax": jax_parts, "phases": parts}


def in_own_process(system: str, strategy: str) -> dict:
    cmd = [sys.executable, os.path.abspath(__file__), "--one", system, strategy]
    out = subprocess.run(cmd, capture_output=True, text=True, timeout=600, check=True)
    return json.loads(out.stdout.strip().splitlines()[-1])


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--one", nargs=2, metavar=("SYSTEM", "STRATEGY"), help=argparse.SUPPRESS)
    args = parser.parse_args(argv)
    if args.one:
        print(json.dumps(measure(*args.one)))
        return 0
    print(f"load average before: {os.getloadavg()[0]:.2f}")
    print(
        f"{'round':<6}{'strategy':<9}{'system':<7}{'total s':>9}{'2nd step s':>11}  breakdown (s)"
    )
    ratios: dict[str, list[float]] = {s: [] for s in STRATEGIES}
    for r in range(args.rounds):
        for strategy in STRATEGIES:
            order = SYSTEMS if r % 2 == 0 else SYSTEMS[::-1]
            got = {system: in_own_process(system, strategy) for system in order}
            ratios[strategy].append(got["piper"]["total"] / got["pjit"]["total"])
            for system in SYSTEMS:
                m = got[system]
                parts = m["jax"] | m.get("phases", {})
                text = ", ".join(f"{k} {v:.2f}" for k, v in parts.items())
                print(
                    f"{r:<6}{strategy:<9}{system:<7}{m['total']:>9.2f}{m['second']:>11.2f}  {text}"
                )
    print(f"load average after: {os.getloadavg()[0]:.2f}")
    for strategy, values in ratios.items():
        print(
            f"{strategy}: piper-jax / pjit, build + first step: median "
            f"{statistics.median(values):.2f}x (range {min(values):.2f}-{max(values):.2f}x, "
            f"{len(values)} rounds)"
        )
    return 0


if __name__ == "__main__":
    sys.exit(main())
