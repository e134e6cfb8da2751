"""Per-device pass order and overlap grouping of the DualPipeV and interleaved 1F1B
builders, pinned as tables, and what the simulator makes of them.

A group is written as its passes joined by '+' (sorted): 'B3.1+F0.3' is an
overlap group of F0.3 beside the whole backward of stage 3 for microbatch 1; a backward
that is not zero-bubble is BI and BW in one group, a zero-bubble one is BI alone with
its BW later on its own.
"""

from __future__ import annotations

import optax
import pytest
from helpers import StageMLP, check_mlp_strategy, mlp_batches, mlp_loss
from piper_jax.directives.schedules import interleaved_1f1b_actions

import piper_jax as piper
from piper_jax import schedules


def table(orders: list) -> list[list[str]]:
    """Each device's order as a list of groups in the notation above."""
    return [
        ["+".join(sorted(f"{f['PASS']}{f['PP']}.{f['MB']}" for f in group)) for group in o.filters]
        for o in orders
    ]


# DeepSeek's DualPipeV (dualpipe/dualpipev.py, DualPipeV.step), pass for pass: phases
# (1) nF0, (2) nF0F1, (3) nB1W1F1 zero-bubble, (4) nF0B1F1B0 (the last rank's first pair
# not overlapped), (5) nB1F1B0, (6) nB1B0 with the second half zero-bubble, (7) nWB0
# zero-bubble, (8) nW; deferred weight gradients run oldest first.
DUALPIPEV_R2_M4 = [
    # rank 0: stages 0 and 3
    ["F0.0", "F0.1", "F0.2", "F3.0", "BI3.0", "BW3.0", "F3.1", "B3.1+F0.3",
     "B0.0+F3.2", "B3.2", "B0.1+F3.3", "B3.3", "BI0.2", "BW0.2",
     "BI0.3", "BW0.3"],
    # rank 1 (last): stages 1 and 2; F1.2 and B2.0 apart in phase (4)
    ["F1.0", "F2.0", "F1.1", "F2.1", "F1.2", "B2.0", "B1.0+F2.2",
     "B2.1+F1.3", "B1.1+F2.3", "B2.2", "B1.2", "BI2.3", "BI1.3",
     "BW2.3", "BW1.3"],
]  # fmt: skip

DUALPIPEV_R3_M6 = [
    # rank 0: stages 0 and 5
    ["F0.0", "F0.1", "F0.2", "F0.3", "F0.4", "F5.0", "BI5.0", "BW5.0", "F5.1", "BI5.1",
     "BW5.1", "F5.2", "B5.2+F0.5", "B0.0+F5.3", "B5.3",
     "B0.1+F5.4", "B5.4", "B0.2+F5.5", "B5.5", "BI0.3", "BW0.3",
     "BI0.4", "BW0.4", "BI0.5", "BW0.5"],
    # rank 1: stages 1 and 4
    ["F1.0", "F1.1", "F1.2", "F4.0", "F1.3", "F4.1", "BI4.0", "BW4.0", "F4.2",
     "B4.1+F1.4", "B1.0+F4.3", "B4.2+F1.5", "B1.1+F4.4",
     "B4.3", "B1.2+F4.5", "B4.4", "B1.3", "BI4.5", "BI1.4",
     "BW4.5", "BI1.5", "BW1.4", "BW1.5"],
    # rank 2 (last): stages 2 and 3; F2.3 and B3.0 apart in phase (4)
    ["F2.0", "F3.0", "F2.1", "F3.1", "F2.2", "F3.2", "F2.3", "B3.0",
     "B2.0+F3.3", "B3.1+F2.4", "B2.1+F3.4", "B3.2+F2.5",
     "B2.2+F3.5", "B3.3", "B2.3", "B3.4", "BI2.4", "BI3.5",
     "BI2.5", "BW2.4", "BW3.5", "BW2.5"],
]  # fmt: skip

# PyTorch / JaxPP / reference Piper interleaved 1F1B at m = D: warm-up
# min(2(D-r-1) + (v-1)D, m v) = 8, 8, 6, 4 forwards on ranks 0..3.
INTERLEAVED_S8_D4_M4 = [
    ["F0.0", "F0.1", "F0.2", "F0.3", "F4.0", "F4.1", "F4.2", "F4.3",
     "B4.0", "B4.1", "B4.2", "B4.3", "B0.0", "B0.1", "B0.2", "B0.3"],
    ["F1.0", "F1.1", "F1.2", "F1.3", "F5.0", "F5.1", "F5.2", "F5.3",
     "B5.0", "B5.1", "B5.2", "B5.3", "B1.0", "B1.1", "B1.2", "B1.3"],
    ["F2.0", "F2.1", "F2.2", "F2.3", "F6.0", "F6.1", "F6.2", "B6.0",
     "F6.3", "B6.1", "B6.2", "B6.3", "B2.0", "B2.1", "B2.2", "B2.3"],
    ["F3.0", "F3.1", "F3.2", "F3.3", "F7.0", "B7.0", "F7.1", "B7.1",
     "F7.2", "B7.2", "F7.3", "B7.3", "B3.0", "B3.1", "B3.2", "B3.3"],
]  # fmt: skip


@pytest.mark.parametrize(
    "ranks,m,expected", [(2, 4, DUALPIPEV_R2_M4), (3, 6, DUALPIPEV_R3_M6)], ids=["R2m4", "R3m6"]
)
def test_dualpipev_matches_deepseek(ranks: int, m: int, expected: list) -> None:
    assert table(schedules.dualpipev(ranks, m)) == expected


def test_interleaved_caps_warmup_when_m_equals_devices() -> None:
    assert table(schedules.interleaved_1f1b(8, 4, 4)) == INTERLEAVED_S8_D4_M4


def runs_to_completion(per_device: list[list[tuple[str, int, int]]], num_stages: int) -> bool:
    """Replay per-device orders, each strictly in order: F s.i needs F s-1.i, B s.i needs
    F s.i and B s+1.i. True when every device reaches its end (no deadlock)."""
    done: set[tuple[str, int, int]] = set()
    pcs = [0] * len(per_device)
    progressed = True
    while progressed:
        progressed = False
        for d, actions in enumerate(per_device):
            while pcs[d] < len(actions):
                kind, s, i = actions[pcs[d]]
                needs = [("F", s - 1, i)] if kind == "F" and s > 0 else []
                if kind == "B":
                    needs = [("F", s, i)] + ([("B", s + 1, i)] if s < num_stages - 1 else [])
                if not all(n in done for n in needs):
                    break
                done.add((kind, s, i))
                pcs[d] += 1
                progressed = True
    return all(pc == len(a) for pc, a in zip(pcs, per_device))


@pytest.mark.parametrize("devices", [2, 3, 4])
@pytest.mark.parametrize("v", [1, 2, 3])
@pytest.mark.parametrize("rounds", [1, 2, 3])
def test_interleaved_is_a_valid_schedule(devices: int, v: int, rounds: int) -> None:
    stages, m = devices * v, devices * rounds
    per_device = [interleaved_1f1b_actions(stages, m, devices, r) for r in range(devices)]
    for r, actions in enumerate(per_device):
        mine = {(kind, s, i) for s in range(r, stages, devices) for i in range(m) for kind in "FB"}
        assert sorted(actions) == sorted(mine)  # every pass of its stages, once
        assert all(actions.index(("F", s, i)) < actions.index(("B", s, i)) for _, s, i in mine)
    assert runs_to_completion(per_device, stages)


def compiled_interleaved(stages: int, devices: int, m: int):
    directives = [piper.split({"PP": "*"}, num_microbatches=m)]
    directives += [piper.place({"PP": s}, [s % devices]) for s in range(stages)]
    directives += schedules.interleaved_1f1b(stages, m, devices)
    batch = mlp_batches(1, batch_size=m)[0]
    return piper.compile(mlp_loss, StageMLP(stages), optax.sgd(0.1), batch, directives)


def test_interleaved_m_equals_devices_holds_fewer_activations() -> None:
    """Capped warm-up at S=8, D=4, m=4: peaks 8, 8, 7, 5 (all forwards first held 8 on
    every device) for the same step time, 33 on unit costs."""
    sim = compiled_interleaved(8, 4, 4).simulate({"F": 1, "BI": 1, "BW": 1})
    assert [sim.peak_activations[(d,)] for d in range(4)] == [8, 8, 7, 5]
    assert sim.step_time == pytest.approx(33.0)


def test_interleaved_m_equals_devices_trains_like_one_device() -> None:
    directives = [piper.split({"PP": "*"}, num_microbatches=2)]
    directives += [piper.place({"PP": s}, [s % 2]) for s in range(4)]
    check_mlp_strategy(directives + schedules.interleaved_1f1b(4, 2, 2), optax.adam(1e-2), 4)


def test_dualpipev_step_time_matches_deepseek() -> None:
    """R=2, m=4, F=1, B=2.5 (BI=1.5, BW=1), latency 0.25: 31.5, DeepSeek's grouping.

    On the last rank (d1) F1.2 runs alone from 5.25 to 6.25, while the cotangent that
    B2.0 needs is on its way from d0 (BI3.0 ends at 6.0, +0.25). Fused with B2.0 in one
    overlap group, F1.2 would wait for that cotangent too and start at 6.25, and the
    step would end F = 1 later: 32.5, what piper-jax gave before.
    """
    ranks, m = 2, 4
    directives = [piper.split({"PP": "*"}, num_microbatches=m)]
    directives += [piper.place({"PP": s}, [min(s, 2 * ranks - 1 - s)]) for s in range(2 * ranks)]
    directives += schedules.dualpipev(ranks, m)
    batch = mlp_batches(1, batch_size=m)[0]
    step = piper.compile(mlp_loss, StageMLP(2 * ranks), optax.sgd(0.1), batch, directives)
    sim = step.simulate({"F": 1, "B": 2.5, "BI": 1.5, "BW": 1.0}, transfer_latency=0.25)
    assert sim.step_time == pytest.approx(31.5)
    f12 = next(e for e in sim.timeline if e.group == (1,) and e.label == "F1.2")
    assert (f12.start, f12.end) == pytest.approx((5.25, 6.25))


@pytest.mark.parametrize(
    "build,match",
    [
        (lambda: schedules.interleaved_1f1b(4, 4, 0), r"interleaved_1f1b: num_devices .* got 0"),
        (lambda: schedules.dualpipev(0, 4), r"dualpipev: num_ranks must be an int >= 1, got 0"),
        (lambda: schedules.gpipe(2, True), r"gpipe: num_microbatches .* got True"),
    ],
)
def test_builder_counts_are_checked_by_name(build, match: str) -> None:
    with pytest.raises(piper.DirectiveError, match=match):
        build()
