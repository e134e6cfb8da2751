"""order: temporal edges between consecutive groups of filters on one device group.

Nodes matched by one group may interleave: they get no edges among themselves and share
an overlap id, so the plan compiler runs them as one unit (DualPipe's F&B pairs).
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
    for g, filters in enumerate(directive.filters):
        nodes = {n.uid: n for f in filters for n in select(compute, f)}
        if not nodes:
            names = ", ".join(filter_str(f) for f in filters)
            raise DirectiveError(f"{where}: group {g} [{names}] matches no node")
        groups.append(nodes)
    placed = {n.devices: n for grp in groups for n in grp.values()}
    if len(placed) > 1:
        (a, na), (b, nb) = list(placed.items())[:2]
        raise DirectiveError(
            f"{where} orders {na} on {list(a)} with {nb} on {list(b)}: an order runs on one "
            "device group; write one order directive per device group"
        )
    succs = dag.adjacency()[1] if any(len(nodes) > 1 for nodes in groups) else {}
    for g, nodes in enumerate(groups):
        if len(nodes) > 1:
            _check_independent(dag, succs, nodes, f"{where}: group {g}")
    next_overlap = 1 + max((n.overlap or 0 for n in dag.nodes.values()), default=0)
    for nodes in groups:
        if len(nodes) > 1:
            for n in nodes.values():
                if n.overlap is not None:
                    raise DirectiveError(f"{where}: {n} is in two overlap groups")
                dag.replace(dataclasses.replace(n, overlap=next_overlap))
            next_overlap += 1
    for before, after in zip(groups, groups[1:]):
        for a in before:
            for b in after:
                if a != b:
                    dag.connect(a, b, EdgeKind.TEMPORAL)
    dag.check_acyclic(where)
    return dag


def _check_independent(
    dag: TrainingDAG, succs: dict[int, list[int]], nodes: dict, where: str
) -> None:
    """Nodes of one overlap group run as one program, so none may need another's output
    (except a BW its own BI's, which the runtime runs as one backward)."""
    for start in nodes:
        seen, stack = set(), list(succs.get(start, []))
        while stack:
            uid = stack.pop()
            if uid in seen:
                continue
            seen.add(uid)
            if uid in nodes and not _split_pair(dag.nodes[start], dag.nodes[uid]):
                raise DirectiveError(
                    f"{where} puts {dag.nodes[start]} and {dag.nodes[uid]} in one overlap "
                    f"group, but {dag.nodes[uid]} needs {dag.nodes[start]}'s output: passes "
                    "that overlap must be independent; put them in consecutive groups"
                )
            stack.extend(succs.get(uid, []))


def _split_pair(a, b) -> bool:
    return (a.pass_, b.pass_) == ("BI", "BW") and (a.region, a.microbatch) == (
        b.region,
        b.microbatch,
    )
