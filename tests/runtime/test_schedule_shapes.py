"""Every schedule builder's compiled plans against the closed forms of DESIGN.md, on unit
costs (F=1, B=2, BI=BW=1), and the deadlock dry run over a grid of (p, m)."""

from __future__ import annotations

import optax
import pytest
from helpers import StageMLP, mlp_batches, mlp_loss

import piper_jax as piper
from piper_jax import schedules

UNIT = {"F": 1, "BI": 1, "BW": 1}


def compiled(num_stages: int, m: int, device_of, orders):
    directives = [piper.split({"PP": "*"}, num_microbatches=m)]
    directives += [piper.place({"PP": s}, [device_of(s)]) for s in range(num_stages)]
    return piper.compile(
        mlp_loss,
        StageMLP(num_stages),
        optax.sgd(0.1),
        mlp_batches(1, batch_size=m)[0],
        directives + orders,
    )


@pytest.mark.parametrize("p,m", [(2, 2), (2, 4), (3, 3), (4, 4), (4, 8)])
def test_1f1b_and_gpipe(p: int, m: int) -> None:
    for build, peak0 in ((schedules.one_f_one_b, p), (schedules.gpipe, m)):
        sim = compiled(p, m, lambda s: s, build(p, m)).simulate(UNIT)
        assert sim.step_time == pytest.approx((m + p - 1) * 3)
        assert sim.bubble_fraction == pytest.approx((p - 1) / (m + p - 1))
        assert sim.peak_activations[(0,)] == min(peak0, m)


@pytest.mark.parametrize("p,m", [(2, 4), (4, 4), (4, 8)])
def test_zero_bubble_h1(p: int, m: int) -> None:
    sim = compiled(p, m, lambda s: s, schedules.zero_bubble_h1(p, m)).simulate(UNIT)
    for idle in sim.idle.values():
        assert idle == pytest.approx((p - 1) * (1 + 2 - 2 * 1))  # (p-1)(F+B-2W)
    assert sim.peak_activations[(0,)] == p


@pytest.mark.parametrize("devices,v,m", [(2, 2, 4), (2, 2, 8), (4, 2, 8)])
def test_interleaved_1f1b(devices: int, v: int, m: int) -> None:
    p = devices * v
    sim = compiled(p, m, lambda s: s % devices, schedules.interleaved_1f1b(p, m, devices)).simulate(
        UNIT
    )
    # per device F and B are v chunks each: bubble (D-1)(F+B)/v in whole-device units
    for idle in sim.idle.values():
        assert idle == pytest.approx((devices - 1) * (v * 3) / v)
    assert sim.peak_activations[(0,)] == v * devices + devices - 1


@pytest.mark.parametrize("ranks,m", [(2, 4), (2, 8), (4, 8)])
def test_dualpipev(ranks: int, m: int) -> None:
    sim = compiled(
        2 * ranks, m, lambda s: min(s, 2 * ranks - 1 - s), schedules.dualpipev(ranks, m)
    ).simulate(UNIT)
    f_and_b = 1 + 2  # an overlap group costs the sum of its passes in the model
    for idle in sim.idle.values():
        assert idle == pytest.approx((ranks - 1) * (f_and_b + 2 - 3 * 1))
    assert sim.peak_activations[(0,)] == 2 * ranks + 1
