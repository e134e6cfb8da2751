"""piper-jax next to pjit: the example GPT trained under piper-jax DP and ZeRO-3, and under
one `jax.jit` step with NamedShardings ("dp", "fsdp"), on N virtual CPU devices.

Each step is built from a fresh model with the same seed and compiled once; after the
warm-up steps the piper and pjit steps take turns on the same --steps batches, so the final
losses should agree to ~1e-4. Prints step time (median), the piper/pjit ratio, final
losses and per-device memory (MiB of params + optimizer state on the fullest device).
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
import time
from typing import Any


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--devices", type=int, default=4, help="virtual CPU devices")
    parser.add_argument("--d-model", type=int, default=64)
    parser.add_argument("--layers", type=int, default=2)
    parser.add_argument("--heads", type=int, default=4)
    parser.add_argument("--seq-len", type=int, default=64)
    parser.add_argument("--batch-size", type=int, default=16, help="global batch size")
    parser.add_argument("--steps", type=int, default=10, help="timed steps per run")
    parser.add_argument("--warmup", type=int, default=2, help="untimed steps per run (>= 1)")
    parser.add_argument("--lr", type=float, default=1e-3)
    parser.add_argument("--seed", type=int, default=0)
    args = parser.parse_args(argv)
    if args.warmup < 1 or args.steps < 1:
        parser.error("--warmup and --steps must be at least 1 (the first step compiles)")
    return args


def start(build: Any, batches: list, warmup: int) -> tuple[Any, float]:
    """Build a step and take the warm-up steps: (step, seconds to the end of the first step,
    which builds and compiles). Steps return host floats, so each has finished on return."""
    t0 = time.perf_counter()
    step = build()
    step(batches[0])
    first = time.perf_counter() - t0
    for batch in batches[1:warmup]:
        step(batch)
    return step, first


def race(steps: dict[str, Any], batches: list) -> dict[str, tuple[float, float]]:
    """{name: (median seconds per step, last loss)}, the steps taking turns on each batch so
    that a change in machine load hits all of them alike."""
    times: dict[str, list[float]] = {name: [] for name in steps}
    losses: dict[str, float] = {}
    for batch in batches:
        for name, step in steps.items():
            t0 = time.perf_counter()
            losses[name] = step(batch)["loss"]
            times[name].append(time.perf_counter() - t0)
    return {name: (statistics.median(times[name]), losses[name]) for name in steps}


def memory_str(step: Any) -> str:
    memory = getattr(step, "memory", None)
    if memory is None:
        return "n/a"
    m = memory()
    if m and all(isinstance(v, dict) for v in m.values()):  # piper: per device, take the fullest
        m = max(m.values(), key=lambda row: row.get("params", 0) + row.get("opt_state", 0))
    return f"{m.get('params', 0) / 2**20:.2f}+{m.get('opt_state', 0) / 2**20:.2f}"


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    import jax

    jax.config.update("jax_platforms", "cpu")
    jax.config.update("jax_num_cpu_devices", args.devices)
    import optax
    from flax import nnx

    import piper_jax as piper
    from piper_jax.baselines import pjit_step

    sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
    from data import batches, encode, load_corpus
    from gpt import GPT, GPTConfig, loss_fn

    sizes = dict(d_model=args.d_model, n_heads=args.heads, n_layers=args.layers)
    config = GPTConfig(seq_len=args.seq_len, num_stages=1, **sizes)
    stream = batches(encode(load_corpus(200_000)), args.batch_size, args.seq_len, args.seed)
    data = [next(stream) for _ in range(args.warmup + args.steps)]
    optimizer = optax.adamw(args.lr, weight_decay=0.01)
    devices = list(range(args.devices))

    def model() -> Any:
        return GPT(config, rngs=nnx.Rngs(args.seed))

    n_params = sum(x.size for x in jax.tree.leaves(nnx.state(model(), nnx.Param)))
    print(
        f"GPT d_model={args.d_model} layers={args.layers} seq={args.seq_len} "
        f"batch={args.batch_size}: {n_params / 1e6:.2f}M params on {args.devices} CPU devices; "
        f"{args.warmup} warm-up + {args.steps} timed steps"
    )
    zero3 = dict(shard_params=True, shard_grads=True)
    rows = [("DP", {}, "dp"), ("ZeRO-3/FSDP", zero3, "fsdp")]
    header = (
        f"{'strategy':<13}{'piper ms':>10}{'pjit ms':>10}{'ratio':>8}"
        f"{'piper loss':>12}{'pjit loss':>12}{'|dloss|':>10}  memory MiB params+opt piper | pjit"
    )
    print(header)
    print("-" * len(header))
    ratios = []
    for name, flags, strategy in rows:
        base, base_first = start(
            lambda s=strategy: pjit_step(loss_fn, model(), optimizer, data[0], strategy=s),
            data,
            args.warmup,
        )
        directives = [piper.replicate({"PP": "*"}, devices, **flags)]
        try:
            step, piper_first = start(
                lambda d=directives: piper.compile(loss_fn, model(), optimizer, data[0], d),
                data,
                args.warmup,
            )
        except piper.PiperError as e:
            base_t, base_loss = race({"pjit": base}, data[args.warmup :])["pjit"]
            message = str(e).splitlines()[0][:100]
            print(
                f"{name:<13}{'n/a':>10}{base_t * 1e3:>10.1f}{'n/a':>8}{'n/a':>12}"
                f"{base_loss:>12.5f}{'':>10}  n/a | {memory_str(base)}   (piper: n/a ({message}))"
            )
            continue
        timings = race({"piper": step, "pjit": base}, data[args.warmup :])
        (piper_t, piper_loss), (base_t, base_loss) = timings["piper"], timings["pjit"]
        ratio = piper_t / base_t
        ratios.append((name, ratio, piper_t, base_t, piper_first, base_first))
        print(
            f"{name:<13}{piper_t * 1e3:>10.1f}{base_t * 1e3:>10.1f}{ratio:>7.2f}x"
            f"{piper_loss:>12.5f}{base_loss:>12.5f}{abs(piper_loss - base_loss):>10.1e}"
            f"  {memory_str(step)} | {memory_str(base)}"
        )
    for name, ratio, piper_t, base_t, piper_first, base_first in ratios:
        print(
            f"ratio {name}: piper/pjit = {ratio:.2f}x ({piper_t * 1e3:.1f} ms vs "
            f"{base_t * 1e3:.1f} ms per step; build+compile+first step "
            f"{piper_first:.1f}s vs {base_first:.1f}s)"
        )
    return 0


if __name__ == "__main__":
    sys.exit(main())
