"""`piper.search` and what it stands on: per-region costs in the simulator, memory
estimated without devices, and the candidates it writes as directive lists."""

from __future__ import annotations

import optax
import pytest
from helpers import StageMLP, check_mlp_strategy, mlp_batches, mlp_loss
from piper_jax.mpmd_runtime.simulator import CostError, peak_activations, resolve_costs

import piper_jax as piper
from piper_jax.region_costs import lowered_memory
from piper_jax.search import Candidate, enumerate_candidates


def pipeline(schedule: str, p: int, m: int) -> piper.Lowered:
    directives = [piper.split({"PP": "*"}, num_microbatches=m)]
    directives += [piper.place({"PP": s}, [s]) for s in range(p)]
    directives += getattr(piper.schedules, schedule)(p, m)
    return piper.lower(mlp_loss, StageMLP(p), optax.sgd(0.1), mlp_batches(1)[0], directives, 4)


def test_a_region_of_its_own_cost_changes_the_step_time() -> None:
    """GPipe, 2 stages, 2 microbatches, stage 1 three times as slow as stage 0:
    F0.0 0-1, F0.1 1-2, F1.0 1-4, F1.1 4-7, B1.0 7-13, B1.1 13-19, B0.0 13-15, B0.1 19-21."""
    lowered = pipeline("gpipe", 2, 2)
    assert lowered.simulate({"F": 1, "B": 2}).step_time == 9  # (m + p - 1)(F + B)
    sim = lowered.simulate({"F": 1, "B": 2, "F1": 3, "B1": 6})
    assert sim.step_time == 21
    stage0 = [(e.label, e.start, e.end) for e in sim.timeline if e.group == (0,)]
    assert ("B0.1", 19, 21) in stage0


def test_per_region_backward_parts_fill_in_like_the_global_ones() -> None:
    table = resolve_costs({"F": 1, "B": 2, "B3": 6, "BI3": 4, "F3": 1})
    assert (table["BI"], table["BW"]) == (1, 1)
    assert (table["BI3"], table["BW3"]) == (4, 2)
    assert "BW4" not in table
    with pytest.raises(CostError, match=r"unknown cost key 'F1x'.*\(F0, B3, UPD1\)"):
        resolve_costs({"F1x": 1})
    with pytest.raises(CostError, match=r"cost of 'BI2' \(5\) exceeds that of 'B2'"):
        resolve_costs({"B2": 4, "BI2": 5})
    with pytest.raises(CostError, match=r"add 'B' \(or B1\)"):
        pipeline("gpipe", 2, 2).simulate({"F": 1, "B0": 1})


def test_peak_activations_weighed_by_region() -> None:
    """1F1B, p=2, m=4: stage 0 holds at most 2 microbatches, stage 1 one; weighed by
    bytes per region, the peaks scale by each region's weight."""
    sim = pipeline("one_f_one_b", 2, 4).simulate()
    groups = [(0,), (1,)]
    assert peak_activations(sim.timeline, groups) == {(0,): 2, (1,): 1}
    assert peak_activations(sim.timeline, groups, {0: 100, 1: 7}) == {(0,): 200, (1,): 7}


def test_memory_estimate_matches_what_the_runtime_holds() -> None:
    """PP2 x DP2 ZeRO-3 (one region per device group): parameters and activations
    exactly as step.memory() reports them, optimizer state to the byte count of adam's
    step counters."""
    c = Candidate((0, 1), 2, "1f1b", 2, zero=3, recompute=False)
    batch = mlp_batches(1)[0]
    step = piper.compile(mlp_loss, StageMLP(2), optax.adam(1e-2), batch, c.directives())
    step(batch)
    real = step.memory()
    estimate = lowered_memory(step.lowered, StageMLP(2), optax.adam(1e-2), step.simulate().timeline)
    assert sorted(estimate) == sorted(real) == [0, 1, 2, 3]
    for d, row in real.items():
        assert estimate[d]["params"] == row["params"]
        assert estimate[d]["activations"] == row["activations"]
        assert estimate[d]["opt_state"] == pytest.approx(row["opt_state"], abs=16)


def test_candidates_of_four_regions_on_four_devices() -> None:
    found = list(enumerate_candidates(4, 4, 32, None, ("none", "1f1b", "interleaved",
                                                          "zb-h1", "dualpipev"), (0, 1, 3),
                                      (False, True)))  # fmt: skip
    names = {str(c) for c in found}
    assert "PP1 [0,1,2,3] x DP4, m=1" in names
    assert "PP1 [0,1,2,3] x DP4, m=2, ZeRO-2, recompute" in names  # ZeRO-1 is ZeRO-2
    assert "PP2 [0,1|2,3] x DP2, 1f1b, m=4, ZeRO-3" in names
    assert "PP2 [0|1,2,3] x DP2, zb-h1, m=2" in names
    assert "PP2 [0,2|1,3] x DP2, interleaved, m=2" in names
    assert "PP2 [0,3|1,2] x DP2, dualpipev, m=4" in names
    assert "PP4 [0|1|2|3] x DP1, 1f1b, m=16, recompute" in names
    assert not [c for c in found if c.schedule == "dualpipev" and c.microbatches < 4]
    assert not [c for c in found if c.recompute and c.schedule in ("zb-h1", "dualpipev")]
    assert not [c for c in found if c.zero == 1]


@pytest.mark.parametrize("schedule", ["1f1b", "zb-h1"])
def test_stages_grouping_several_regions_train_like_one_device(schedule: str) -> None:
    """The orders search writes for stages of several regions (stage 0 = regions 0-1,
    stage 1 = regions 2-3) train equal to the single-device reference."""
    c = Candidate((0, 0, 1, 1), 1, schedule, 4, zero=0, recompute=False)
    step = check_mlp_strategy(c.directives(), optax.adam(1e-2), num_stages=4)
    assert len(step.plans.steps) == 2


def test_search_ranks_drops_over_the_memory_limit_and_its_pick_trains() -> None:
    batch = mlp_batches(1, batch_size=16)[0]
    found = piper.search(mlp_loss, StageMLP(4), optax.adam(1e-2), batch, 4, costs="unit")
    times = [r.step_time for r in found]
    assert times == sorted(times) and len(found) > 50 and not found.rejected
    assert {r.candidate.pipeline for r in found} == {1, 2, 4}
    assert "candidates ranked, 0 dropped" in found.table(3)
    assert found.parallelism == 4  # unit costs: the devices are taken to be independent
    peaks = sorted(r.peak_memory for r in found)
    limit = peaks[len(peaks) // 2]
    capped = piper.search(mlp_loss, StageMLP(4), optax.adam(1e-2), batch, 4, limit, costs="unit")
    assert all(r.peak_memory <= limit for r in capped)
    assert capped.rejected and "MiB per device" in capped.rejected[0][1]
    check_mlp_strategy(capped[0].directives, optax.adam(1e-2), num_stages=4)


def test_search_on_measured_costs() -> None:
    """Measured costs: seconds, every pass timed (a small candidate set)."""
    batch = mlp_batches(1, batch_size=16)[0]
    found = piper.search(
        mlp_loss, StageMLP(2, width=64), optax.adam(1e-2), batch, 2,
        microbatches=[2], schedules=["none", "1f1b"], zero_levels=[0], recompute=[False],
    )  # fmt: skip
    assert found.unit == "s" and len(found) == 2
    assert {str(r.candidate) for r in found} == {
        "PP1 [0,1] x DP2, m=2",
        "PP2 [0|1] x DP1, 1f1b, m=2",
    }
    assert all(0 < r.step_time < 1 for r in found)
    assert 1 <= found.parallelism <= 2
    assert " ms " in found.table().splitlines()[0] + " "


@pytest.mark.parametrize(
    "kwargs, error",
    [
        ({"num_devices": 0}, "num_devices must be an int >= 1"),
        ({"costs": "fast"}, "costs='fast'; use 'measured' or 'unit'"),
        ({"schedules": ["1f1b", "zb"]}, r"unknown schedules \['zb'\]"),
        ({"microbatches": [3]}, "no candidate strategy for 4 devices and batch size 16"),
        ({"memory_limit": 1}, "no candidate strategy fits"),
    ],
)
def test_search_refuses_what_cannot_work(kwargs: dict, error: str) -> None:
    args = {"num_devices": 4, "costs": "unit", **kwargs}
    with pytest.raises(piper.PiperError, match=error):
        piper.search(mlp_loss, StageMLP(2), optax.sgd(0.1), mlp_batches(1)[0], **args)
