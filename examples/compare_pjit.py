"""piper-jax next to pjit: the example GPT trained under piper-jax DP, ZeRO-3 or tensor
parallelism, and under one `jax.jit` step with the same NamedShardings ("dp", "fsdp",
"tp"), on N virtual CPU devices.

Each step is built from a fresh model with the same seed and compiled once. After the
warm-up steps come --rounds rounds; in each, piper and pjit in turn (the order alternating)
run one untimed and --steps timed steps on the same batches, so their final losses should
agree to ~1e-4. Prints step time (median), the piper/pjit ratio (the median over rounds of
each round's ratio of block medians, with its range and the CPU-time ratio), final losses
and per-device memory (MiB of params + optimizer state on the fullest device).
"""

from __future__ import annotations

import argparse
import dataclasses
import os
import statistics
import sys
import time
from typing import Any

# the example GPT's Linear layers split as Megatron-LM splits a transformer block
MEGATRON = {"qkv": "colwise", "attn/out": "rowwise", "fc": "colwise", "proj": "rowwise"}


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--devices", type=int, default=4, help="virtual CPU devices")
    parser.add_argument("--d-model", type=int, default=64)
    parser.add_argument("--layers", type=int, default=2)
    parser.add_argument("--heads", type=int, default=4)
    parser.add_argument("--seq-len", type=int, default=64)
    parser.add_argument("--batch-size", type=int, default=16, help="global batch size")
    parser.add_argument("--steps", type=int, default=5, help="timed steps per block")
    parser.add_argument(
        "--rounds", type=int, default=3, help="rounds of one block per system, order alternating"
    )
    parser.add_argument("--warmup", type=int, default=2, help="untimed steps per run (>= 1)")
    parser.add_argument("--lr", type=float, default=1e-3)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument(
        "--strategies",
        default="dp,zero3",
        help="comma-separated: dp (DP), zero3 (ZeRO-3 vs FSDP), tp (tensor parallelism over "
        "all devices, Megatron-style, vs the same sharding under pjit)",
    )
    args = parser.parse_args(argv)
    unknown = set(args.strategies.split(",")) - {"dp", "zero3", "tp"}
    if unknown:
        parser.error(f"--strategies: unknown {sorted(unknown)}; use dp, zero3, tp")
    if args.warmup < 1 or args.steps < 1 or args.rounds < 1:
        parser.error("--warmup, --steps and --rounds must be at least 1 (the first step compiles)")
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


@dataclasses.dataclass
class Race:
    """Per-round block medians of two or more steps run on the same batches."""

    seconds: dict[str, list[float]]  # name -> median wall seconds per step, one per round
    cpu: dict[str, list[float]]  # name -> median process CPU seconds per step, per round
    loss: dict[str, float]  # name -> loss of its last step

    def ratio(self, name: str, base: str, clock: str = "wall") -> list[float]:
        """`name`'s time over `base`'s, round by round."""
        times = self.seconds if clock == "wall" else self.cpu
        return [a / b for a, b in zip(times[name], times[base])]


def race(steps: dict[str, Any], batches: list, rounds: int) -> Race:
    """Run `rounds` rounds; in each, every step takes one untimed step and then the same
    block of batches, the order of the steps alternating from round to round.

    Blocks, not step-by-step turns: a step right after another system's step pays for
    that system's allocations and cache state (page faults and cold caches on CPU were
    worth 10-20% here), which no training run does; alternating the order and taking
    the median over rounds still cancels the machine's drift in load.
    """
    seconds: dict[str, list[float]] = {name: [] for name in steps}
    cpu: dict[str, list[float]] = {name: [] for name in steps}
    loss: dict[str, float] = {}
    names = list(steps)
    for r in range(rounds):
        for name in names if r % 2 == 0 else names[::-1]:
            step = steps[name]
            step(batches[0])
            wall, work = [], []
            for batch in batches[1:]:
                t0, c0 = time.perf_counter(), time.process_time()
                loss[name] = step(batch)["loss"]
                wall.append(time.perf_counter() - t0)
                work.append(time.process_time() - c0)
            seconds[name].append(statistics.median(wall))
            cpu[name].append(statistics.median(work))
    return Race(seconds, cpu, loss)


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
    data = [next(stream) for _ in range(args.warmup + 1 + args.steps)]
    optimizer = optax.adamw(args.lr, weight_decay=0.01)
    devices = list(range(args.devices))

    def model() -> Any:
        return GPT(config, rngs=nnx.Rngs(args.seed))

    n_params = sum(x.size for x in jax.tree.leaves(nnx.state(model(), nnx.Param)))
    print(
        f"GPT d_model={args.d_model} layers={args.layers} seq={args.seq_len} "
        f"batch={args.batch_size}: {n_params / 1e6:.2f}M params on {args.devices} CPU devices; "
        f"{args.warmup} warm-up steps, then {args.rounds} rounds of 1 + {args.steps} "
        "steps per system"
    )
    everything = {"PP": "*"}
    rows = {
        "dp": ("DP", [piper.replicate(everything, devices)], {"strategy": "dp"}),
        "zero3": (
            "ZeRO-3/FSDP",
            [piper.replicate(everything, devices, shard_params=True)],
            {"strategy": "fsdp"},
        ),
        "tp": (
            "TP",
            [piper.shard_tensor(everything, devices, params=MEGATRON)],
            {"strategy": "tp", "tensor_params": MEGATRON},
        ),
    }
    header = (
        f"{'strategy':<13}{'piper ms':>10}{'pjit ms':>10}{'ratio':>8}"
        f"{'piper loss':>12}{'pjit loss':>12}{'|dloss|':>10}  memory MiB params+opt piper | pjit"
    )
    print(header)
    print("-" * len(header))
    block = data[args.warmup :]
    summaries = []
    for key in args.strategies.split(","):
        name, directives, baseline = rows[key]
        base, base_first = start(
            lambda b=baseline: pjit_step(loss_fn, model(), optimizer, data[0], **b),
            data,
            args.warmup,
        )
        try:
            step, piper_first = start(
                lambda d=directives: piper.compile(loss_fn, model(), optimizer, data[0], d),
                data,
                args.warmup,
            )
        except piper.PiperError as e:
            result = race({"pjit": base}, block, args.rounds)
            message = str(e).splitlines()[0][:100]
            print(
                f"{name:<13}{'n/a':>10}{statistics.median(result.seconds['pjit']) * 1e3:>10.1f}"
                f"{'n/a':>8}{'n/a':>12}{result.loss['pjit']:>12.5f}{'':>10}  n/a | "
                f"{memory_str(base)}   (piper: n/a ({message}))"
            )
            continue
        result = race({"piper": step, "pjit": base}, block, args.rounds)
        piper_t, base_t = (statistics.median(result.seconds[k]) for k in ("piper", "pjit"))
        ratios = result.ratio("piper", "pjit")
        piper_loss, base_loss = result.loss["piper"], result.loss["pjit"]
        print(
            f"{name:<13}{piper_t * 1e3:>10.1f}{base_t * 1e3:>10.1f}"
            f"{statistics.median(ratios):>7.2f}x"
            f"{piper_loss:>12.5f}{base_loss:>12.5f}{abs(piper_loss - base_loss):>10.1e}"
            f"  {memory_str(step)} | {memory_str(base)}"
        )
        cpu = statistics.median(result.ratio("piper", "pjit", clock="cpu"))
        summaries.append(
            f"ratio {name}: piper/pjit = {statistics.median(ratios):.2f}x, median of "
            f"{len(ratios)} rounds (range {min(ratios):.2f}-{max(ratios):.2f}x; "
            f"CPU time {cpu:.2f}x); {piper_t * 1e3:.1f} ms vs {base_t * 1e3:.1f} ms per "
            f"step; build+compile+first step {piper_first:.1f}s vs {base_first:.1f}s"
        )
    print("\n".join(summaries))
    return 0


if __name__ == "__main__":
    sys.exit(main())
