"""Which cross-process transfers of a step the executor runs as one program.

Note [transfers that meet together] in transport.py says why: each cross-process
transfer is a meeting of the processes holding its devices, and two meetings of the same
processes back to back cost more than one. This module picks them from the plans' one
global issue order, so every process picks the same.

Note [meeting before local work]
A transfer is a program that occupies the devices of every process taking part until
all of them have joined (XLA:CPU runs it on the device's thread; a GPU stream waits for
the peer the same way). In a 2-stage ZB-H1, stage 1 sends the input gradient of
microbatch k, runs the weight gradient of k - 1, and only then takes part in the next
activation's transfer, which stage 0 had issued right after the first: stage 0's device
sat in that second meeting, idle, for the whole weight-gradient pass (an 11 ms transfer
per microbatch in a traced 2-process step at width 2048, m = 8: 204 ms against 1F1B's
143 ms). A later SEND may therefore join a run across work of one process, as long as
that process sends none of the later SENDs: the work only moves after the meeting, and
the receiver gets its values earlier. The SEND's own process must not have worked in
between (its value and its arrival at the meeting stay as they were), and a meeting of
other processes in between still ends the run. With it, the same traced step took
152 ms, every steady-state pair of ZB-H1's transfers meeting as one.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Hashable, Mapping, Sequence

from piper_jax.mpmd_runtime.instructions import FREE, RECV, SEND, Step

Group = tuple[int, ...]
Event = tuple[tuple[Group, ...], tuple[int, ...]]  # as replay.py gives the issue order


@dataclasses.dataclass
class _Run:
    processes: frozenset[int]
    positions: list[int]
    touched: set[tuple[Group, str]]  # buffers host steps in between wrote or dropped
    busy: set[Hashable]  # processes that computed in between: they send nothing later


def exchange_sets(
    order: Sequence[Event],
    steps: Mapping[Group, Sequence[Step]],
    processes: Mapping[Group, frozenset[Hashable]],
) -> list[list[int]]:
    """Runs of two or more cross-process SENDs in `order` (their positions) that can be
    one program: they move data between the same set of processes, and every step
    between them involves none of those processes, only moves host references (a FREE, a
    RECV taking an arrived value) of buffers none of the later SENDs sends, or is work of
    one process that sends none of the later SENDs (Note [meeting before local work]).
    Running such a run at its first SEND changes nothing any process computes, only when
    a receiver gets its values. `processes[g]`: the processes holding devices of group g
    (any hashable ids)."""
    runs: list[list[int]] = []
    run: _Run | None = None

    def close() -> None:
        if run is not None and len(run.positions) > 1:
            runs.append(run.positions)

    for position, (members, index) in enumerate(order):
        step = steps[members[0]][index[0]]
        head = step.head
        if run is None and head.op != SEND:
            continue
        if len(members) == 1:
            involved = processes[members[0]]
        else:
            involved = frozenset().union(*(processes[g] for g in members))
        if head.op in (SEND, RECV):
            involved = involved | processes[tuple(head.peer)]
        if head.op == SEND and len(step.instructions) == 1 and len(involved) > 1:
            sent = (members[0], head.value)
            if (
                run is not None
                and run.processes == involved
                and sent not in run.touched
                and run.busy.isdisjoint(processes[members[0]])
            ):
                run.positions.append(position)
                continue
            close()
            run = _Run(involved, [position], set(), set())
            continue
        if run is None or involved.isdisjoint(run.processes):
            continue
        if len(members) == 1 and all(i.op in (FREE, RECV) for i in step.instructions):
            run.touched.update((members[0], i.value) for i in step.instructions)
            continue
        if len(members) == 1 and len(involved) == 1 and head.op not in (SEND, RECV):
            run.busy |= involved  # its later SENDs may not move ahead of this work
            continue
        close()
        run = None
    close()
    return runs
