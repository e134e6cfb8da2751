"""The example MoE transformer (examples/moe.py) under PP=2 x DP=2 x EP=2 on 8 CPU devices:
1F1B, interleaved 1F1B and DualPipeV side by side, each with ZeRO-1.

For each schedule, one child run (one process with 8 virtual devices, or --processes 2:
two processes of 4 devices each under piper-launch, one pipeline rank per process)
compiles the strategy, trains --steps measured steps and reports the median step time
and the peak bytes of activations per device (`step.memory()`); in one process it also
simulates the plans on costs measured per program (`measure_costs`). Each schedule runs
twice: with the experts split over `ep` (EP=2: ALL_TO_ALL steps, each fused into the
program of the pass it feeds), and with the same devices as plain data parallelism
(EP=1, no all-to-all). Their difference is
the all-to-all's cost in the step (with the different work split it brings), shown as a
share of the EP=2 step: DualPipeV's overlap groups run one microbatch's all-to-all
inside the same program as another microbatch's compute, 1F1B and interleaved do not.

Run: .venv/bin/python benchmarks/moe_schedules.py [--processes 2] [--steps 5]
(a few minutes on 2 cores)
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import time

HERE = os.path.dirname(os.path.abspath(__file__))
SCHEDULES = ("1f1b", "interleaved", "dualpipev")
RANKS = ([0, 1, 2, 3], [4, 5, 6, 7])


def parse(argv: list[str] | None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--processes", type=int, choices=(1, 2), default=1)
    p.add_argument("--schedules", nargs="+", choices=SCHEDULES, default=list(SCHEDULES))
    p.add_argument("--steps", type=int, default=5, help="measured steps per run (5)")
    p.add_argument("--microbatches", type=int, default=4)
    p.add_argument("--batch-size", type=int, default=32)
    p.add_argument("--seq-len", type=int, default=32)
    p.add_argument("--d-model", type=int, default=64)
    p.add_argument("--timeout", type=float, default=600, help="seconds per child run")
    p.add_argument("--child", nargs=2, metavar=("SCHEDULE", "EP"), help=argparse.SUPPRESS)
    return p.parse_args(argv)


def strategy(schedule: str, ep: int, m: int) -> tuple[list, int]:
    """(directives, model regions): stages on the two ranks, each rank's group dp x ep."""
    import piper_jax as piper

    if schedule == "1f1b":
        rank_of, orders = [0, 1], piper.schedules.one_f_one_b(2, m)
    elif schedule == "interleaved":
        rank_of, orders = [0, 1, 0, 1], piper.schedules.interleaved_1f1b(4, m, 2)
    else:
        rank_of, orders = [0, 1, 1, 0], piper.schedules.dualpipev(2, m)
    directives = [piper.split({}, num_microbatches=m)]
    for stage, rank in enumerate(rank_of):
        devices = RANKS[rank]
        directives += [
            piper.place({"PP": stage}, devices),
            piper.replicate({"PP": stage}, devices, shard_grads=True),
        ]
        if ep > 1:
            directives.append(piper.shard({"PP": stage, "EP": "*"}, devices[:ep]))
    return directives + orders, len(rank_of)


def child(args: argparse.Namespace) -> None:
    """One schedule: compile, warm up, time the steps; process 0 prints a RESULT line."""
    import piper_jax.distributed as dist

    dist.initialize()
    import jax

    if not jax.distributed.is_initialized():
        jax.config.update("jax_platforms", "cpu")
        jax.config.update("jax_num_cpu_devices", 8)
    import piper_jax as piper

    sys.path.insert(0, os.path.join(HERE, "..", "examples"))
    from moe import factory

    schedule, ep = args.child[0], int(args.child[1])
    directives, regions = strategy(schedule, ep, args.microbatches)
    model, loss_fn, optimizer, batch = factory(
        num_stages=regions,
        n_layers=4,
        batch_size=args.batch_size,
        seq_len=args.seq_len,
        d_model=args.d_model,
    )
    step = piper.compile(loss_fn, model, optimizer, batch, directives, jax.devices()[:8])
    step(batch)  # compiles every program
    times = []
    for _ in range(args.steps):
        start = time.perf_counter()
        step(batch)  # returns host floats: the step has finished
        times.append(time.perf_counter() - start)
    memory = step.memory()
    result = {
        "measured": statistics.median(times),
        "activations": max((m.get("activations", 0) for m in memory.values()), default=0),
        "predicted": None,
        "bubble": None,
    }
    if jax.process_count() == 1:
        simulation = step.simulate(step.measure_costs(batch))
        result["predicted"] = simulation.step_time
        result["bubble"] = simulation.bubble_fraction
    if jax.process_index() == 0:
        print("RESULT " + json.dumps(result), flush=True)


def run(args: argparse.Namespace, argv: list[str], schedule: str, ep: int) -> dict:
    me = os.path.abspath(__file__)
    cmd = [sys.executable, me, *argv, "--child", schedule, str(ep)]
    if args.processes == 2:
        cmd = [sys.executable, "-m", "piper_jax.launch", "--nprocs", "2",
               "--devices-per-proc", "4", "--timeout", str(int(args.timeout)),
               me, *argv, "--child", schedule, str(ep)]  # fmt: skip
    out = subprocess.run(cmd, capture_output=True, text=True, timeout=args.timeout + 30)
    lines = [x for x in out.stdout.splitlines() if "RESULT " in x]
    if out.returncode or not lines:
        raise SystemExit(f"{schedule} EP={ep} failed:\n{out.stdout[-2000:]}{out.stderr[-2000:]}")
    return json.loads(lines[0].split("RESULT ", 1)[1])


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    args = parse(argv)
    if args.child:
        child(args)
        return 0
    where = "2 processes x 4 devices" if args.processes == 2 else "1 process, 8 devices"
    print(
        f"MoE d_model={args.d_model}, 4 layers, 4 experts top-2, batch {args.batch_size} x "
        f"{args.seq_len}, m={args.microbatches}; PP=2 x DP=2 x EP=2, ZeRO-1; {where}; "
        f"median of {args.steps} steps; load average {os.getloadavg()[0]:.1f}"
    )
    header = (
        f"{'schedule':<12}{'measured ms':>12}{'simulated ms':>13}{'bubble':>8}"
        f"{'act. MiB':>10}{'EP=1 ms':>9}{'all-to-all share':>18}"
    )
    print(header)
    print("-" * len(header))
    for schedule in args.schedules:
        with_ep, without = run(args, argv, schedule, 2), run(args, argv, schedule, 1)
        share = (with_ep["measured"] - without["measured"]) / with_ep["measured"]
        simulated = f"{with_ep['predicted'] * 1e3:.1f}" if with_ep["predicted"] else "-"
        bubble = f"{with_ep['bubble']:.0%}" if with_ep["bubble"] is not None else "-"
        print(
            f"{schedule:<12}{with_ep['measured'] * 1e3:>12.1f}{simulated:>13}{bubble:>8}"
            f"{with_ep['activations'] / 2**20:>10.2f}{without['measured'] * 1e3:>9.1f}"
            f"{share:>18.0%}",
            flush=True,
        )
    return 0


if __name__ == "__main__":
    sys.exit(main())
