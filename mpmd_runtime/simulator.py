"""Cost-model run of compiled plans: step time, bubble, peak activations, a timeline.

`simulate` replays the per-group plans with a cost per instruction instead of running
programs. It answers "what would this strategy cost" without devices, and its timeline
draws the schedule (see `timeline.write_timeline`).

Note [simulated semantics]
Each device group runs its plan strictly in order. An instruction starts at the latest
of: the time its group is free, the finish time of every DAG predecessor (data and
temporal edges), plus `transfer_latency` on the SEND -> RECV edge. A collective (one
DAG node in the plans of several groups) starts when every member group has reached
it and occupies all of them until it ends. A SEND does not wait for its RECV. FREE
costs nothing. Start times are the earliest the dependencies allow (the longest path
through program order, data edges and collective joins), so the order in which the
simulator resolves instructions does not change the result; if no group can resolve
its next instruction while some remain, the plans deadlock and PlanError is raised.
"""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Mapping

from piper_jax.ir.dag import NodeKind, TrainingDAG, group_str
from piper_jax.ir.errors import PiperError, PlanError
from piper_jax.mpmd_runtime.instructions import FREE, RECV, RUN, UPD, Instruction
from piper_jax.mpmd_runtime.plans import Plans, format_grid

Group = tuple[int, ...]

PASS_KEYS = ("F", "B", "BI", "BW")
OP_KEYS = ("UPD", "SEND", "RECV", "ALL_REDUCE", "REDUCE_SCATTER", "ALL_GATHER", "ALL_TO_ALL")
COMPUTE_KINDS = frozenset({*PASS_KEYS, UPD})


class CostError(PiperError):
    """A cost table names an unknown pass or op, or gives a cost that is not a time."""


@dataclasses.dataclass(frozen=True)
class TimelineEvent:
    """One instruction of one device group, placed in time.

    Attributes:
      group: the device group that ran it.
      label: the instruction's string form, e.g. F1.3 or SEND F1.3 -> d2.
      kind: F, B, BI, BW, UPD, SEND, RECV or the collective's op (ALL_REDUCE).
      microbatch: the microbatch it serves, None for UPD and collectives.
      start: start time (cost units in a simulation, seconds in a measured run).
      end: end time, same unit.
    """

    group: Group
    label: str
    kind: str
    microbatch: int | None
    start: float
    end: float


@dataclasses.dataclass(frozen=True)
class Simulation:
    """The result of `simulate`.

    Attributes:
      step_time: the makespan: when the last instruction of any group ends.
      bubble_fraction: mean over device groups of the time in [0, step_time] the group
        runs no compute (F, B, BI, BW, UPD), divided by step_time. Communication does
        not count as busy: exposed communication is bubble.
      idle: per device group, that idle time (the DESIGN table's "bubble (time)").
      peak_activations: per device group, the most (region, microbatch) forward
        activations alive at once; one is alive from the start of its F to the end of
        its last backward pass on the group (B, or BW when the backward is split).
      timeline: every non-FREE instruction of every group (a collective once per member
        group), sorted by start time then group.
    """

    step_time: float
    bubble_fraction: float
    idle: dict[Group, float]
    peak_activations: dict[Group, int]
    timeline: list[TimelineEvent]

    def summary(self) -> str:
        """A few lines: step time, bubble, and per group idle time and peak activations."""
        lines = [f"step time {self.step_time:g}, bubble {self.bubble_fraction:.1%}"]
        for g in sorted(self.idle):
            lines.append(
                f"  {group_str(g):<10} idle {self.idle[g]:g}, "
                f"peak activations {self.peak_activations[g]}"
            )
        return "\n".join(lines)


def resolve_costs(costs: Mapping[str, float]) -> dict[str, float]:
    """The cost of each pass and op; B, BI and BW filled in from one another.

    B defaults to BI + BW when both are given; a missing BI or BW is B minus the other
    when that is given, else B / 2. Ops without a cost take 0. F (and B or BI + BW)
    are only required when the plans run them.
    """
    for key, value in costs.items():
        if key not in PASS_KEYS + OP_KEYS:
            raise CostError(
                f"unknown cost key {key!r}; use the passes {', '.join(PASS_KEYS)} "
                f"or the ops {', '.join(OP_KEYS)}"
            )
        if (
            isinstance(value, bool)
            or not isinstance(value, int | float)
            or not math.isfinite(value)
            or value < 0
        ):
            raise CostError(f"cost of {key!r} must be a finite number >= 0, got {value!r}")
    out = {k: float(v) for k, v in costs.items()}
    if "B" not in out and "BI" in out and "BW" in out:
        out["B"] = out["BI"] + out["BW"]
    if "B" in out:
        for part, other in (("BI", "BW"), ("BW", "BI")):
            if part not in out:
                out[part] = out["B"] - out[other] if other in costs else out["B"] / 2
                if out[part] < 0:
                    raise CostError(
                        f"cost of {other!r} ({out[other]:g}) exceeds that of 'B' "
                        f"({out['B']:g}); give {part!r} too"
                    )
    for key in OP_KEYS:
        out.setdefault(key, 0.0)
    return out


def _kind(ins: Instruction) -> str:
    return ins.pass_ if ins.op == RUN else ins.op


def _cost(costs: dict[str, float], ins: Instruction) -> float:
    key = _kind(ins)
    if key not in costs:
        given = ", ".join(sorted(k for k in costs if k in PASS_KEYS)) or "none"
        raise CostError(
            f"the plans run {ins} but costs has no {key!r} (passes given: {given}); "
            f"add {key!r} to the cost table"
        )
    return costs[key]


def simulate(
    dag: TrainingDAG,
    plans: Plans,
    costs: Mapping[str, float],
    transfer_latency: float = 0.0,
) -> Simulation:
    """Replay `plans` with a cost per instruction (see Note [simulated semantics]).

    Args:
      dag: the training DAG the plans were compiled from (its edges are the waits).
      plans: the compiled plans; `plans.nodes[g][i]` is the DAG uid of instruction i.
      costs: time per pass {"F", "B", "BI", "BW"} and, optionally, per op {"UPD",
        "SEND", "RECV", "ALL_REDUCE", ...}; ops default to 0.
      transfer_latency: added between the end of a SEND and the start of its RECV.

    Returns:
      A Simulation: step time, bubble fraction, idle time and peak activations per
      group, and the timeline.

    Raises:
      CostError: an unknown cost key, a bad value, or no cost for a pass the plans run.
      PlanError: the plans deadlock.
    """
    table = resolve_costs(costs)
    if transfer_latency < 0 or not math.isfinite(transfer_latency):
        raise CostError(f"transfer_latency must be a finite number >= 0, got {transfer_latency}")
    groups = sorted(plans.plans)
    members: dict[int, list[Group]] = {}
    for g in groups:
        for u in plans.nodes[g]:
            if u is not None:
                members.setdefault(u, []).append(g)
    preds = dag.adjacency()[0]
    pc = {g: 0 for g in groups}
    free_at = {g: 0.0 for g in groups}
    finish: dict[int, float] = {}
    starts: dict[Group, list[float | None]] = {g: [None] * len(plans.plans[g]) for g in groups}
    ends: dict[Group, list[float | None]] = {g: [None] * len(plans.plans[g]) for g in groups}

    def ready_at(g: Group) -> float | None:
        """Start time of g's next instruction, or None while it must wait."""
        u = plans.nodes[g][pc[g]]
        if any(p not in finish for p in preds[u]):
            return None
        for m in members[u]:
            if pc[m] >= len(plans.nodes[m]) or plans.nodes[m][pc[m]] != u:
                return None
        start = max(free_at[m] for m in members[u])
        is_recv = plans.plans[g][pc[g]].op == RECV
        for p in preds[u]:
            latency = transfer_latency if is_recv and dag.nodes[p].kind is NodeKind.SEND else 0.0
            start = max(start, finish[p] + latency)
        unit = _overlap_unit(dag, plans, g, pc[g])
        for v in unit[1:]:  # an overlap unit starts once every member has its inputs
            for p in preds[v]:
                if p in unit:
                    continue
                if p not in finish:
                    return None
                start = max(start, finish[p])
        return start

    remaining = sum(len(p) for p in plans.plans.values())
    while remaining:
        progressed = False
        for g in groups:
            while pc[g] < len(plans.plans[g]):
                ins = plans.plans[g][pc[g]]
                if ins.op == FREE:
                    starts[g][pc[g]] = ends[g][pc[g]] = free_at[g]
                    pc[g] += 1
                    remaining -= 1
                    continue
                start = ready_at(g)
                if start is None:
                    break
                u = plans.nodes[g][pc[g]]
                end = start + _cost(table, ins)
                for m in members[u]:
                    starts[m][pc[m]], ends[m][pc[m]] = start, end
                    free_at[m] = end
                    pc[m] += 1
                    remaining -= 1
                finish[u] = end
                progressed = True
        if remaining and not progressed:
            raise PlanError(_deadlock_report(dag, plans, pc, starts, members, finish))

    timeline = [
        TimelineEvent(g, str(ins), _kind(ins), ins.microbatch, starts[g][i], ends[g][i])
        for g in groups
        for i, ins in enumerate(plans.plans[g])
        if ins.op != FREE
    ]
    timeline.sort(key=lambda e: (e.start, e.group, e.end))
    step_time = max((e.end for e in timeline), default=0.0)
    idle = {g: step_time for g in groups}
    for e in timeline:
        if e.kind in COMPUTE_KINDS:
            idle[e.group] -= e.end - e.start
    bubble = sum(idle.values()) / (len(groups) * step_time) if step_time > 0 else 0.0
    peaks = _peak_activations(plans, starts, ends)
    return Simulation(step_time, bubble, idle, peaks, timeline)


def _overlap_unit(dag: TrainingDAG, plans: Plans, g: Group, i: int) -> list[int]:
    """The uids of the overlap unit starting at instruction i of g ([] if none starts there)."""
    u = plans.nodes[g][i]
    overlap = dag.nodes[u].overlap
    if overlap is None or (i > 0 and _overlap_at(dag, plans, g, i - 1) == overlap):
        return []
    unit = []
    for v in plans.nodes[g][i:]:
        if v is None:
            continue
        if dag.nodes[v].overlap != overlap:
            break
        unit.append(v)
    return unit


def _overlap_at(dag: TrainingDAG, plans: Plans, g: Group, i: int) -> int | None:
    u = plans.nodes[g][i]
    return None if u is None else dag.nodes[u].overlap


def _peak_activations(
    plans: Plans,
    starts: dict[Group, list[float | None]],
    ends: dict[Group, list[float | None]],
) -> dict[Group, int]:
    """Per group, the most forward activations alive at once (F start to last backward end)."""
    peaks = {}
    for g, plan in plans.plans.items():
        born: dict[tuple[int | None, int | None], float] = {}
        dies: dict[tuple[int | None, int | None], float] = {}
        for i, ins in enumerate(plan):
            if ins.op != RUN:
                continue
            key = (ins.region, ins.microbatch)
            if ins.pass_ == "F":
                born[key] = starts[g][i]
                dies.setdefault(key, ends[g][i])
            else:
                dies[key] = max(dies.get(key, ends[g][i]), ends[g][i])
        # at equal times a release comes before an allocation (-1 sorts before +1)
        changes = sorted([(t, 1) for t in born.values()] + [(dies[k], -1) for k in born])
        alive = peak = 0
        for _, delta in changes:
            alive += delta
            peak = max(peak, alive)
        peaks[g] = peak
    return peaks


def _deadlock_report(
    dag: TrainingDAG,
    plans: Plans,
    pc: dict[Group, int],
    starts: dict[Group, list[float | None]],
    members: dict[int, list[Group]],
    finish: dict[int, float],
) -> str:
    """Which instruction each unfinished group is stuck at, what it waits for, the grid."""
    stuck = [g for g in sorted(plans.plans) if pc[g] < len(plans.plans[g])]
    name = {
        u: str(ins)
        for g in plans.plans
        for ins, u in zip(plans.plans[g], plans.nodes[g])
        if u is not None
    }
    reasons = []
    for g in stuck:
        u = plans.nodes[g][pc[g]]
        waits = [
            f"{name[p]} on {group_str(dag.nodes[p].devices)}"
            if p in name
            else f"{dag.nodes[p]} (#{p}, in no plan)"
            for p in dag.preds(u)
            if p not in finish
        ]
        absent = [
            group_str(m)
            for m in members[u]
            if pc[m] >= len(plans.nodes[m]) or plans.nodes[m][pc[m]] != u
        ]
        why = []
        if waits:
            why.append("waits for " + ", ".join(waits))
        if absent:
            why.append("waits for member groups " + ", ".join(absent) + " to reach it")
        reasons.append(f"  {group_str(g)}: {plans.plans[g][pc[g]]} {'; '.join(why)}")
    # grid rows: distinct start times of what ran, then one row per unreached instruction
    times = sorted({t for row in starts.values() for t in row if t is not None})
    row_of = {t: r for r, t in enumerate(times)}
    rounds: dict[Group, list[int]] = {}
    for g, plan in plans.plans.items():
        rows, last = [], -1
        for i, ins in enumerate(plan):
            t = starts[g][i]
            if ins.op == FREE:  # not drawn in the grid
                rows.append(max(last, 0))
                continue
            last = max(row_of[t], last + 1) if t is not None else max(len(times), last + 1)
            rows.append(last)
        rounds[g] = rows
    return (
        "plan deadlock in simulation: no device group can run its next instruction.\n"
        + "\n".join(reasons)
        + "\nEach waits for data or a collective that never comes; check the order "
        "directives against the data flow.\n"
        + format_grid(plans.plans, rounds, mark={g: pc[g] for g in stuck})
    )
