"""Cost-model run of compiled plans: step time, bubble, peak activations, a timeline.

`simulate` replays the per-group plans (mpmd_runtime/replay.py, Note [replay
semantics]) with a cost per instruction instead of running programs. It answers "what
would this strategy cost" without devices, and its timeline draws the schedule (see
`timeline.write_timeline`). A fused step costs the sum of its instructions, which run
back to back inside it, unless the table costs it whole (below); FREE costs nothing.

A cost table names a pass or op for every region ("F", "B", "UPD", ...) or for one
region ("F0", "B3", "BI3", "UPD1"); a region's own cost takes precedence, so regions of
different sizes (an embedding stage, a head stage) can cost differently. A fused step
may be costed whole by the kinds of its pieces joined with "+" ("ALL_GATHER+F", "F+B"
for an overlap unit): `TrainStep.measure_costs` times such a step only whole, and one
program of several pieces need not cost the sum of their own costs.

Two keys cost the host rather than the devices (Note [the host issues the steps]):
"DISPATCH", the host's time to issue one step that launches work, and "STEP", its time
per training step outside the plans (staging the batch, sharing the loss).
"""

from __future__ import annotations

import dataclasses
import math
import re
from collections import defaultdict
from collections.abc import Callable, Mapping, Sequence

from piper_jax.ir.errors import PiperError
from piper_jax.ir.layout import group_str
from piper_jax.mpmd_runtime.exchanges import Event, exchange_sets
from piper_jax.mpmd_runtime.instructions import FREE, RECV, RUN, SEND, UPD, Instruction, Step
from piper_jax.mpmd_runtime.plans import Plans
from piper_jax.mpmd_runtime.replay import replay

Group = tuple[int, ...]

PASS_KEYS = ("F", "B", "BI", "BW")
OP_KEYS = ("UPD", "SEND", "RECV", "ALL_REDUCE", "REDUCE_SCATTER", "ALL_GATHER", "ALL_TO_ALL")
HOST_KEYS = ("DISPATCH", "STEP")
COMPUTE_KINDS = frozenset({*PASS_KEYS, UPD})
_REGION_KEY = re.compile(r"^(F|B|BI|BW|UPD)(\d+)$")


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
      step_time: the makespan (when the last instruction of any group ends) plus the
        host's own time per step ("STEP").
      bubble_fraction: mean over device groups of the time in [0, makespan] the group
        runs no compute (F, B, BI, BW, UPD), divided by the makespan. Communication
        does not count as busy: exposed communication is bubble.
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


def _fused(key: str) -> bool:
    parts = key.split("+")
    return len(parts) > 1 and all(p in PASS_KEYS + OP_KEYS for p in parts)


def resolve_costs(costs: Mapping[str, float]) -> dict[str, float]:
    """The cost of each pass and op; B, BI and BW filled in from one another.

    B defaults to BI + BW when both are given; a missing BI or BW is B minus the other
    when that is given, else B / 2. Ops and host keys without a cost take 0. F (and B
    or BI + BW) are only required when the plans run them. Per-region keys ("B3") are
    filled in the same way among themselves.
    """
    for key, value in costs.items():
        known = PASS_KEYS + OP_KEYS + HOST_KEYS
        if key not in known and not _REGION_KEY.match(key) and not _fused(key):
            raise CostError(
                f"unknown cost key {key!r}; use the passes {', '.join(PASS_KEYS)}, "
                f"the ops {', '.join(OP_KEYS)} or the host's {', '.join(HOST_KEYS)}, a "
                "pass or UPD with a region index (F0, B3, UPD1), or a fused step's kinds "
                "joined by '+' (F+B)"
            )
        if (
            isinstance(value, bool)
            or not isinstance(value, int | float)
            or not math.isfinite(value)
            or value < 0
        ):
            raise CostError(f"cost of {key!r} must be a finite number >= 0, got {value!r}")
    out = {k: float(v) for k, v in costs.items()}
    regions = {m.group(2) for m in map(_REGION_KEY.match, costs) if m}
    for suffix in ("", *sorted(regions, key=int)):
        _fill_backward(out, costs, suffix)
    for key in OP_KEYS + HOST_KEYS:
        out.setdefault(key, 0.0)
    return out


def _fill_backward(out: dict[str, float], given: Mapping[str, float], suffix: str) -> None:
    """B, BI and BW of one region (suffix "3") or of every region (suffix "")."""
    b, bi, bw = (f"{p}{suffix}" for p in ("B", "BI", "BW"))
    if b not in out and bi in out and bw in out:
        out[b] = out[bi] + out[bw]
    if b not in out:
        return
    for part, other in ((bi, bw), (bw, bi)):
        if part not in out:
            out[part] = out[b] - out[other] if other in given else out[b] / 2
            if out[part] < 0:
                raise CostError(
                    f"cost of {other!r} ({out[other]:g}) exceeds that of {b!r} "
                    f"({out[b]:g}); give {part!r} too"
                )


def _kind(ins: Instruction) -> str:
    return ins.pass_ if ins.op == RUN else ins.op


def fused_key(step: Step) -> str | None:
    """The cost key of a step of several pieces ("F+B"); None for a single piece."""
    kinds = [_kind(ins) for ins in step.instructions if ins.op != FREE]
    return "+".join(kinds) if len(kinds) > 1 else None


def _piece_costs(costs: dict[str, float], step: Step) -> list[tuple[Instruction, float]]:
    """Each piece of `step` with its cost. A fused step costed whole has its cost shared
    out in proportion to its pieces' own costs where the table has them all, else
    evenly."""
    pieces = [ins for ins in step.instructions if ins.op != FREE]
    key = fused_key(step)
    if key is None or key not in costs:
        return [(ins, _cost(costs, ins)) for ins in pieces]
    try:
        own = [_cost(costs, ins) for ins in pieces]
    except CostError:
        own = []
    total = sum(own)
    if total <= 0:
        own, total = [1.0] * len(pieces), float(len(pieces))
    return [(ins, costs[key] * c / total) for ins, c in zip(pieces, own)]


def _cost(costs: dict[str, float], ins: Instruction) -> float:
    key = _kind(ins)
    if ins.op in (RUN, UPD) and f"{key}{ins.region}" in costs:
        return costs[f"{key}{ins.region}"]
    if key not in costs:
        given = ", ".join(sorted(k for k in costs if k in PASS_KEYS)) or "none"
        raise CostError(
            f"the plans run {ins} but costs has no {key!r} (passes given: {given}); "
            f"add {key!r} (or {key}{ins.region}) to the cost table"
        )
    return costs[key]


def simulate(
    plans: Plans,
    costs: Mapping[str, float],
    transfer_latency: float = 0.0,
    processes: Mapping[int, int] | None = None,
    host_shares_core: bool = False,
) -> Simulation:
    """Replay `plans` with a cost per instruction (see Note [replay semantics]).

    Args:
      plans: the compiled plans.
      costs: time per pass {"F", "B", "BI", "BW"} and, optionally, per op {"UPD",
        "SEND", "RECV", "ALL_REDUCE", ...}; ops default to 0. A pass or UPD may also
        be given per region ("F0", "B3", "UPD1"), which takes precedence. "DISPATCH"
        and "STEP" cost the host (Note [the host issues the steps]).
      transfer_latency: added between the end of a SEND and the start of its RECV.
      processes: the process of each device (by index); transfers between processes
        then meet as the runtime runs them (Note [transfers between processes meet]).
        Default: every device in one process.
      host_shares_core: each process's host issues its steps on the cores its devices
        compute on (CPU devices), so issuing a step holds up the work already queued.

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

    # each step's pieces, costed once for the replay and the timeline; by identity, as
    # the plans hold every step throughout (hashing 10^5 steps cost more than costing)
    pieces_of: dict[int, list[tuple[Instruction, float]]] = {}

    def step_pieces(step: Step) -> list[tuple[Instruction, float]]:
        pieces = pieces_of.get(id(step))
        if pieces is None:
            pieces = pieces_of[id(step)] = _piece_costs(table, step)
        return pieces

    def step_cost(group: Group, step: Step) -> float:
        return sum(c for _, c in step_pieces(step))

    meeting = _meeting_transfers(plans, processes or {})
    hosts = None
    if table["DISPATCH"] > 0:
        hosts = _Hosts(plans, processes or {}, table["DISPATCH"], host_shares_core)
    if meeting or hosts:
        order, joined = plans.order, set()
        if meeting:
            order, joined = _exchanges_first(plans, processes or {})
        starts, spans = _walk_issue_order(
            plans, order, step_cost, transfer_latency, meeting, joined, hosts
        )
    else:
        starts, spans = replay(plans.steps, step_cost, transfer_latency).start, {}
    timeline = []
    for g, steps in plans.steps.items():
        for i, (step, t0) in enumerate(zip(steps, starts[g])):
            pieces = step_pieces(step)
            if (g, i) in spans:  # the receiving side of a meeting, drawn where it ran
                t0, cost = spans[(g, i)]
                pieces = [(step.head, cost)]
            for ins, cost in pieces:
                t1 = t0 + cost
                timeline.append(TimelineEvent(g, str(ins), _kind(ins), ins.microbatch, t0, t1))
                t0 = t1
    timeline.sort(key=lambda e: (e.start, e.group, e.end))
    groups = sorted(plans.steps)
    makespan = max((e.end for e in timeline), default=0.0)
    idle = {g: makespan for g in groups}
    for e in timeline:
        if e.kind in COMPUTE_KINDS:
            idle[e.group] -= e.end - e.start
    bubble = sum(idle.values()) / (len(groups) * makespan) if makespan > 0 else 0.0
    peaks = peak_activations(timeline, groups)
    return Simulation(makespan + table["STEP"], bubble, idle, peaks, timeline)


# Note [transfers between processes meet]
# In one process a transfer is a copy the sender's devices make (device_put): it never
# waits for the receiver. Between processes it is one program over the devices of both
# groups, which every process involved calls at the SEND's place in the one global issue
# order (Note [issue order] in replay.py; transport.py): it starts when both groups have
# run what was issued before it, holds both for the SEND's cost, and the receiving
# group's later steps (the RECV, which then only takes the value, among them) wait for
# it. Sending an activation to a stage still busy with an earlier backward therefore
# waits for that backward, which is what a 2-process 1F1B spends much of its step on
# and what a replay that lets a SEND run ahead of its receiver missed (2-process runs
# of benchmarks/sim_vs_real.py: 1F1B predicted 17-32% short).


def _meeting_transfers(plans: Plans, processes: Mapping[int, int]) -> set[tuple[Group, int]]:
    """The SEND steps (group, index) whose two groups' devices lie in several processes
    (a device not in `processes` is in process 0; none, without a walk over the plans,
    when every device is)."""
    meeting: set[tuple[Group, int]] = set()
    if not any(processes.values()):
        return meeting
    for g, steps in plans.steps.items():
        for i, step in enumerate(steps):
            head = step.head
            if head.op == SEND:
                devices = (*g, *head.peer)
                if len({processes.get(d, 0) for d in devices}) > 1:
                    meeting.add((g, i))
    return meeting


def _exchanges_first(
    plans: Plans, processes: Mapping[int, int]
) -> tuple[list[Event], set[tuple[Group, int]]]:
    """The global issue order with the later SENDs of each exchange moved up to its first,
    where the runtime runs them all as one program (exchanges.py), and those later SENDs
    (group, index): one program, issued once."""
    of_group = {g: frozenset(processes.get(d, 0) for d in g) for g in plans.steps}
    runs = exchange_sets(plans.order, plans.steps, of_group)
    moved = {run[0]: [plans.order[p] for p in run[1:]] for run in runs}
    later = {p for run in runs for p in run[1:]}
    order: list[Event] = []
    for p, event in enumerate(plans.order):
        if p not in later:
            order += [event, *moved.get(p, ())]
    joined = {(plans.order[p][0][0], plans.order[p][1][0]) for p in later}
    return order, joined


# Note [the host issues the steps]
# Each process's host issues its steps one by one in the global issue order, and XLA
# runs them asynchronously, so the host runs ahead of its devices: it issues a whole step
# of a one-device process in a burst at its start (measured: 69 steps of a 2-stage 1F1B
# in 1.6-3 ms, some 30-45 us each), stalling only where a call blocks. A step cannot
# start before its host has issued it ("DISPATCH" each; FREE and a RECV that takes a
# value from the mailbox cost nothing). A transfer between processes whose receiving
# devices have nothing queued when the receiver's host reaches it runs on that host's
# own thread (XLA:CPU runs a program whose inputs are ready at once), so that host waits
# for it to end. Where the host shares its devices' cores (`host_shares_core`, CPU
# devices), issuing a step while work is queued holds that work up by the same time; so
# a burst at the start of a step delays the first programs, which the costs timed one at
# a time cannot show (2-process runs of benchmarks/sim_vs_real.py: the real pipelines
# ran 1.6-3.5 ms behind the simulated ones from their first forwards on, the issue
# burst). "STEP" is the host's work outside the plans (staging the batch before them,
# sharing the loss after), added to the step time.


class _Hosts:
    """When each process's host has issued its steps so far (Note [the host issues the
    steps])."""

    def __init__(
        self, plans: Plans, processes: Mapping[int, int], dispatch: float, shares_core: bool
    ):
        self.dispatch, self.shares_core = dispatch, shares_core
        self.processes = {g: sorted({processes.get(d, 0) for d in g}) for g in plans.steps}
        self.groups: dict[int, list[Group]] = defaultdict(list)
        for g, ps in self.processes.items():
            for p in ps:
                self.groups[p].append(g)
        self.at: dict[int, float] = defaultdict(float)

    def issue(self, groups: Sequence[Group], free_at: dict[Group, float]) -> float:
        """Every process of `groups` issues one step: when the last has issued it."""
        issued = 0.0
        for p in sorted({p for g in groups for p in self.processes[g]}):
            if self.shares_core:
                for g in self.groups[p]:
                    if free_at[g] > self.at[p]:
                        free_at[g] += self.dispatch
            self.at[p] += self.dispatch
            issued = max(issued, self.at[p])
        return issued

    def wait(self, group: Group, until: float) -> None:
        """The processes of `group` block in a call until `until`."""
        for p in self.processes[group]:
            self.at[p] = max(self.at[p], until)


def _walk_issue_order(
    plans: Plans,
    order: Sequence[Event],
    step_cost: Callable[[Group, Step], float],
    transfer_latency: float,
    meeting: set[tuple[Group, int]],
    joined: set[tuple[Group, int]],
    hosts: _Hosts | None,
) -> tuple[dict[Group, list[float]], dict[tuple[Group, int], tuple[float, float]]]:
    """Start of every step, walking a valid issue order (every step after what it waits
    for), with the `meeting` transfers as Note [transfers between processes meet] says
    (those `joined` to an earlier one's exchange issued with it) and the hosts as Note
    [the host issues the steps] says; and the start and length of each meeting on its
    receiving group, by that group's RECV step."""
    free_at = {g: 0.0 for g in plans.steps}
    start: dict[Group, list[float]] = {g: [0.0] * len(s) for g, s in plans.steps.items()}
    arrives: dict[tuple[str, Group, Group], list[float]] = defaultdict(list)
    taken: dict[tuple[str, Group, Group], int] = defaultdict(int)
    met: dict[tuple[str, Group, Group], list[tuple[float, float]]] = defaultdict(list)
    spans: dict[tuple[Group, int], tuple[float, float]] = {}
    for members, index in order:
        g, i = members[0], index[0]
        step = plans.steps[g][i]
        head = step.head
        cost = step_cost(g, step)
        if (g, i) in meeting:
            receiver = tuple(head.peer)
            issued, on_host = 0.0, False
            if hosts:
                on_host = free_at[receiver] <= hosts.at[hosts.processes[receiver][0]]
                if (g, i) not in joined:
                    issued = hosts.issue((g, receiver), free_at)
            t0 = max(free_at[g], free_at[receiver], issued)
            if on_host:
                hosts.wait(receiver, t0 + cost)
            free_at[receiver] = t0 + cost
            arrives[(head.value, g, receiver)].append(t0 + cost)
            met[(head.value, g, receiver)].append((t0, cost))
        elif head.op == RECV:
            key = (head.value, tuple(head.peer), g)
            k = taken[key]
            taken[key] += 1
            if k < len(met[key]):  # met at its SEND: the value is here, nothing to pay
                spans[(g, i)] = met[key][k]
                t0, cost = max(free_at[g], arrives[key][k]), 0.0
            else:
                t0 = max(free_at[g], arrives[key][k])
        else:
            issued = hosts.issue(members, free_at) if hosts and head.op != FREE else 0.0
            t0 = max(issued, *(free_at[m] for m in members))
        for m, j in zip(members, index):
            start[m][j] = t0
            free_at[m] = t0 + cost
        if head.op == SEND and (g, i) not in meeting:
            arrives[(head.value, g, tuple(head.peer))].append(t0 + cost + transfer_latency)
    return start, spans


def peak_activations(
    timeline: list[TimelineEvent],
    groups: list[Group],
    sizes: Mapping[int, float] | None = None,
) -> dict[Group, float]:
    """Per group, the most forward activations alive at once (F start to last backward
    end): counted, or weighed by `sizes` (per region index, e.g. the bytes one F of it
    keeps for its backward)."""
    born: dict[Group, dict[tuple[int, int | None], float]] = {g: {} for g in groups}
    dies: dict[Group, dict[tuple[int, int | None], float]] = {g: {} for g in groups}
    for e in timeline:
        if e.kind not in PASS_KEYS:
            continue
        key = (int(e.label[len(e.kind) :].split(".")[0]), e.microbatch)
        if e.kind == "F":
            born[e.group][key] = e.start
            dies[e.group].setdefault(key, e.end)
        else:
            dies[e.group][key] = max(dies[e.group].get(key, e.end), e.end)
    peaks = {}
    for g in groups:
        # at equal times a release comes before an allocation (negative sorts first)
        changes = []
        for key, t in born[g].items():
            weight = 1 if sizes is None else sizes[key[0]]
            changes += [(t, 1, weight), (dies[g][key], -1, -weight)]
        alive = peak = 0
        for _, _, delta in sorted(changes):
            alive += delta
            peak = max(peak, alive)
        peaks[g] = peak
    return peaks
