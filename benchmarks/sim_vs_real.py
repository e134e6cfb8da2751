"""Does the simulator predict the real step? Time each program (`measure_costs`),
simulate the plans with those costs, and compare with the measured step time, for
GPipe, 1F1B, ZB-H1 (2 stages, one per device), DualPipeV (4 stages folded into a V, 2 per
device) and interleaved 1F1B (4 stages, stage s on device s % 2), on 2 devices
(`--schedules` picks some); the last line is the median absolute error over them.

The simulator runs device groups side by side, as separate accelerators run. So by
default each device is its own process (`piper-launch`, gloo on 127.0.0.1) pinned to a
core of its own with one XLA thread, as in benchmarks/pipeline_efficiency.py: there each
device has one core whether it runs alone (while its programs are timed) or beside the
other (in the real step). Each process times its own programs; the costs are gathered
(a region's own from the process that runs it, a kind's the mean over both) and both
processes simulate the same plans, with the host's own costs measured in a real step
(Note [the host issues the steps] in mpmd_runtime/simulator.py). "plans only" is the error
of the plans alone: no host, and transfers between processes as if the sender never
waited for its receiver (Note [transfers between processes meet]). `--processes 1` runs
both devices as virtual devices of one process instead: they share the machine's cores,
a program timed alone has every core, and the prediction is that much too short (the
search page says why).

`--trace STEPS` looks inside the real steps: it traces them with jax.profiler and prints,
per program over both processes, its median and mean time in the real step beside its
measured cost, and how long the transfers took once both ranks were in them. That is
where the simulation and the real step part (docs/performance.md, "the simulator").

Run: .venv/bin/python benchmarks/sim_vs_real.py [--processes 2] [--width 1024] [--m 8]
     [--schedules gpipe interleaved_1f1b] [--trace 3]
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import time
from typing import Any

# schedule -> (stages, the device of each stage, the builder's arguments for m microbatches)
SCHEDULES = {
    "gpipe": (2, (0, 1), lambda m: (2, m)),
    "one_f_one_b": (2, (0, 1), lambda m: (2, m)),
    "zero_bubble_h1": (2, (0, 1), lambda m: (2, m)),
    # DualPipeV folds its stages into a V: 0 and 3 on device 0, 1 and 2 on device 1
    "dualpipev": (4, (0, 1, 1, 0), lambda m: (2, m)),
    "interleaved_1f1b": (4, (0, 1, 0, 1), lambda m: (4, m, 2)),
}
ONE_THREAD = "--xla_cpu_multi_thread_eigen=false"  # XLA ignores every flag after a bad token


def parse(argv: list[str] | None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--processes", type=int, choices=(1, 2), default=2)
    parser.add_argument("--width", type=int, default=1024)
    parser.add_argument("--batch-size", type=int, default=256)
    parser.add_argument("--m", type=int, default=8, help="microbatches")
    parser.add_argument("--steps", type=int, default=10)
    parser.add_argument("--schedules", nargs="+", choices=list(SCHEDULES), default=list(SCHEDULES))
    parser.add_argument("--show-costs", action="store_true", help="print the measured costs")
    parser.add_argument(
        "--trace",
        type=int,
        default=0,
        metavar="STEPS",
        help="also trace this many real steps with jax.profiler and print each program's "
        "real times next to its measured cost, and the transfers' times once both ranks "
        "were in them",
    )
    parser.add_argument("--timeout", type=float, default=600.0, help="seconds for all ranks")
    parser.add_argument("--rank", action="store_true", help=argparse.SUPPRESS)
    return parser.parse_args(argv)


def launch(argv: list[str], timeout: float) -> int:
    """Run this script as 2 one-thread processes of one CPU device each."""
    cmd = [sys.executable, "-m", "piper_jax.launch", "--nprocs", "2", "--timeout", str(timeout)]
    cmd += [os.path.abspath(__file__), *argv, "--rank"]
    env = dict(os.environ, XLA_FLAGS=ONE_THREAD)
    try:
        return subprocess.run(cmd, env=env, timeout=timeout + 30).returncode
    except subprocess.TimeoutExpired:
        print("sim_vs_real: the ranks did not finish in time", file=sys.stderr)
        return 124


def gathered(value: object) -> list:
    """Every process's `value` (anything JSON can hold), in process order."""
    import jax
    import numpy as np
    from jax.experimental import multihost_utils

    if jax.process_count() == 1:
        return [value]
    text = json.dumps(value).encode()
    size = int(np.max(multihost_utils.process_allgather(np.array([len(text)]))))
    mine = np.frombuffer(text.ljust(size), np.uint8)
    return [json.loads(bytes(row).decode()) for row in multihost_utils.process_allgather(mine)]


def merged_costs(costs: dict[str, float]) -> dict[str, float]:
    """Every process's costs: a key measured by several processes gets their mean, but a
    transfer or collective their least: each process timed it from when it got there,
    and the one that got there first also timed its wait for the others, which the
    simulator adds by itself (Note [transfers between processes meet])."""
    from piper_jax.mpmd_runtime.simulator import OP_KEYS

    tables = gathered(costs)
    keys = {k for table in tables for k in table}
    merge = {k: min if k in OP_KEYS and k != "UPD" else statistics.mean for k in keys}
    return {k: merge[k]([t[k] for t in tables if k in t]) for k in sorted(keys)}


def _ms(seconds: float) -> str:
    return f"{seconds * 1e3:.2f}"


TRANSFER = "moves"  # the program of a transfer between processes (mpmd_runtime/transport.py)
STALL_S = 1e-3


def real_programs(step: Any, batch: dict, steps: int, costs: dict[str, float]) -> list[str]:
    """Trace `steps` real steps with jax.profiler and describe them, over all processes:
    per program, its runs per step and their median and mean time in the real step
    beside its measured cost; for the transfers between processes, each one's time
    from when the last rank entered it to when the first left it (clocks of one machine),
    which waiting for the peer does not explain."""
    import glob
    import tempfile

    import jax
    from trace_summary import cpu_program_runs

    with tempfile.TemporaryDirectory() as folder:
        jax.profiler.start_trace(folder)
        for _ in range(steps):
            step(batch)
        jax.profiler.stop_trace()
        (path,) = glob.glob(os.path.join(folder, "**", "*.xplane.pb"), recursive=True)
        runs = cpu_program_runs(path)
    per_process = gathered(runs)
    times: dict[str, list[float]] = {}
    for process in per_process:
        for start, end, name in process:
            times.setdefault(name, []).append((end - start) / 1e9)
    lines = [f"  {'program':<10}{'per step':>9}{'median ms':>11}{'mean ms':>9}{'measured':>15}"]
    for name, secs in sorted(times.items()):
        if name == TRANSFER:  # measured as SEND on the sender, RECV on the receiver
            measured = " / ".join(_ms(costs[k]) for k in ("SEND", "RECV") if k in costs)
        else:
            measured = _ms(costs[name]) if name in costs else "-"
        lines.append(
            f"  {name:<10}{len(secs) / steps:>9.1f}{_ms(statistics.median(secs)):>11}"
            f"{_ms(statistics.mean(secs)):>9}{measured:>15}"
        )
    moves = [[(start, end) for start, end, name in p if name == TRANSFER] for p in per_process]
    if moves[0] and all(len(m) == len(moves[0]) for m in moves):
        both = [max(0, min(e for _, e in k) - max(s for s, _ in k)) / 1e9 for k in zip(*moves)]
        stalls = [t for t in both if t > STALL_S]
        lines.append(
            f"  transfers once every rank was in them: median {_ms(statistics.median(both))}, "
            f"mean {_ms(statistics.mean(both))} ms; {len(stalls) / steps:.1f} per step took over "
            f"{STALL_S * 1e3:g} ms, {sum(stalls) / steps * 1e3:.1f} ms per step in all"
        )
    return lines


def slowest(seconds: float) -> float:
    """The largest of every process's `seconds`: a step ends when its last rank does."""
    import jax
    import numpy as np
    from jax.experimental import multihost_utils

    if jax.process_count() == 1:
        return seconds
    return float(np.max(multihost_utils.process_allgather(np.array([seconds]))))


def run(args: argparse.Namespace) -> None:
    if args.rank:
        import piper_jax.distributed as dist

        rank = int(os.environ[dist.ENV_PROCESS_ID])
        os.sched_setaffinity(0, {rank % os.cpu_count()})  # before JAX starts any thread
        dist.initialize()
    import jax

    jax.config.update("jax_platforms", "cpu")
    if not args.rank:
        jax.config.update("jax_num_cpu_devices", 2)
    import numpy as np
    import optax
    from piper_jax.mpmd_runtime.simulator import HOST_KEYS

    import piper_jax as piper

    here = os.path.dirname(os.path.abspath(__file__))
    sys.path.insert(0, os.path.join(here, "..", "tests"))
    from helpers import StageMLP, mlp_loss

    rng = np.random.default_rng(0)
    batch = {k: rng.normal(size=(args.batch_size, 8)).astype(np.float32) for k in ("x", "y")}
    rows = []
    traced: dict[str, list[str]] = {}
    for name in args.schedules:
        stages, device_of, builder_args = SCHEDULES[name]
        directives = [
            piper.split({"PP": "*"}, num_microbatches=args.m),
            *(piper.place({"PP": s}, [d]) for s, d in enumerate(device_of)),
            *getattr(piper.schedules, name)(*builder_args(args.m)),
        ]
        step = piper.compile(
            mlp_loss, StageMLP(stages, width=args.width), optax.sgd(1e-3), batch, directives
        )
        step(batch)  # compile everything before measuring
        costs = merged_costs(step.measure_costs(batch))
        if args.show_costs and jax.process_index() == 0:
            print(name, {k: round(v * 1e3, 2) for k, v in costs.items()}, "(ms)", flush=True)
        predicted = step.simulate(costs).step_time
        # the plans alone: no host, transfers as if they never waited for the receiver
        plans_only = {k: v for k, v in costs.items() if k not in HOST_KEYS}
        from_plans = step.lowered.simulate(plans_only).step_time
        times = []
        for _ in range(args.steps):
            start = time.perf_counter()
            step(batch)  # returns host floats: the step has finished
            times.append(time.perf_counter() - start)
        rows.append((name, predicted, from_plans, slowest(statistics.median(times))))
        if args.trace:
            traced[name] = real_programs(step, batch, args.trace, costs)
    if jax.process_index() != 0:
        return
    where = "2 processes, one core each" if args.rank else "1 process, 2 virtual devices"
    print(f"{where}; width {args.width}, batch {args.batch_size}, m={args.m}")
    print(f"{'schedule':<16}{'predicted ms':>14}{'measured ms':>13}{'error':>8}{'plans only':>12}")
    errors, plans_errors = [], []
    for name, predicted, from_plans, measured in rows:
        errors.append((predicted - measured) / measured)
        plans_errors.append((from_plans - measured) / measured)
        print(
            f"{name:<16}{predicted * 1e3:>14.1f}{measured * 1e3:>13.1f}"
            f"{errors[-1]:>+8.1%}{plans_errors[-1]:>+12.1%}"
        )
    print(f"median absolute error {statistics.median(abs(e) for e in errors):.1%}", end="")
    print(f" ({statistics.median(abs(e) for e in plans_errors):.1%} from the plans only)")
    for name, lines in traced.items():
        print(f"{name}: {args.trace} real steps traced (jax.profiler), every process's programs")
        print("\n".join(lines))


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    args = parse(argv)
    if args.processes == 2 and not args.rank:
        return launch(argv, args.timeout)
    run(args)
    return 0


if __name__ == "__main__":
    sys.exit(main())
