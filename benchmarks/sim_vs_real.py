"""Does the simulator predict the real step? Time each program once (`measure_costs`),
simulate the plans with those costs, and compare with the measured step time, for
GPipe, 1F1B, ZB-H1 (2 stages) and DualPipeV (4 stages, 2 per device) on 2 virtual CPU
devices in one process; the last line is the median absolute error over the schedules.

Run: .venv/bin/python benchmarks/sim_vs_real.py [--width 1024] [--m 8]
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
import time

import jax

jax.config.update("jax_platforms", "cpu")
jax.config.update("jax_num_cpu_devices", 2)

import numpy as np  # noqa: E402
import optax  # noqa: E402

import piper_jax as piper  # noqa: E402

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "tests"))
from helpers import StageMLP, mlp_loss  # noqa: E402


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--width", type=int, default=1024)
    parser.add_argument("--batch-size", type=int, default=256)
    parser.add_argument("--m", type=int, default=8, help="microbatches")
    parser.add_argument("--steps", type=int, default=10)
    args = parser.parse_args(argv)
    rng = np.random.default_rng(0)
    batch = {k: rng.normal(size=(args.batch_size, 8)).astype(np.float32) for k in ("x", "y")}
    print(f"{'schedule':<16}{'predicted ms':>14}{'measured ms':>13}{'error':>8}")
    errors = []
    for name in ("gpipe", "one_f_one_b", "zero_bubble_h1", "dualpipev"):
        stages = 4 if name == "dualpipev" else 2
        device_of = [min(s, stages - 1 - s) for s in range(stages)]  # DualPipeV's V
        directives = [
            piper.split({"PP": "*"}, num_microbatches=args.m),
            *(piper.place({"PP": s}, [d]) for s, d in enumerate(device_of)),
            *getattr(piper.schedules, name)(2, args.m),
        ]
        step = piper.compile(
            mlp_loss, StageMLP(stages, width=args.width), optax.sgd(1e-3), batch, directives
        )
        step(batch)  # compile everything before measuring
        predicted = step.simulate(step.measure_costs(batch)).step_time
        times = []
        for _ in range(args.steps):
            start = time.perf_counter()
            step(batch)
            times.append(time.perf_counter() - start)
        measured = statistics.median(times)
        errors.append((predicted - measured) / measured)
        print(f"{name:<16}{predicted * 1e3:>14.1f}{measured * 1e3:>13.1f}{errors[-1]:>+8.1%}")
    print(f"median absolute error {statistics.median(abs(e) for e in errors):.1%}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
