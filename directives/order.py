"""order: temporal edges between consecutive groups of filters on one device group.

Nodes of one group run after every node of the group before it. A group of several
filters is an overlap group (DualPipe's F&B pairs): its nodes share an overlap id and the
plan compiler runs them as one unit, one XLA program in which XLA may interleave them.
Nodes that one filter matches together (the pieces of a stage cut by a nested region)
keep their data order inside the group.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Sequence

from piper_jax.directives.filters import NodeIndex, filter_str
from piper_jax.directives.types import Order
from piper_jax.ir.dag import EdgeKind, TrainingDAG
from piper_jax.ir.errors import DirectiveError


def apply_orders(dag: TrainingDAG, orders: Sequence[tuple[int, Order]]) -> TrainingDAG:
    """Every (directive index, order) in turn on one copy of `dag`; a cycle is refused
    naming the first order that closes it."""
    ordered = _with_orders(dag, orders, check=False)
    if ordered.find_cycle():  # name the order that closes it (only on this error path)
        dag.check_acyclic("the directives before the orders")
        _with_orders(dag, orders, check=True)
    return ordered


def _with_orders(dag: TrainingDAG, orders: Sequence[tuple[int, Order]], check: bool) -> TrainingDAG:
    """A copy of `dag` with the orders applied in turn; with `check`, refusing the first
    order after which it has a cycle."""
    dag = dag.copy()
    index = NodeIndex(dag.compute_nodes())
    overlap = 1 + max((n.overlap or 0 for n in dag.nodes.values()), default=0)
    for i, directive in orders:
        overlap = apply_order(dag, directive, i, index, overlap)
        if check:
            dag.check_acyclic(f"directive {i} (order)")
    return dag


def apply_order(
    dag: TrainingDAG, directive: Order, index: int, by_tags: NodeIndex, next_overlap: int
) -> int:
    """One order's temporal edges and overlap ids (from `next_overlap` on), added to `dag`
    in place; returns the next free overlap id."""
    where = f"directive {index} (order)"
    groups = []
    overlapping = []
    for g, filters in enumerate(directive.filters):
        per_filter = [by_tags.select(f) for f in filters]
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
    for nodes, overlap in zip(groups, overlapping):
        if not overlap:
            continue
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
    return next_overlap


def check_overlap_units(dag: TrainingDAG) -> None:
    """Refuse an overlap group one of whose passes needs another's output by way of a
    node outside the group. Called when the plans cannot be scheduled (a search per
    group costs time quadratic in the DAG, so it only runs to explain that failure)."""
    units: dict[int, dict[int, object]] = {}
    for uid, n in dag.nodes.items():
        if n.overlap is not None:
            units.setdefault(n.overlap, {})[uid] = n
    for members in units.values():
        names = ", ".join(str(n) for n in members.values())
        _check_no_detour(dag, members, f"order group [{names}]")


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
