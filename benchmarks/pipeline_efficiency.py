"""Pipeline efficiency of a 2-stage pipeline across 2 processes, one CPU thread each, against
the single-process baselines and the hand-written SPMD pipeline JAX users write today.

Model: tests/helpers.StageMLP(2, width=W), a 2-region residual MLP, trained with SGD on a
(B, 8) batch cut into m microbatches; every variant does the same per-microbatch math
(its losses are checked equal to jit1's). Variants (--variants picks some):
  jit1:   one process: ONE `jax.jit` of the whole step (a scan over the microbatches
          accumulating value_and_grad, then the SGD update; benchmarks/plain_steps.py).
          The fair single-process baseline; speedups are against it.
  piper1: one process: piper-jax with directives = [split(m)] only (the microbatches in
          sequence, one program call each).
  1f1b:   2 processes: piper-jax, stage s on the device of process s,
          schedules.one_f_one_b(2, m).
  zbh1:   2 processes: the same with schedules.zero_bubble_h1(2, m) (backward split into
          BI and BW, the BWs deferred into the cool-down bubble).
  spmd:   2 processes: GPipe hand-written as one SPMD program over a 2-device mesh that
          spans both processes (shard_map over the stacked stage weights, ppermute of the
          activations, jax.grad of the whole; benchmarks/plain_steps.py); both processes
          call the same jitted step.
Two processes cannot reach 2m/(m+1) where two cores do not scale: before the rounds, a
one-thread matmul loop runs alone on core 0 and then beside a copy of itself on core 1;
its time alone over its time beside the copy (0.78 on the 2-core development machine)
times 2m/(m+1) is the reachable speedup, and the table gives each pipeline's fraction
of both.
2-process variants start via `python -m piper_jax.launch --nprocs 2` (rank r pinned to
core r % cpu_count, piper_jax.distributed.initialize(), one CPU device per process);
1-process ones are pinned to core 0. One thread: XLA_FLAGS="--xla_cpu_multi_thread_eigen=false"
in every child's environment, plus os.sched_setaffinity to one core. Each variant runs in
its own child process (with a timeout), times `step(batch)` (which returns the loss as a
host float, so it is synchronous) and prints one RESULT line; a 2-process step lasts until
both ranks finish it. Rounds alternate the variants (the order rotates each round), so that
drifting background load hits all; the CPU time other processes used just before each
round is shown, as the 2-core machine is shared.
Per m, the table gives each variant's median step over all rounds' steps, the range of its
per-round medians, the speedup over jit1, for 2-process variants the fraction of the ideal
2m/(m+1) (bubble (p-1)/(m+p-1) with p=2), each rank's process CPU time per timed step
(median over rounds; all threads of the process: compute, dispatch, and any busy-waiting
in transfers), and the time to build and run the warm-up steps; below it, each round's
fraction of the ideal against that round's jit1 (the README's ranges). For each piper variant it
also gives, per rank and from the last round, the closures dispatched per step (one per
plan step, FREEs included, the SENDs of one exchange counted once) and their
instructions by op, the time the host spends in the dispatch loop (`Executor.run`,
before waiting for the results: it includes any waiting for the peer inside a
cross-process transfer, and waiting for room in the device's queue: XLA:CPU runs ahead
of the host by about 32 programs per device and then blocks each dispatch until one
finishes, so at m=16 the loop took 0.1-0.2 s of a 0.25-0.36 s step with the device busy
all along) of a whole step, and the count and median per
kind of one instrumented step (`Executor.run_recorded`, the measurement behind
TrainStep.measure_costs, which waits for each closure in turn and so serialises the
devices). At a small width (--width 16) the step time per closure is the runtime's cost
per instruction: host dispatch and, across processes, the transfers' latency.
W=2048, B=256 on a 2-core machine: a jit1 step took 100-235 ms (m=4..16); in piper one
stage's F and B on a 32-row microbatch took ~3 and ~8 ms, one 256 KiB activation transfer
between the processes ~0.5-5 ms. Each child takes ~5-15 s, most of it start-up and
compilation; all five variants for -m 4 8 16, 3 rounds, about 7-8 minutes.

Run: .venv/bin/python benchmarks/pipeline_efficiency.py [--width 2048 --batch 256 -m 4 8
     --variants jit1 1f1b zbh1 spmd --rounds 3 --steps 8]
"""

from __future__ import annotations

import argparse
import collections
import json
import os
import subprocess
import sys
import time

import numpy as np

ONE_THREAD = "--xla_cpu_multi_thread_eigen=false"  # XLA ignores every flag after a bad token
HERE = os.path.dirname(os.path.abspath(__file__))
PROCESSES = {"jit1": 1, "piper1": 1, "1f1b": 2, "zbh1": 2, "spmd": 2}
MATMUL = "matmul"  # the child that measures how two cores scale (`core_scaling`)


def parse(argv: list[str] | None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    p.add_argument("--width", type=int, default=2048, help="MLP width W (default 2048)")
    p.add_argument("--batch", type=int, default=256, help="global batch size (default 256)")
    p.add_argument(
        "-m", "--microbatches", type=int, nargs="+", default=[8], help="microbatches (default 8)"
    )
    p.add_argument(
        "--variants",
        nargs="+",
        choices=list(PROCESSES),
        default=["jit1", "piper1", "1f1b", "zbh1", "spmd"],
        help="variants to race (default all)",
    )
    p.add_argument("--steps", type=int, default=8, help="timed steps (default 8)")
    p.add_argument("--warmup", type=int, default=2, help="untimed steps first (default 2)")
    p.add_argument("--rounds", type=int, default=3, help="runs of every variant (default 3)")
    p.add_argument("--timeout", type=float, default=240.0, help="seconds per child run")
    p.add_argument("--role", choices=[*PROCESSES, MATMUL], help=argparse.SUPPRESS)
    return p.parse_args(argv)


def child(args: argparse.Namespace) -> None:
    """Run in a child process: pin to one core, build the step, time it, print RESULT."""
    rank = int(os.environ.get("PIPER_PROCESS_ID", "0"))
    core = rank % os.cpu_count()
    os.sched_setaffinity(0, {core})  # before JAX starts any thread
    if args.role == MATMUL:
        matmuls(args.width)
        return
    import piper_jax.distributed as dist

    if PROCESSES[args.role] > 1:
        dist.initialize()
    import jax

    jax.config.update("jax_platforms", "cpu")
    import optax

    sys.path[:0] = [HERE, os.path.join(HERE, "..", "tests")]
    from helpers import StageMLP, mlp_batches, mlp_loss

    (m,) = args.microbatches
    batch = mlp_batches(1, batch_size=args.batch)[0]
    model = StageMLP(2, width=args.width)
    t0 = time.perf_counter()
    step, probe = build(args.role, model, mlp_loss, optax.sgd(1e-4), batch, m)
    losses = [step(batch) for _ in range(args.warmup)]  # also compiles the programs
    compile_s = time.perf_counter() - t0
    times = []
    cpu = time.process_time()
    for _ in range(args.steps):
        t = time.perf_counter()
        losses.append(step(batch))
        times.append(time.perf_counter() - t)
    cpu = (time.process_time() - cpu) / args.steps
    result = {
        "role": args.role,
        "rank": rank,
        "affinity": sorted(os.sched_getaffinity(0)),
        "times": times,
        "cpu_s": cpu,
        "compile_s": compile_s,
        "losses": losses,
        "probe": probe(batch) if probe else None,
    }
    print("RESULT " + json.dumps(result), flush=True)


def matmuls(width: int, seconds: float = 1.5) -> None:
    """Print the seconds per width x width float32 matmul of a loop of them."""
    import jax
    import jax.numpy as jnp

    x = jnp.ones((width, width), jnp.float32)
    square = jax.jit(lambda a: a @ a)
    square(x).block_until_ready()
    n, t0 = 0, time.perf_counter()
    while time.perf_counter() - t0 < seconds:
        square(x).block_until_ready()
        n += 1
    print("RESULT " + json.dumps({"s": (time.perf_counter() - t0) / n}), flush=True)


def core_scaling(args: argparse.Namespace) -> float:
    """How much of two cores two one-thread processes get here: a matmul loop's time
    alone over its time beside a copy of itself on the other core (1.0: independent
    cores; less: shared caches, memory bandwidth or host threads). The reachable speedup
    of a 2-process pipeline is this times 2m/(m+1)."""
    cmd = [sys.executable, os.path.abspath(__file__), f"--width={args.width}", f"--role={MATMUL}"]
    env = dict(os.environ, XLA_FLAGS=ONE_THREAD)
    (alone,) = run_child(cmd, args.timeout)
    pair = [
        subprocess.Popen(
            cmd, env=env | {"PIPER_PROCESS_ID": str(r)}, stdout=subprocess.PIPE, text=True
        )
        for r in range(2)
    ]
    together = [
        json.loads(p.communicate(timeout=args.timeout)[0].split("RESULT ", 1)[1]) for p in pair
    ]
    return alone["s"] / max(t["s"] for t in together)


def build(role: str, model, loss_fn, optimizer, batch: dict, m: int) -> tuple:
    """The variant's `step(batch) -> loss` and, for piper, a probe of its dispatch."""
    import plain_steps

    if role == "jit1":
        return plain_steps.jit1_step(model, loss_fn, optimizer, m), None
    if role == "spmd":
        return plain_steps.spmd_gpipe_step(model, optimizer, m), None
    import piper_jax as piper
    from piper_jax import schedules

    directives = [piper.split({"PP": "*"}, num_microbatches=m)]
    if role != "piper1":
        directives += [piper.place({"PP": s}, [s]) for s in range(2)]
        builder = schedules.one_f_one_b if role == "1f1b" else schedules.zero_bubble_h1
        directives += builder(2, m)
    train = piper.compile(loss_fn, model, optimizer, batch, directives)
    return (lambda b: train(b)["loss"]), (lambda b: probe_dispatch(train, b))


def probe_dispatch(train, batch: dict) -> dict:
    """What this process dispatches per step, and where its host time goes (two more
    steps, after the timed ones). Reads the executor's internals; changes nothing."""
    ex = train._executor
    steps = [ex.plans.steps[members[0]][index[0]] for members, index in ex.step_events]
    ops = collections.Counter(i.op for s in steps for i in s.instructions)
    leaves = train._batch_leaves(batch)
    t0 = time.perf_counter()
    ex.run(leaves)
    t1 = time.perf_counter()
    ex.metrics()  # waits for the step to finish
    t2 = time.perf_counter()
    kinds: dict[str, list[float]] = {}
    for e in ex.run_recorded(leaves):
        kinds.setdefault(e.kind, []).append(e.end - e.start)
    return {
        "programs": len(ex.steps) - sum(1 for p in ex.exchanges.values() if not p),
        "instructions": sum(ops.values()),
        "ops": dict(ops),
        "dispatch_s": t1 - t0,
        "step_s": t2 - t0,
        "recorded": {k: [len(v), float(np.median(v)), float(np.sum(v))] for k, v in kinds.items()},
    }


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


def run_variant(args: argparse.Namespace, variant: str, m: int) -> list[dict]:
    """One child run of `variant`: its result per rank."""
    me = os.path.abspath(__file__)
    flags = [f"--width={args.width}", f"--batch={args.batch}", f"-m={m}"]
    flags += [f"--steps={args.steps}", f"--warmup={args.warmup}", f"--role={variant}"]
    n = PROCESSES[variant]
    if n == 1:
        return run_child([sys.executable, me, *flags], args.timeout)
    launch = [sys.executable, "-m", "piper_jax.launch", "--nprocs", str(n)]
    ranks = run_child([*launch, "--timeout", str(args.timeout), me, *flags], args.timeout + 30)
    if len(ranks) != n:
        raise SystemExit(f"{variant}: expected {n} ranks, got {len(ranks)}")
    return sorted(ranks, key=lambda r: r["rank"])


def measure(args: argparse.Namespace, m: int, scaling: float) -> None:
    """Race the variants for `m` microbatches and print the table."""
    variants = args.variants
    times = {v: [] for v in variants}  # every timed step of every round
    rounds = {v: [] for v in variants}  # per-round medians
    cpu = {v: [] for v in variants}  # per round, each rank's CPU time per step
    losses, compile_s, probes, busy = {}, {}, {}, []
    for r in range(args.rounds):
        busy.append(busy_cores())
        for v in variants[r % len(variants) :] + variants[: r % len(variants)]:
            ranks = run_variant(args, v, m)
            steps = [max(ts) for ts in zip(*(x["times"] for x in ranks))]  # all ranks done
            times[v] += steps
            rounds[v].append(float(np.median(steps)))
            cpu[v].append([x["cpu_s"] for x in ranks])
            losses.update({(v, x["rank"]): x["losses"] for x in ranks})
            compile_s[v] = max(x["compile_s"] for x in ranks)
            probes[v] = [x["probe"] for x in ranks]
    busy.append(busy_cores())
    ideal = 2 * m / (m + 1)
    reachable = ideal * scaling
    med = {v: float(np.median(times[v])) for v in variants}
    ref = "jit1" if "jit1" in variants else variants[0]
    print(
        f"\nStageMLP(2, width={args.width}), batch {args.batch}, m={m}, SGD; {args.rounds} "
        f"rounds x {args.steps} steps (after {args.warmup}) per variant, 1 CPU thread per "
        f"process; ideal 2-process speedup 2m/(m+1) = {ideal:.3f}, reachable on this "
        f"machine {reachable:.3f} (x {scaling:.2f}, how two one-thread processes scale here)"
    )
    head = f"{'variant':<8} {'procs':>5} {'median ms':>10} {'round medians ms':>18} "
    print(
        head + f"{'vs ' + ref:>8} {'of ideal':>9} {'of reachable':>13} {'CPU ms/step/rank':>17} "
        f"{'build s':>8}"
    )
    for v in variants:
        lo, hi = min(rounds[v]), max(rounds[v])
        speedup = med[ref] / med[v]
        pipelined = PROCESSES[v] > PROCESSES[ref]
        of_ideal = f"{speedup / ideal:.3f}" if pipelined else "-"
        of_reachable = f"{speedup / reachable:.3f}" if pipelined else "-"
        spread = f"{lo * 1e3:.1f}-{hi * 1e3:.1f}"
        used = "+".join(f"{t * 1e3:.0f}" for t in np.median(cpu[v], axis=0))
        print(
            f"{v:<8} {PROCESSES[v]:>5} {med[v] * 1e3:>10.1f} {spread:>18} "
            f"{speedup:>8.3f} {of_ideal:>9} {of_reachable:>13} {used:>17} {compile_s[v]:>8.1f}"
        )
    base = losses[(ref, 0)]
    same = {k: bool(np.allclose(x, base, rtol=1e-5)) for k, x in losses.items()}
    print(
        f"losses equal to {ref} rank 0's (rtol 1e-5): "
        + ", ".join(f"{v} rank {r}: {ok}" for (v, r), ok in same.items())
    )
    print(f"other work on the {os.cpu_count()} cores before each round: ", end="")
    print(" ".join(f"{b:.2f}" for b in busy[:-1]) + f"; after: {busy[-1]:.2f}", end="")
    print(" (over 0.2 cores: numbers disturbed)" if max(busy) > 0.2 else "")
    print(
        "per round medians (ms): "
        + "; ".join(f"{v} " + " ".join(f"{x * 1e3:.1f}" for x in rounds[v]) for v in variants)
    )
    pipelines = [v for v in variants if PROCESSES[v] > PROCESSES[ref]]
    if pipelines:  # each round's speedup over the same round's baseline, lowest first
        per_round = {
            v: sorted(r / x / ideal for r, x in zip(rounds[ref], rounds[v])) for v in pipelines
        }
        print(
            f"of the ideal per round (over that round's {ref}): "
            + "; ".join(f"{v} " + " ".join(f"{f:.2f}" for f in per_round[v]) for v in pipelines)
        )
    for v, per_rank in probes.items():
        for rank, p in enumerate(per_rank):
            if p is None:
                continue
            recorded = ", ".join(
                f"{k} {n}x{t * 1e3:.2f}ms" for k, (n, t, _) in sorted(p["recorded"].items())
            )
            print(
                f"{v} rank {rank}: {p['programs']} programs, {p['instructions']} instructions "
                f"({p['ops']}) per step; dispatch loop {p['dispatch_s'] * 1e3:.1f} ms of a "
                f"{p['step_s'] * 1e3:.1f} ms step ({p['dispatch_s'] / p['programs'] * 1e6:.0f} "
                f"us per program); instrumented step: {recorded}"
            )


def main(argv: list[str] | None = None) -> int:
    args = parse(sys.argv[1:] if argv is None else argv)
    if args.role:
        child(args)
        return 0
    t0 = time.perf_counter()
    scaling = core_scaling(args)
    for m in args.microbatches:
        measure(args, m, scaling)
    print(f"\ntotal {time.perf_counter() - t0:.0f} s")
    return 0


if __name__ == "__main__":
    sys.exit(main())
