"""Pipeline efficiency of a 2-stage 1F1B across 2 processes, one CPU thread each.

Model: tests/helpers.StageMLP(2, width=W), a 2-region residual MLP, trained with SGD on a
(B, 8) batch cut into m microbatches.
  baseline: one process, one thread (pinned to core 0), directives = [split(m)] only,
            so it does the same per-microbatch math as the pipeline, in sequence;
  pipeline: 2 processes via piper-launch (rank r pinned to core r % cpu_count), stage s
            on the device of process s, schedules.one_f_one_b(2, m).
One thread: XLA_FLAGS="--xla_cpu_multi_thread_eigen=false"
in the children's environment, plus os.sched_setaffinity to one core. Each child times
`step(batch)` (which returns host floats, so it is synchronous) and prints one RESULT
line; this script prints baseline and pipelined step time, speedup = baseline/pipelined,
the 1F1B ideal 2m/(m+1) (bubble (p-1)/(m+p-1) with p=2), and speedup/ideal, over
all steps pooled and per round (baseline and pipeline alternate; the CPU time other
processes used just before each round is shown, as the 2-core machine is shared).
W=2048: a baseline step takes ~230-300 ms on one core (~15 ms of compute per stage and
microbatch, against ~0.5-1 ms per 256 KiB activation transfer); about a minute in all.

Run: .venv/bin/python benchmarks/pipeline_efficiency.py [--width 2048 --batch 256 -m 8]
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import time

import numpy as np

ONE_THREAD = "--xla_cpu_multi_thread_eigen=false"  # XLA ignores every flag after a bad token
HERE = os.path.dirname(os.path.abspath(__file__))


def parse(argv: list[str] | None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    p.add_argument("--width", type=int, default=2048, help="MLP width W (default 2048)")
    p.add_argument("--batch", type=int, default=256, help="global batch size (default 256)")
    p.add_argument("-m", "--microbatches", type=int, default=8, help="microbatches (default 8)")
    p.add_argument("--steps", type=int, default=8, help="timed steps (default 8)")
    p.add_argument("--warmup", type=int, default=2, help="untimed steps first (default 2)")
    p.add_argument("--rounds", type=int, default=3, help="baseline/pipeline runs (default 3)")
    p.add_argument("--timeout", type=float, default=240.0, help="seconds per child run")
    p.add_argument("--role", choices=["baseline", "pipeline"], help=argparse.SUPPRESS)
    return p.parse_args(argv)


def child(args: argparse.Namespace) -> None:
    """Run in a child process: pin to one core, build the step, time it, print RESULT."""
    rank = int(os.environ.get("PIPER_PROCESS_ID", "0"))
    core = rank % os.cpu_count()
    os.sched_setaffinity(0, {core})  # before JAX starts any thread
    import piper_jax.distributed as dist

    if args.role == "pipeline":
        dist.initialize()
    import jax

    jax.config.update("jax_platforms", "cpu")
    import optax

    sys.path.insert(0, os.path.join(HERE, "..", "tests"))
    from helpers import StageMLP, mlp_batches, mlp_loss

    import piper_jax as piper
    from piper_jax import schedules

    m = args.microbatches
    directives = [piper.split({"PP": "*"}, num_microbatches=m)]
    if args.role == "pipeline":
        directives += [piper.place({"PP": s}, [s]) for s in range(2)]
        directives += schedules.one_f_one_b(2, m)
    batch = mlp_batches(1, batch_size=args.batch)[0]
    model = StageMLP(2, width=args.width)
    t0 = time.perf_counter()
    step = piper.compile(mlp_loss, model, optax.sgd(1e-4), batch, directives)
    losses = [step(batch)["loss"] for _ in range(args.warmup)]  # also compiles the programs
    compile_s = time.perf_counter() - t0
    times = []
    for _ in range(args.steps):
        t = time.perf_counter()
        losses.append(step(batch)["loss"])
        times.append(time.perf_counter() - t)
    result = {
        "role": args.role,
        "rank": rank,
        "core": core,
        "affinity": sorted(os.sched_getaffinity(0)),
        "times": times,
        "compile_s": compile_s,
        "losses": [float(x) for x in losses],
    }
    print("RESULT " + json.dumps(result), flush=True)


def busy_cores(seconds: float = 1.0) -> float:
    """CPU cores kept busy by other work (this script runs nothing meanwhile), from
    /proc/stat; NaN where it cannot be read."""
    try:
        with open("/proc/stat") as f:
            a = [int(x) for x in f.readline().split()[1:9]]
        time.sleep(seconds)
        with open("/proc/stat") as f:
            b = [int(x) for x in f.readline().split()[1:9]]
    except (OSError, ValueError):
        return float("nan")
    total, idle = sum(b) - sum(a), (b[3] + b[4]) - (a[3] + a[4])
    return os.cpu_count() * (1 - idle / max(total, 1))


def run_child(cmd: list[str], timeout: float) -> list[dict]:
    env = dict(os.environ, XLA_FLAGS=ONE_THREAD)
    for name in ("PIPER_COORDINATOR", "PIPER_NUM_PROCESSES", "PIPER_PROCESS_ID"):
        env.pop(name, None)
    try:
        proc = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=timeout)
    except subprocess.TimeoutExpired as e:
        raise SystemExit(f"timed out after {timeout:g} s: {' '.join(cmd)}") from e
    results = []
    for line in proc.stdout.splitlines():
        if "RESULT " in line:
            results.append(json.loads(line.split("RESULT ", 1)[1]))
    if proc.returncode != 0 or not results:
        sys.stderr.write(proc.stdout[-4000:] + proc.stderr[-4000:])
        raise SystemExit(f"exit code {proc.returncode}: {' '.join(cmd)}")
    return results


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    args = parse(argv)
    if args.role:
        child(args)
        return 0
    me = os.path.abspath(__file__)
    launch = [sys.executable, "-m", "piper_jax.launch", "--nprocs", "2", "--timeout"]
    launch += [str(args.timeout), me, *argv, "--role", "pipeline"]
    base, piped, losses, busy, per_round = [], [], {}, [], []
    for _ in range(args.rounds):  # alternate, so that drifting background load hits both
        busy.append(busy_cores())
        (b,) = run_child([sys.executable, me, *argv, "--role", "baseline"], args.timeout)
        ranks = run_child(launch, args.timeout + 30)
        if len(ranks) != 2:
            raise SystemExit(f"expected 2 pipeline ranks, got {len(ranks)}")
        pipe_times = [max(ts) for ts in zip(*(r["times"] for r in ranks))]  # both stages done
        per_round.append((np.median(b["times"]), np.median(pipe_times)))
        base += b["times"]
        piped += pipe_times
        losses.update(
            {"baseline": b["losses"], **{f"rank {r['rank']}": r["losses"] for r in ranks}}
        )
        compile_s = max(r["compile_s"] for r in ranks)
    m = args.microbatches
    ideal = 2 * m / (m + 1)
    same = all(np.allclose(v, losses["baseline"], rtol=1e-5) for v in losses.values())
    print(
        f"pipeline efficiency: StageMLP(2, width={args.width}), batch {args.batch}, m={m}, SGD; "
        f"{args.rounds} rounds x {args.steps} steps (after {args.warmup}) per side, "
        f"1 CPU thread per process; pipeline build+warmup {compile_s:.1f} s"
    )
    print(f"losses of baseline and both pipeline ranks identical (rtol 1e-5): {same}")
    t = {"median": (np.median(base), np.median(piped)), "min": (np.min(base), np.min(piped))}
    speedup = {k: b / p for k, (b, p) in t.items()}
    rows = [
        ("baseline step (1 process)", {k: f"{b * 1e3:.1f} ms" for k, (b, _) in t.items()}),
        ("pipelined step (2 processes)", {k: f"{p * 1e3:.1f} ms" for k, (_, p) in t.items()}),
        ("speedup = baseline / pipelined", {k: f"{v:.3f}" for k, v in speedup.items()}),
        (f"ideal 1F1B = 2m/(m+1), m={m}", {k: f"{ideal:.3f}" for k in t}),
        ("speedup / ideal", {k: f"{v / ideal:.3f}" for k, v in speedup.items()}),
    ]
    print(f"{'':<32} {'median':>10} {'min':>10}")
    for label, v in rows:
        print(f"{label:<32} {v['median']:>10} {v['min']:>10}")
    busy.append(busy_cores())
    print(f"per round (other work on the {os.cpu_count()} cores sampled before each round):")
    for i, (b, p) in enumerate(per_round):
        print(
            f"  round {i}: other work {busy[i]:.2f} cores; baseline {b * 1e3:.1f} ms, "
            f"pipelined {p * 1e3:.1f} ms, speedup {b / p:.3f} ({b / p / ideal:.3f} of ideal)"
        )
    print(f"  after: other work {busy[-1]:.2f} cores", end="")
    print(" (over 0.2 cores anywhere: numbers disturbed)" if max(busy) > 0.2 else "")
    return 0


if __name__ == "__main__":
    sys.exit(main())
