"""Lowering and simulating plans for thousands of devices, without any device.

`piper.lower` builds the training DAG and the per-group plans of a strategy (no XLA
programs), and the simulator replays them: what a user does to explore a strategy for a
cluster they do not have. The compiler's cost must grow about linearly in the plan
instructions. For each size, pipeline stages (or V-shaped rank pairs) on groups of DP
replicas, a tiny MLP with one region per stage, this prints the instructions, the
seconds to lower and to simulate, and the process's peak resident memory so far
(sizes run from small to large, so each row's peak is its own).

Run: .venv/bin/python benchmarks/plans_at_scale.py [--sizes small|all]
"""

from __future__ import annotations

import argparse
import os
import resource
import sys
import time

SIZES = {  # (pipeline ranks, data-parallel replicas per rank, microbatches)
    "64": (8, 8, 16),
    "1024": (16, 64, 32),
    "16384": (64, 256, 128),
}


def strategy(schedule: str, ranks: int, dp: int, m: int) -> tuple[int, list]:
    """(stages, directives): stage s on the group of rank s (1F1B), s % ranks
    (interleaved, two stages per rank) or the V of DualPipeV."""
    import piper_jax as piper

    stages = ranks if schedule == "1f1b" else 2 * ranks
    if schedule == "1f1b":
        rank_of = list(range(stages))
        orders = piper.schedules.one_f_one_b(stages, m)
    elif schedule == "interleaved":
        rank_of = [s % ranks for s in range(stages)]
        orders = piper.schedules.interleaved_1f1b(stages, m, ranks)
    else:
        rank_of = [min(s, stages - 1 - s) for s in range(stages)]
        orders = piper.schedules.dualpipev(ranks, m)
    directives = [piper.split({"PP": "*"}, num_microbatches=m)]
    for s, r in enumerate(rank_of):
        devices = list(range(r * dp, (r + 1) * dp))
        directives += [piper.place({"PP": s}, devices), piper.replicate({"PP": s}, devices)]
    return stages, directives + orders


def measure(schedule: str, ranks: int, dp: int, m: int) -> str:
    import optax

    import piper_jax as piper

    sys.path.insert(0, os.path.join(os.path.dirname(__file__), "..", "tests"))
    from helpers import StageMLP, mlp_batches, mlp_loss

    stages, directives = strategy(schedule, ranks, dp, m)
    model, batch = StageMLP(stages, width=8), mlp_batches(1, batch_size=m * dp)[0]
    t0 = time.perf_counter()
    lowered = piper.lower(
        mlp_loss, model, optax.sgd(0.1), batch, directives, num_devices=ranks * dp
    )
    t1 = time.perf_counter()
    sim = lowered.simulate()
    t2 = time.perf_counter()
    peak = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024  # of the process so far
    count = sum(len(p) for p in lowered.plans.plans.values())
    return (
        f"{schedule:<12}{ranks * dp:>8}{ranks:>6}{dp:>5}{m:>5}{count:>10}"
        f"{t1 - t0:>9.1f}{t2 - t1:>9.1f}{t2 - t0:>8.1f}{peak / 2**20:>9.0f}"
        f"   bubble {sim.bubble_fraction:.3f}"
    )


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--sizes", choices=["small", "all"], default="all")
    parser.add_argument("--schedules", default="1f1b,interleaved,dualpipev")
    args = parser.parse_args(argv)
    import jax

    jax.config.update("jax_platforms", "cpu")
    sizes = list(SIZES) if args.sizes == "all" else ["64", "1024"]
    header = (
        f"{'schedule':<12}{'devices':>8}{'ranks':>6}{'dp':>5}{'m':>5}{'instr':>10}"
        f"{'lower s':>9}{'sim s':>9}{'total':>8}{'rss MiB':>9}"
    )
    print(header)
    print("-" * len(header))
    for size in sizes:
        for schedule in args.schedules.split(","):
            print(measure(schedule, *SIZES[size]), flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
