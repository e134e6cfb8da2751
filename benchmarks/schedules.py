"""Simulated bubble fraction and peak activations of every schedule builder, next to the
closed forms of DESIGN.md, on unit costs (F=1, B=2, BI=BW=1); writes a PNG timeline of
each under docs/.

Run: .venv/bin/python benchmarks/schedules.py [--out docs]
"""

from __future__ import annotations

import argparse
import os
import sys

import jax

jax.config.update("jax_platforms", "cpu")
jax.config.update("jax_num_cpu_devices", 8)

import optax  # noqa: E402

import piper_jax as piper  # noqa: E402
from piper_jax import schedules  # noqa: E402

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "tests"))
from helpers import StageMLP, mlp_batches, mlp_loss  # noqa: E402

UNIT = {"F": 1, "BI": 1, "BW": 1}
F, B, W = 1, 2, 1


def cases(p: int, m: int) -> list[tuple[str, int, object, list, float, int]]:
    """(name, stages, device of stage, orders, closed-form idle per device, closed peak)."""
    v = 2
    return [
        ("GPipe", p, lambda s: s, schedules.gpipe(p, m), (p - 1) * (F + B), m),
        ("1F1B", p, lambda s: s, schedules.one_f_one_b(p, m), (p - 1) * (F + B), p),
        (
            f"interleaved 1F1B (v={v})",
            p * v,
            lambda s: s % p,
            schedules.interleaved_1f1b(p * v, m, p),
            (p - 1) * (v * F + v * B) / v,
            v * p + p - 1,
        ),
        ("ZB-H1", p, lambda s: s, schedules.zero_bubble_h1(p, m), (p - 1) * (F + B - 2 * W), p),
        (
            "DualPipeV",
            2 * p,
            lambda s: min(s, 2 * p - 1 - s),
            schedules.dualpipev(p, m),
            (p - 1) * ((F + B) + B - 3 * W),
            2 * p + 1,
        ),
    ]


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--p", type=int, default=4, help="pipeline devices (ranks)")
    parser.add_argument("--m", type=int, nargs="+", default=[8, 16], help="microbatches")
    parser.add_argument("--out", default="docs", help="folder for the PNG timelines")
    args = parser.parse_args(argv)
    os.makedirs(args.out, exist_ok=True)
    print(f"p={args.p} devices, unit costs F=1 B=2 (BI=BW=1); idle per device in time units")
    print(
        f"{'schedule':<26}{'m':>4}{'step':>7}{'bubble':>9}{'idle':>7}{'closed':>8}"
        f"{'peak0':>7}{'closed':>8}"
    )
    for m in args.m:
        for name, stages, device_of, orders, idle, peak in cases(args.p, m):
            directives = [piper.split({"PP": "*"}, num_microbatches=m)]
            directives += [piper.place({"PP": s}, [device_of(s)]) for s in range(stages)]
            step = piper.compile(
                mlp_loss,
                StageMLP(stages),
                optax.sgd(0.1),
                mlp_batches(1, batch_size=m)[0],
                directives + orders,
            )
            sim = step.simulate(UNIT)
            worst_idle = max(sim.idle.values())
            print(
                f"{name:<26}{m:>4}{sim.step_time:>7.0f}{sim.bubble_fraction:>9.3f}"
                f"{worst_idle:>7.1f}{idle:>8.1f}{sim.peak_activations[(0,)]:>7}{peak:>8}"
            )
            if m == args.m[0]:
                slug = name.split(" (")[0].lower().replace(" ", "_")
                step.timeline(os.path.join(args.out, f"timeline_{slug}.png"), costs=UNIT)
    return 0


if __name__ == "__main__":
    sys.exit(main())
