"""Does `piper.search` pick well? Search strategies for the example GPT on 4 virtual CPU
devices, then compile and time the top 5 for real: the first pick's measured step time
should be within 10% of the best of the five.

Each round times every candidate for a block of steps (median), the order of the
candidates rotating between rounds; a candidate's time is the median over rounds.

Run: .venv/bin/python benchmarks/search.py [--top 5] [--rounds 10] [--steps 5]
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
import time

import jax

jax.config.update("jax_platforms", "cpu")
jax.config.update("jax_num_cpu_devices", 4)

import numpy as np  # noqa: E402

import piper_jax as piper  # noqa: E402

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "examples"))
from gpt import factory  # noqa: E402


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--top", type=int, default=5, help="candidates to time")
    parser.add_argument("--rounds", type=int, default=10)
    parser.add_argument("--steps", type=int, default=5, help="timed steps per block")
    parser.add_argument("--tolerance", type=float, default=0.10)
    args = parser.parse_args(argv)
    model, loss_fn, optimizer, batch = factory(num_stages=4)
    found = piper.search(loss_fn, model, optimizer, batch, num_devices=4)
    print(found.table(args.top))
    steps = []
    for r in found[: args.top]:
        fresh, *_ = factory(num_stages=4)
        step = piper.compile(loss_fn, fresh, optimizer, batch, r.directives)
        for _ in range(2):
            step(batch)  # compile every program, warm the caches
        steps.append(step)
    times: list[list[float]] = [[] for _ in steps]
    for k in range(args.rounds):
        for i in np.roll(np.arange(len(steps)), k):
            block = []
            for _ in range(args.steps):
                start = time.perf_counter()
                steps[i](batch)
                block.append(time.perf_counter() - start)
            times[i].append(statistics.median(block))
    measured = [statistics.median(t) for t in times]
    print(f"\n{'#':>3}  {'predicted ms':>12}  {'measured ms':>11}  strategy")
    for i, r in enumerate(found[: args.top]):
        print(f"{i + 1:>3}  {r.step_time * 1e3:>12.1f}  {measured[i] * 1e3:>11.1f}  {r.candidate}")
    best = min(measured)
    ratio = measured[0] / best
    verdict = "within" if ratio <= 1 + args.tolerance else "NOT within"
    print(
        f"first pick {measured[0] * 1e3:.1f} ms, best of {len(measured)} {best * 1e3:.1f} ms: "
        f"{ratio:.3f}x, {verdict} {args.tolerance:.0%}"
    )
    return 0 if ratio <= 1 + args.tolerance else 1


if __name__ == "__main__":
    sys.exit(main())
