"""One-GPU step time and MFU of the example GPT: piper-jax with no directives next to a
plain `jax.jit` value_and_grad + optax step (piper_jax.baselines.pjit_step, "dp" on one
device), piper-jax with its forward and backward as two programs (fuse_passes=False), to
show what fusing them saves, piper-jax without its non-finite gradient guard
(nonfinite="ignore"), to show what the guard costs, and piper-jax keeping only inputs and
matrix products' outputs for the backward (recompute keep="dots"). fp32 parameters and
activations (XLA's default matmul precision). --profile adds where each run's step time
went, from a jax.profiler trace (benchmarks/trace_summary.py).

MFU = 6 * params * tokens per step / step time / peak FLOP/s; 6N per token leaves out the
attention score FLOPs, so it slightly understates the work. --cpu-smoke runs a tiny
config on the CPU to check the script itself.

Run: .venv/bin/python benchmarks/gpu_step.py [--peak-tflops 989] [--cpu-smoke]
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
import time
from typing import Any

TINY = {"d_model": 64, "layers": 2, "heads": 4, "seq_len": 64, "batch_size": 4, "steps": 3}


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--d-model", type=int, default=768)
    parser.add_argument("--layers", type=int, default=12)
    parser.add_argument("--heads", type=int, default=12)
    parser.add_argument("--seq-len", type=int, default=512)
    parser.add_argument("--batch-size", type=int, default=8)
    parser.add_argument("--vocab", type=int, default=128, help="vocabulary size (tied head)")
    parser.add_argument("--steps", type=int, default=10, help="timed steps per run")
    parser.add_argument("--warmup", type=int, default=2, help="untimed steps (>= 1)")
    parser.add_argument(
        "--peak-tflops",
        type=float,
        default=989.0,
        help="peak dense TFLOP/s for MFU (default 989: H100/H200 SXM dense bf16)",
    )
    parser.add_argument("--cpu-smoke", action="store_true", help="tiny config on the CPU")
    parser.add_argument(
        "--profile",
        metavar="DIR",
        help="also trace --traced steps of each run with jax.profiler into DIR and print "
        "where their time went (benchmarks/trace_summary.py)",
    )
    parser.add_argument("--traced", type=int, default=3, help="steps traced per run")
    parser.add_argument(
        "--only", help="comma-separated names of the runs to time (default: all); pjit always"
    )
    args = parser.parse_args(argv)
    if args.cpu_smoke:
        for name, value in TINY.items():
            setattr(args, name, value)
    if args.warmup < 1 or args.steps < 1:
        parser.error("--warmup and --steps must be at least 1 (the first step compiles)")
    return args


def timed(build: Any, batch: dict, warmup: int, steps: int) -> tuple[Any, float, float, float]:
    """(the step, seconds to the end of its first call, median seconds per step, last
    loss)."""
    t0 = time.perf_counter()
    step = build()
    step(batch)
    first = time.perf_counter() - t0
    for _ in range(warmup - 1):
        step(batch)
    times, loss = [], float("nan")
    for _ in range(steps):
        t0 = time.perf_counter()
        loss = step(batch)["loss"]  # a host float: the step has finished
        times.append(time.perf_counter() - t0)
    return step, first, statistics.median(times), loss


def traced(step: Any, batch: dict, steps: int, folder: str) -> list[str]:
    """Where `steps` calls of `step` spent their time, by a jax.profiler trace."""
    import glob

    import jax
    from trace_summary import summarize

    os.makedirs(folder, exist_ok=True)
    before = set(glob.glob(os.path.join(folder, "**", "*.xplane.pb"), recursive=True))
    jax.profiler.start_trace(folder)
    try:
        for _ in range(steps):
            step(batch)
    finally:
        jax.profiler.stop_trace()
    (path,) = set(glob.glob(os.path.join(folder, "**", "*.xplane.pb"), recursive=True)) - before
    return summarize(path, steps)


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    import jax

    if args.cpu_smoke:
        jax.config.update("jax_platforms", "cpu")
    import numpy as np
    import optax
    from flax import nnx

    import piper_jax as piper
    from piper_jax.baselines import pjit_step

    sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "examples"))
    from gpt import GPT, GPTConfig, loss_fn

    devices = jax.devices()[:1] if args.cpu_smoke else jax.devices("gpu")[:1]
    config = GPTConfig(
        vocab_size=args.vocab,
        seq_len=args.seq_len,
        d_model=args.d_model,
        n_heads=args.heads,
        n_layers=args.layers,
        num_stages=1,
    )
    ids = np.random.default_rng(0).integers(0, args.vocab, (args.batch_size, args.seq_len + 1))
    batch = {"tokens": ids[:, :-1].astype(np.int32), "targets": ids[:, 1:].astype(np.int32)}
    optimizer = optax.adamw(3e-4, weight_decay=0.01)

    def model() -> Any:
        return GPT(config, rngs=nnx.Rngs(0))

    n_params = sum(x.size for x in jax.tree.leaves(nnx.state(model(), nnx.Param)))
    flops = 6 * n_params * args.batch_size * args.seq_len
    peak = args.peak_tflops * 1e12
    print(
        f"device {devices[0].device_kind} ({devices[0].platform}); GPT d_model={args.d_model} "
        f"layers={args.layers} heads={args.heads} seq={args.seq_len} batch={args.batch_size} "
        f"vocab={args.vocab}: {n_params / 1e6:.1f}M params, fp32; MFU against a peak of "
        f"{args.peak_tflops:g} TFLOP/s (--peak-tflops; 989 = H100/H200 dense bf16)"
    )

    def piper_step(directives: tuple = (), **flags: Any) -> Any:
        return piper.compile(loss_fn, model(), optimizer, batch, list(directives), devices, **flags)

    runs = {
        "pjit": lambda: pjit_step(loss_fn, model(), optimizer, batch, devices, "dp"),
        "piper": piper_step,
        "piper, passes apart": lambda: piper_step(fuse_passes=False),
        "piper, no non-finite guard": lambda: piper_step(nonfinite="ignore"),
        "piper, keeping dots": lambda: piper_step(
            directives=[piper.recompute({"PP": "*"}, keep="dots")]
        ),
    }
    if args.only:
        wanted = {"pjit", *args.only.split(",")}
        runs = {name: build for name, build in runs.items() if name in wanted}
    results = {}
    for name, build in runs.items():
        step, first, step_s, loss = timed(build, batch, args.warmup, args.steps)
        results[name] = step_s
        print(
            f"{name:<26} first step (build+compile) {first:7.1f} s   step {step_s * 1e3:9.2f} ms "
            f"(median of {args.steps})   {flops / step_s / 1e12:8.2f} TFLOP/s   "
            f"MFU {flops / step_s / peak:6.2%}   loss {loss:.5f}"
        )
        if args.profile:
            folder = os.path.join(args.profile, "".join(c if c.isalnum() else "_" for c in name))
            for line in traced(step, batch, args.traced, folder):
                print(f"    {line}")
        del step
    for name in list(runs)[1:]:
        ratio = results[name] / results["pjit"]
        print(f"ratio {name} / pjit = {ratio:.3f}x (step time; 1.0 = no overhead)")
    return 0


if __name__ == "__main__":
    sys.exit(main())
