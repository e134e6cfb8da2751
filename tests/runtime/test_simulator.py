"""The cost-model simulator against the DESIGN closed forms, and timeline output."""

from __future__ import annotations

import dataclasses
import functools
import json

import optax
import pytest
from helpers import StageMLP, deadlocked_steps, mlp_batches, mlp_loss
from piper_jax.mpmd_runtime.simulator import resolve_costs, simulate
from piper_jax.mpmd_runtime.timeline import write_timeline

import piper_jax as piper

FB = {"F": 1, "B": 2}  # F + B = 3 time units per microbatch and stage


@functools.cache
def pipeline_step(schedule: str, p: int, m: int):
    """StageMLP(p), stage s on device s, scheduled by `schedule` (one_f_one_b or gpipe)."""
    directives = [
        piper.split({"PP": "*"}, num_microbatches=m),
        *[piper.place({"PP": s}, [s]) for s in range(p)],
        *getattr(piper.schedules, schedule)(p, m),
    ]
    return piper.compile(mlp_loss, StageMLP(p), optax.sgd(0.1), mlp_batches(1)[0], directives)


def test_1f1b_p4_m8_closed_forms() -> None:
    step = pipeline_step("one_f_one_b", 4, 8)
    sim = simulate(step.plans, FB)
    assert sim.step_time == 33  # (m + p - 1)(F + B)
    assert sim.bubble_fraction == pytest.approx(3 / 11)  # (p - 1) / (m + p - 1)
    assert sim.idle == {(s,): 9 for s in range(4)}  # (p - 1)(F + B) on every device
    assert sim.peak_activations[(0,)] == 4  # p


@pytest.mark.parametrize("p,m", [(2, 4), (4, 4), (4, 8)])
def test_1f1b_bubble_fraction(p: int, m: int) -> None:
    step = pipeline_step("one_f_one_b", p, m)
    sim = simulate(step.plans, FB)
    assert sim.step_time == (m + p - 1) * 3
    assert sim.bubble_fraction == pytest.approx((p - 1) / (m + p - 1))
    assert sim.peak_activations[(0,)] == p
    # the last stage holds one activation at a time
    assert sim.peak_activations[(p - 1,)] == 1


def test_gpipe_p4_m8_holds_all_microbatches() -> None:
    step = pipeline_step("gpipe", 4, 8)
    sim = simulate(step.plans, FB)
    assert sim.peak_activations[(0,)] == 8  # m
    assert sim.step_time == 33  # the same bubble as 1F1B, (p - 1)(F + B)
    assert sim.bubble_fraction == pytest.approx(3 / 11)


def test_timeline_is_consistent() -> None:
    step = pipeline_step("one_f_one_b", 4, 8)
    sim = simulate(step.plans, FB)
    non_free = sum(1 for plan in step.plans.plans.values() for i in plan if i.op != "FREE")
    assert len(sim.timeline) == non_free
    by_group: dict = {}
    for e in sim.timeline:
        by_group.setdefault(e.group, []).append(e)
    for events in by_group.values():  # one instruction at a time per group
        for a, b in zip(events, events[1:]):
            assert a.end <= b.start
    f03 = next(e for e in sim.timeline if e.label == "F0.3")
    assert (f03.kind, f03.microbatch, f03.start, f03.end) == ("F", 3, 3, 4)


def test_collective_and_update_costs() -> None:
    # the tied embedding makes an ALL_REDUCE over d0 and d3; then the global gradient
    # norm (the non-finite guard) is summed over every group, before any update
    step = pipeline_step("one_f_one_b", 4, 8)
    sim = simulate(step.plans, {**FB, "ALL_REDUCE": 5, "UPD": 1})
    tied = [e for e in sim.timeline if e.label == "ALL_REDUCE grad[0,3] d0,3"]
    assert sorted(e.group for e in tied) == [(0,), (3,)]
    assert {(e.start, e.end) for e in tied} == {(33, 38)}  # waits for d0's last B
    norm = [e for e in sim.timeline if e.label.startswith("ALL_REDUCE gnorm")]
    assert len(norm) == 4 and {(e.start, e.end) for e in norm} == {(38, 43)}
    assert sim.step_time == 44
    assert sim.idle[(0,)] == 44 - 25  # UPD counts as compute, the all-reduces do not


def test_transfer_latency_delays_receives() -> None:
    step = pipeline_step("one_f_one_b", 2, 4)
    base = simulate(step.plans, FB)
    sim = simulate(step.plans, FB, transfer_latency=0.5)
    assert sim.step_time > base.step_time
    sends = {e.label.split()[1]: e for e in sim.timeline if e.kind == "SEND"}
    recvs = [e for e in sim.timeline if e.kind == "RECV"]
    assert len(recvs) == len(sends) == 8
    for r in recvs:
        assert r.start >= sends[r.label.split()[1]].end + 0.5


def test_costs() -> None:
    assert resolve_costs({"F": 1, "BI": 1, "BW": 1})["B"] == 2
    assert resolve_costs({"F": 1, "B": 2})["BI"] == 1
    assert resolve_costs({"F": 1, "B": 3, "BW": 1})["BI"] == 2
    step = pipeline_step("one_f_one_b", 2, 4)
    split = simulate(step.plans, {"F": 1, "BI": 1, "BW": 1})
    assert split.step_time == simulate(step.plans, FB).step_time
    with pytest.raises(piper.PiperError, match="unknown cost key 'FWD'"):
        simulate(step.plans, {"FWD": 1, "B": 2})
    with pytest.raises(piper.PiperError, match="no 'F'"):
        simulate(step.plans, {"B": 2})
    with pytest.raises(piper.PiperError, match="'B' must be a finite number >= 0"):
        simulate(step.plans, {"F": 1, "B": -2})


def test_deadlock_raises_plan_error() -> None:
    step = pipeline_step("one_f_one_b", 2, 2)
    bad = dataclasses.replace(step.plans, steps=deadlocked_steps(step))
    with pytest.raises(piper.PlanError, match=r"deadlock(.|\n)*d0: RECV B1.0 <- d1(.|\n)*>> "):
        simulate(bad, FB)


def test_write_timeline_png_and_json(tmp_path) -> None:
    step = pipeline_step("one_f_one_b", 4, 8)
    sim = simulate(step.plans, FB)
    png = tmp_path / "timeline.png"
    write_timeline(sim.timeline, png, title="1F1B p=4 m=8")
    assert png.read_bytes().startswith(b"\x89PNG\r\n\x1a\n")
    trace_path = tmp_path / "timeline.json"
    write_timeline(sim.timeline, trace_path, title="1F1B p=4 m=8")
    trace = json.loads(trace_path.read_text())
    slices = [e for e in trace["traceEvents"] if e["ph"] == "X"]
    non_free = sum(1 for plan in step.plans.plans.values() for i in plan if i.op != "FREE")
    assert len(slices) == non_free
    last = max(slices, key=lambda e: e["ts"] + e["dur"])
    assert last["ts"] + last["dur"] == pytest.approx(33 * 1000.0)  # 1 unit = 1 ms
    names = {e["args"]["name"] for e in trace["traceEvents"] if e["name"] == "thread_name"}
    assert names == {"d0", "d1", "d2", "d3"}


def test_measured_costs_and_timeline(tmp_path) -> None:
    """An instrumented real step: per-pass seconds for simulate(), and a real timeline.
    Wide enough that a backward outlasts the host's issue time, which `measure_costs`
    takes off each pass (at width 16 a loaded machine's issue time swallowed it)."""
    step = piper.compile(
        mlp_loss,
        StageMLP(2, width=256),
        optax.sgd(0.1),
        mlp_batches(1)[0],
        [
            piper.split({"PP": "*"}, num_microbatches=2),
            piper.place({"PP": 0}, [0]),
            piper.place({"PP": 1}, [1]),
            *piper.schedules.one_f_one_b(2, 2),
        ],
    )
    batch = mlp_batches(1)[0]
    step(batch)  # compile first, so the measurement sees run time only
    costs = step.measure_costs(batch)
    assert {"F", "B", "UPD"} <= set(costs) and all(v >= 0 for v in costs.values())
    assert costs["F"] > 0 and costs["B"] > 0
    assert {"F0", "F1", "B0", "B1", "UPD0", "UPD1"} <= set(costs)  # each region its own
    assert costs["DISPATCH"] > 0 and costs["STEP"] > 0  # the host's, from a real step
    assert step.simulate(costs).step_time > 0
    path = tmp_path / "real.json"
    step.timeline(path, batch=batch)
    events = [e for e in json.loads(path.read_text())["traceEvents"] if e["ph"] == "X"]
    assert {e["name"] for e in events} >= {"F0.0", "B1.1", "UPD0"}


ZERO3 = [
    piper.split({"PP": "*"}, num_microbatches=2),
    piper.replicate({"PP": "*"}, [0, 1], shard_params=True),
]


def test_fused_steps_are_measured_and_costed_whole() -> None:
    """Under ZeRO-3 every pass runs in one program with its gathers: measure_costs times
    those steps whole, under their joined kinds, and simulate prices the plans with them."""
    batch = mlp_batches(1)[0]
    step = piper.compile(mlp_loss, StageMLP(2), optax.sgd(0.1), batch, ZERO3)
    step(batch)
    costs = step.measure_costs(batch)
    assert {"ALL_GATHER+F", "ALL_GATHER+B+REDUCE_SCATTER"} <= set(costs), costs
    assert not {"F", "B"} & set(costs)
    assert step.simulate(costs).step_time > 0


def test_a_fused_cost_is_shared_out_over_its_pieces() -> None:
    plans = piper.lower(mlp_loss, StageMLP(2), optax.sgd(0.1), mlp_batches(1)[0], ZERO3).plans
    base = simulate(plans, FB)
    fused = simulate(plans, {**FB, "ALL_GATHER+F": 0.5})
    assert fused.step_time == base.step_time - 4 * 0.5  # 4 forwards, each half price
    gather, forward = [e for e in fused.timeline if e.microbatch == 0 and e.group == (0, 1)][:2]
    assert (gather.kind, gather.end - gather.start) == ("ALL_GATHER", 0.0)
    assert (forward.kind, forward.end - forward.start) == ("F", 0.5)
    whole = {"ALL_GATHER+F": 1, "ALL_GATHER+B+REDUCE_SCATTER": 2}
    even = simulate(plans, whole)  # no own costs of the pieces: shared out evenly
    assert even.step_time == base.step_time
    assert {e.end - e.start for e in even.timeline if e.kind == "F"} == {0.5}
    with pytest.raises(piper.PiperError, match="unknown cost key 'F\\+X'"):
        simulate(plans, {**FB, "F+X": 1})


def _overlaps(events: list) -> list:
    events = sorted(events, key=lambda e: e.start)
    return [(a.label, b.label) for a, b in zip(events, events[1:]) if b.start < a.end - 1e-12]


def test_transfers_between_processes_wait_for_their_receiver() -> None:
    """Between processes a transfer holds both groups from when both are free (Note
    [transfers between processes meet]); within one process the sender never waits."""
    plans = pipeline_step("one_f_one_b", 2, 4).plans
    costs = {**FB, "SEND": 0.5}
    one = simulate(plans, costs)
    assert simulate(plans, costs, processes={0: 0, 1: 0}).timeline == one.timeline
    two = simulate(plans, costs, processes={0: 0, 1: 1})
    assert two.step_time > one.step_time
    for g in ((0,), (1,)):  # a group runs one thing at a time, the meetings included
        assert not _overlaps([e for e in two.timeline if e.group == g])

    def free_at(group: tuple, t: float) -> float:
        return max((e.end for e in two.timeline if e.group == group and e.end <= t), default=0)

    sends = [e for e in two.timeline if e.kind == "SEND"]
    recvs = {(e.label.split()[1], e.start, e.end) for e in two.timeline if e.kind == "RECV"}
    assert len(sends) == 2 * 4
    for send in sends:  # each SEND and its RECV: one meeting, once both groups are free
        assert (send.label.split()[1], send.start, send.end) in recvs
        receiver = (1,) if send.group == (0,) else (0,)
        both_free = max(free_at(send.group, send.start), free_at(receiver, send.start))
        assert send.start == pytest.approx(both_free)


def test_transfers_of_one_exchange_meet_together() -> None:
    """The runtime runs an exchange's SENDs as one program at the first one's place
    (Note [meeting before local work] in exchanges.py), so stage 1's deferred weight
    gradient in a 2-process ZB-H1 runs after both of a pair's transfers, not between."""
    plans = pipeline_step("zero_bubble_h1", 2, 4).plans
    timeline = simulate(plans, {**FB, "BI": 1, "BW": 1, "SEND": 0.5}, processes={0: 0, 1: 1})
    at = {e.label: e for e in timeline.timeline}
    for k in (1, 2):
        first, joined = at[f"SEND BI1.{k} -> d0"], at[f"SEND F0.{k + 1} -> d1"]
        assert joined.start == pytest.approx(first.end)
        assert at[f"BW1.{k - 1}"].start >= joined.end


def _issued(plans, g: tuple) -> int:
    """Steps of group g its host issues: all but FREE and taking a value from the mailbox."""
    return sum(1 for step in plans.steps[g] if step.head.op not in ("FREE", "RECV"))


def test_a_step_starts_once_its_host_has_issued_it() -> None:
    """Note [the host issues the steps]: each step waits for its issue; where the host
    shares its device's core, issuing while work is queued holds that work up; STEP is
    the host's own time per step."""
    plans = pipeline_step("one_f_one_b", 1, 4).plans
    base = simulate(plans, FB, processes={0: 0}).step_time
    host = {**FB, "DISPATCH": 0.01, "STEP": 0.5}
    apart = simulate(plans, host, processes={0: 0})  # a host of its own: only the first waits
    assert apart.step_time == pytest.approx(base + 0.01 + 0.5)
    shared = simulate(plans, host, processes={0: 0}, host_shares_core=True)
    # the first issue finds the device idle; every later one lands while work is queued
    assert shared.step_time == pytest.approx(base + _issued(plans, (0,)) * 0.01 + 0.5)
    assert shared.bubble_fraction == pytest.approx(
        (shared.step_time - 0.5 - 12) / (shared.step_time - 0.5)
    )


def _issued_before(plans, first: str, then: str):
    """`plans` with the step `first` moved to just before `then` in the issue order."""
    order = list(plans.order)
    at = {str(plans.steps[g[0]][i[0]]): (g, i) for g, i in order}
    order.remove(at[first])
    order.insert(order.index(at[then]), at[first])
    return dataclasses.replace(plans, order=order)


def test_a_receiving_host_runs_a_transfer_its_devices_are_idle_for() -> None:
    """A transfer whose receiving devices have nothing queued runs on the receiver's host
    thread, so that host issues nothing more until it ends (Note [the host issues the
    steps]): where stage 1's first forward is issued after both activations are received,
    it starts one issue after the second arrives."""
    plans = _issued_before(pipeline_step("gpipe", 2, 2).plans, "SEND F0.1 -> d1", "F1.0")
    costs = {**FB, "SEND": 0.5}
    processes = {0: 0, 1: 1}

    def first(timeline: list, label: str) -> object:
        return next(e for e in timeline if e.label == label)

    # the plans' own order issues that forward first (Note [issue order] in replay.py)
    own = simulate(pipeline_step("gpipe", 2, 2).plans, costs, processes=processes).timeline
    assert first(own, "F1.0").start < first(own, "SEND F0.1 -> d1").start
    without = simulate(plans, costs, processes=processes).timeline
    assert first(without, "F1.0").start == first(without, "SEND F0.1 -> d1").end
    hosts = simulate(plans, {**costs, "DISPATCH": 0.01}, processes=processes).timeline
    arrived = first(hosts, "SEND F0.1 -> d1").end
    assert first(hosts, "F1.0").start == pytest.approx(arrived + 0.01)
