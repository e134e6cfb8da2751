"""Which cross-process transfers of a step the executor runs as one program.

Note [transfers that meet together] in transport.py says why: each cross-process
transfer is a meeting of the processes holding its devices, and two meetings of the same
processes back to back cost more than one. This module picks them from the plans' one
global issue order, so every process picks the same.
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


def exchange_sets(
    order: Sequence[Event],
    steps: Mapping[Group, Sequence[Step]],
    processes: Mapping[Group, frozenset[Hashable]],
) -> list[list[int]]:
    """Runs of two or more cross-process SENDs in `order` (their positions) that can be
    one program: they move data between the same set of processes, and every step
    between them either involves none of those processes or only moves host references
    (a FREE, a RECV taking an arrived value) of buffers none of the later SENDs sends.
    Running such a run at its first SEND changes nothing any process observes but the
    number of programs. `processes[g]`: the processes holding devices of group g (any
    hashable ids)."""
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
            if run is not None and run.processes == involved and sent not in run.touched:
                run.positions.append(position)
                continue
            close()
            run = _Run(involved, [position], set())
            continue
        if run is None or involved.isdisjoint(run.processes):
            continue
        if len(members) == 1 and all(i.op in (FREE, RECV) for i in step.instructions):
            run.touched.update((members[0], i.value) for i in step.instructions)
            continue
        close()
        run = None
    close()
    return runs
