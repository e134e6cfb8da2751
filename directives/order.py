"""order: temporal edges between consecutive groups of filters on one device group.

Nodes of one group run after every node of the group before it. A group of several
filters is an overlap group (DualPipe's F&B pairs): its nodes share an overlap id and the
plan compiler runs them as one unit, one XLA program in which XLA may interleave them.
Nodes that one filter matches together (the pieces of a stage cut by a nested region)
keep their data order inside the group.
"""

from __future__ import annotations

import dataclasses

from piper_jax.directives.filters import filter_str, select
from piper_jax.directives.types import Order
from piper_jax.ir.dag import EdgeKind, TrainingDAG
from piper_jax.ir.errors import DirectiveError


def apply_order(dag: TrainingDAG, directive: Order, index: int) -> TrainingDAG:
    where = f"directive {index} (order)"
    dag = dag.copy()
    compute = list(dag.compute_nodes())
    groups = []
    overlapping = []
    for g, filters in enumerate(directive.filters):
        per_filter = [select(compute, f) for f in filters]
        nodes = {n.uid: n for matched in per_filter for n in matched}
        if not nodes:
            names = ", ".join(filter_str(f) for f in filters)
            raise DirectiveError(f"{where}: group {g} [{names}] matches no node")
        groups.append(nodes)
        overlapping.append(sum(1 for matched in per_filter if matched) > 1)
    placed = {n.devices: n for grp in groups for n in grp.values()}
    if len(placed) > 1:
        (a, na), (b, nb) = list(placed.items())[:2]
        raise DirectiveError(
            f"{where} orders {na} on {list(a)} with {nb} on {list(b)}: an order runs on one "
            "device group; write one order directive per device group"
        )
    next_overlap = 1 + max((n.overlap or 0 for n in dag.nodes.values()), default=0)
    for g, (nodes, overlap) in enumerate(zip(groups, overlapping)):
        if not overlap:
            continue
        _check_no_detour(dag, nodes, f"{where}: group {g}")
        for n in nodes.values():
            if dag.nodes[n.uid].overlap is not None:
                raise DirectiveError(f"{where}: {n} is in two overlap groups")
            dag.replace(dataclasses.replace(dag.nodes[n.uid], overlap=next_overlap))
        next_overlap += 1
    for before, after in zip(groups, groups[1:]):
        for a in before:
            for b in after:
                if a != b:
                    dag.connect(a, b, EdgeKind.TEMPORAL)
    dag.check_acyclic(where)
    return dag


def _check_no_detour(dag: TrainingDAG, nodes: dict, where: str) -> None:
    """An overlap unit runs as one program once all its inputs exist, so no member may
    need another member's output by way of a node outside the unit (that node could only
    run after the unit started). Direct dependencies inside the unit are fine: the
    program runs its members in data order (a BI before its BW)."""
    for start in nodes:
        seen: set[int] = set()
        stack = [s for s in dag.succs(start) if s not in nodes]
        while stack:
            uid = stack.pop()
            if uid in seen:
                continue
            seen.add(uid)
            for nxt in dag.succs(uid):
                if nxt in nodes:
                    raise DirectiveError(
                        f"{where} puts {dag.nodes[start]} and {dag.nodes[nxt]} in one overlap "
                        f"group, but {dag.nodes[nxt]} needs {dag.nodes[start]}'s output by way "
                        f"of {dag.nodes[uid]}, which runs outside the group: passes that "
                        "overlap must be independent; put them in consecutive groups"
                    )
                stack.append(nxt)
