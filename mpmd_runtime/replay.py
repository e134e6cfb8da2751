"""The one replay of a set of plans: when each step of each group can start and end.

The dry run (does the plan finish? in which global order do processes issue its steps?),
the simulator (step time, bubble, memory) and the deadlock report are all this replay
with different step costs, so the proof that plans complete and the report of what they
cost always describe the same plans.

Note [replay semantics]
Each device group runs its steps strictly in order. A step starts when its group is
free, and:
  * a RECV X <- g also waits for the matching SEND X (the k-th RECV of X from g to this
    group matches the k-th such SEND), plus `transfer_latency`;
  * a collective over several groups (an ALL_REDUCE whose devices span other groups)
    starts once every member group has reached it, and occupies all of them;
  * a SEND never waits for its receiver.
If no group can start its next step while some remain, the plans deadlock.

Note [issue order]
Every process issues its steps in one global order, and each cross-process transfer at
its SEND's place in it, so that all processes call their transfers in the same relative
order. The replay resolves steps group by group, each group running on until it blocks;
that order is valid but runs far ahead of time: in a 2-stage 1F1B it puts stage 1's SEND
of its second backward before stage 0's first backward. Stage 0's process then blocks in
that transfer (XLA:CPU runs a transfer whose inputs are ready, a receiver's placeholders,
on the calling thread, until the peer joins) with its own backward not yet dispatched,
and the two stages take turns instead of overlapping. So the order is the steps sorted
by their replayed start time (ties in resolution order): still valid, since a RECV
starts after its SEND ends, a collective after each member's previous step, and a
group's steps in sequence, and each process now reaches a transfer about when its data
is due.
Among steps that start at the same replayed time, the SENDs come last: the receiving
process then issues the work it can already run before it blocks in the transfer.
Before, stage 1 of a 2-stage pipeline received the second activation before it issued
its first forward, which waited for that transfer (2-process runs of
benchmarks/sim_vs_real.py at width 2048, two each way: steps of 144.9-148.6 ms against
147.2-149.0 for GPipe, 135.4-139.6 against 140.1-141.8 for 1F1B, 143.8-157.1 against
155.0-163.7 for ZB-H1 and 285.9-296.0 against 347.3-352.6 for DualPipeV). Only SENDs
that met no other as one exchange were deferred at first, as deferring a SEND then could
part an exchange; since an exchange may span a receiver's own work (Note [meeting before
local work] in exchanges.py) deferring every SEND parts none in the schedule builders'
plans, while deferring the lone ones, chosen on the order before deferring, made and
parted other exchanges (the choice, made again on its own result, flipped between two
sets for interleaved 1F1B).
"""

from __future__ import annotations

import dataclasses
import functools
from collections import defaultdict
from collections.abc import Callable, Mapping, Sequence

from piper_jax.ir.errors import PlanError
from piper_jax.ir.layout import group_str
from piper_jax.mpmd_runtime.exchanges import Event
from piper_jax.mpmd_runtime.instructions import ALL_REDUCE, FREE, RECV, SEND, Step

Group = tuple[int, ...]


@dataclasses.dataclass(frozen=True)
class Replay:
    """Start and end of every step, and the order in which the replay resolved them (a
    valid global issue order: every step comes after everything it waits for)."""

    start: dict[Group, list[float]]
    end: dict[Group, list[float]]
    order: list[Event]


def members_of(step: Step, group: Group, groups: Sequence[Group]) -> list[Group]:
    """The groups that run `step` together: several for a cross-group collective."""
    head = step.head
    if head.op == ALL_REDUCE and tuple(head.peer) != group:
        return groups_within(tuple(head.peer), tuple(groups))
    return [group]


@functools.lru_cache(maxsize=4096)
def groups_within(devices: tuple[int, ...], groups: tuple[Group, ...]) -> list[Group]:
    """The groups (disjoint) whose devices a collective over `devices` spans."""
    inside = set(devices)
    return [g for g in groups if g[0] in inside]


def replay(
    steps: Mapping[Group, Sequence[Step]],
    cost: Callable[[Group, Step], float],
    transfer_latency: float = 0.0,
) -> Replay:
    """Replay `steps` with `cost` per step (see Note [replay semantics]).

    Raises:
      PlanError: the plans deadlock; the message names what each stuck group waits for
        and shows the grid with the stuck steps marked.
    """
    groups = sorted(steps)
    pc = {g: 0 for g in groups}
    free_at = {g: 0.0 for g in groups}
    start: dict[Group, list[float]] = {g: [] for g in groups}
    end: dict[Group, list[float]] = {g: [] for g in groups}
    sent: dict[tuple[str, Group, Group], list[float]] = defaultdict(list)
    received: dict[tuple[str, Group, Group], int] = defaultdict(int)
    order: list[Event] = []
    remaining = sum(len(s) for s in steps.values())
    while remaining:
        progressed = False
        for g in groups:
            # the group's own steps run on until one blocks; its position and clock live
            # in locals meanwhile (a plan at scale replays 10^5 steps)
            plan, i, now = steps[g], pc[g], free_at[g]
            g_start, g_end, one = start[g], end[g], (g,)
            while i < len(plan):
                step = plan[i]
                head = step.instructions[0]
                op = head.op
                if op == ALL_REDUCE:
                    members = members_of(step, g, groups)
                    if len(members) > 1:
                        pc[g], free_at[g] = i, now
                        if any(pc[m] >= len(steps[m]) or steps[m][pc[m]] != step for m in members):
                            break
                        t0 = max(free_at[m] for m in members)
                        t1 = t0 + cost(g, step)
                        for m in members:
                            start[m].append(t0)
                            end[m].append(t1)
                            free_at[m] = t1
                        order.append((tuple(members), tuple(pc[m] for m in members)))
                        for m in members:
                            pc[m] += 1
                        remaining -= len(members)
                        i, now, progressed = pc[g], t1, True
                        continue
                if op == RECV:
                    key = (head.value, tuple(head.peer), g)
                    k = received[key]
                    times = sent[key]
                    if len(times) <= k:
                        break
                    t0 = max(now, times[k] + transfer_latency)
                    received[key] = k + 1
                else:
                    t0 = now
                now = t0 + cost(g, step)
                g_start.append(t0)
                g_end.append(now)
                order.append((one, (i,)))
                i += 1
                remaining -= 1
                if op == SEND:
                    sent[(head.value, g, tuple(head.peer))].append(now)
                progressed = True
            pc[g], free_at[g] = i, now
        if remaining and not progressed:
            raise PlanError(_deadlock_report(steps, pc, start, sent, received))
    return Replay(start, end, order)


def unit_cost(group: Group, step: Step) -> float:
    return 0.0 if step.head.op == FREE else 1.0


def dry_run(steps: Mapping[Group, Sequence[Step]]) -> tuple[list[Event], dict[Group, list[int]]]:
    """Replay with one time unit per step: the global issue order (its steps by start
    time, Note [issue order]) and the grid rounds."""
    result = replay(steps, unit_cost)
    rounds = {g: [int(t) for t in result.start[g]] for g in steps}
    starts = [result.start[members[0]][index[0]] for members, index in result.order]
    sends = [steps[m[0]][i[0]].head.op == SEND for m, i in result.order]
    order = sorted(range(len(starts)), key=lambda k: (starts[k], sends[k]))
    return [result.order[k] for k in order], rounds


def _deadlock_report(
    steps: Mapping[Group, Sequence[Step]],
    pc: dict[Group, int],
    start: dict[Group, list[float]],
    sent: dict[tuple[str, Group, Group], list[float]],
    received: dict[tuple[str, Group, Group], int],
) -> str:
    groups = sorted(steps)
    stuck = [g for g in groups if pc[g] < len(steps[g])]
    reasons = []
    for g in stuck:
        step = steps[g][pc[g]]
        head = step.head
        members = members_of(step, g, groups)
        if head.op == RECV:
            src = tuple(head.peer)
            why = f"waits for SEND {head.value} -> {group_str(g)} on {group_str(src)}"
            if pc[src] < len(steps[src]):
                why += f", which is stuck at {steps[src][pc[src]]}"
        else:
            absent = [
                group_str(m) for m in members if pc[m] >= len(steps[m]) or steps[m][pc[m]] != step
            ]
            why = "waits for member groups " + ", ".join(absent) + " to reach it"
        reasons.append(f"  {group_str(g)}: {step} {why}")
    rounds: dict[Group, list[int]] = {}
    for g in groups:
        done = [int(t) for t in start[g]]
        nxt = max([r + 1 for r in done] + [0])
        rounds[g] = done + list(range(nxt, nxt + len(steps[g]) - len(done)))
    return (
        "plan deadlock: no device group can run its next step.\n"
        + "\n".join(reasons)
        + "\nEach waits for data or a collective that never comes; check the order "
        "directives against the data flow.\n"
        + format_grid(steps, rounds, mark={g: pc[g] for g in stuck})
    )


def format_grid(
    steps: Mapping[Group, Sequence[Step]],
    rounds: Mapping[Group, Sequence[int]],
    mark: Mapping[Group, int] | None = None,
) -> str:
    """Rows are rounds, columns are device groups; FREE steps are left out; `mark`ed
    steps (a deadlock's stuck ones) are drawn with '>> '."""
    groups = sorted(steps)
    cells: dict[tuple[int, Group], str] = {}
    for g in groups:
        for i, (step, r) in enumerate(zip(steps[g], rounds[g])):
            if step.head.op == FREE:
                continue
            text = str(step)
            if mark and mark.get(g) == i:
                text = ">> " + text
            cells[(r, g)] = text
    nrows = 1 + max((r for (r, _) in cells), default=-1)
    width = max([len(c) for c in cells.values()] + [len(group_str(g)) for g in groups] + [4])
    lines = ["step  " + " | ".join(group_str(g).ljust(width) for g in groups)]
    for r in range(nrows):
        row = [cells.get((r, g), "").ljust(width) for g in groups]
        if any(cell.strip() for cell in row):
            lines.append(f"{r:<5} " + " | ".join(row).rstrip())
    return "\n".join(lines)
