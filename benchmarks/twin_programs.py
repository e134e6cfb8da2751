"""Time to a first step when a device holds several identical pipeline stages: their passes
(Note [twin regions share programs]) and their updates and optimizer inits (Note
[updates of identical stages]) compiled once for all of them, against once per stage.

The example GPT cut into one region per layer, on 2 virtual CPU devices, one process:
  dualpipev    4 stages, DualPipeV's V: device 1 holds the two middle stages;
  interleaved  8 stages, interleaved 1F1B: device 0 holds stages 0, 2, 4, 6, device 1
               stages 1, 3, 5, 7 (the first and last hold the embedding and the head).
Each measurement is a fresh process (JAX caches programs within one), the variants taking
turns first: "apart" runs the same code with every region its own twin and every update
compiled for itself, "passes" shares the twins' passes only (piper-jax before updates
were shared), "shared" shares both. Prints per round the programs XLA compiled, the
seconds from `compile` to the end of the first step, and the first two losses (equal to
the last bit: the programs compute the same thing); then per schedule the median and
range of passes / apart, shared / apart and shared / passes (what sharing the updates
adds).

Run: .venv/bin/python benchmarks/twin_programs.py [--rounds 3]
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import time

SCHEDULES = {"dualpipev": 4, "interleaved": 8}  # schedule -> stages (and layers)
VARIANTS = ("apart", "passes", "shared")


def parse(argv: list[str] | None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    p.add_argument("--rounds", type=int, default=3)
    p.add_argument("--schedules", nargs="+", choices=list(SCHEDULES), default=list(SCHEDULES))
    p.add_argument("--d-model", type=int, default=128)
    p.add_argument("--seq-len", type=int, default=128)
    p.add_argument("--batch-size", type=int, default=16)
    p.add_argument("--one", nargs=2, metavar=("SCHEDULE", "VARIANT"), help=argparse.SUPPRESS)
    return p.parse_args(argv)


def directives(schedule: str, stages: int, m: int) -> list:
    import piper_jax as piper

    if schedule == "dualpipev":
        device_of = [min(s, stages - 1 - s) for s in range(stages)]
        orders = piper.schedules.dualpipev(stages // 2, m)
    else:
        device_of = [s % 2 for s in range(stages)]
        orders = piper.schedules.interleaved_1f1b(stages, m, 2)
    placed = [piper.place({"PP": s}, [d]) for s, d in enumerate(device_of)]
    return [piper.split({"PP": "*"}, num_microbatches=m), *placed, *orders]


def measure(args: argparse.Namespace, schedule: str, variant: str) -> dict:
    import jax

    jax.config.update("jax_platforms", "cpu")
    jax.config.update("jax_num_cpu_devices", 2)
    import optax
    from flax import nnx
    from piper_jax.mpmd_runtime import executor
    from piper_jax.mpmd_runtime.same_programs import SamePrograms

    import piper_jax as piper

    if variant == "apart":  # every region its own twin: a program per stage
        executor.twin_regions = lambda lifted, regions, *_: {r: r for r in regions}
    if variant in ("apart", "passes"):  # every update and init compiled for itself
        SamePrograms.resolve = lambda self, jitted, args, devices: jitted
    compiled = [0]

    def count(event: str, _seconds: float, **_: object) -> None:
        compiled[0] += event == "/jax/core/compile/backend_compile_duration"

    jax.monitoring.register_event_duration_secs_listener(count)
    here = os.path.dirname(os.path.abspath(__file__))
    sys.path.insert(0, os.path.join(here, "..", "examples"))
    from data import batches, encode, load_corpus
    from gpt import GPT, GPTConfig, loss_fn

    stages = SCHEDULES[schedule]
    config = GPTConfig(
        seq_len=args.seq_len,
        d_model=args.d_model,
        n_heads=4,
        n_layers=stages,
        num_stages=stages,
    )
    stream = batches(encode(load_corpus(200_000)), args.batch_size, args.seq_len, 0)
    batch = next(stream)
    model = GPT(config, rngs=nnx.Rngs(0))
    start = time.perf_counter()
    step = piper.compile(loss_fn, model, optax.adamw(1e-3), batch, directives(schedule, stages, 4))
    first = float(step(batch)["loss"])
    seconds = time.perf_counter() - start
    programs = compiled[0]
    second = float(step(next(stream))["loss"])
    return {"seconds": seconds, "programs": programs, "losses": [first, second]}


def in_own_process(args: argparse.Namespace, schedule: str, variant: str) -> dict:
    cmd = [sys.executable, os.path.abspath(__file__), "--one", schedule, variant]
    cmd += ["--d-model", str(args.d_model), "--seq-len", str(args.seq_len)]
    cmd += ["--batch-size", str(args.batch_size)]
    out = subprocess.run(cmd, capture_output=True, text=True, timeout=900, check=True)
    return json.loads(out.stdout.strip().splitlines()[-1])


def main(argv: list[str] | None = None) -> int:
    args = parse(argv)
    if args.one:
        print(json.dumps(measure(args, *args.one)))
        return 0
    print(f"load average before: {os.getloadavg()[0]:.2f}")
    print(f"{'round':<6}{'schedule':<12}{'variant':<8}{'compiled':>9}{'first step s':>13}  losses")
    ratios: dict[tuple[str, str], list[float]] = {}
    for r in range(args.rounds):
        for schedule in args.schedules:
            order = VARIANTS[r % len(VARIANTS) :] + VARIANTS[: r % len(VARIANTS)]
            got = {v: in_own_process(args, schedule, v) for v in order}
            if any(got[v]["losses"] != got["apart"]["losses"] for v in VARIANTS):
                print(f"{schedule}: the losses differ: {got}", file=sys.stderr)
                return 1
            for v, base in (("passes", "apart"), ("shared", "apart"), ("shared", "passes")):
                ratios.setdefault((schedule, f"{v} / {base}"), []).append(
                    got[v]["seconds"] / got[base]["seconds"]
                )
            for v in VARIANTS:
                m = got[v]
                losses = " ".join(f"{x:.6f}" for x in m["losses"])
                print(
                    f"{r:<6}{schedule:<12}{v:<8}{m['programs']:>9}{m['seconds']:>13.2f}  {losses}"
                )
    print(f"load average after: {os.getloadavg()[0]:.2f}")
    for (schedule, ratio), values in ratios.items():
        print(
            f"{schedule}: {ratio}, compile + first step: median "
            f"{statistics.median(values):.2f}x (range {min(values):.2f}-{max(values):.2f}x, "
            f"{len(values)} rounds)"
        )
    return 0


if __name__ == "__main__":
    sys.exit(main())
