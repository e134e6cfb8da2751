"""Plan compiler: the training DAG -> one ordered instruction list per device group.

The passes, in the order they run (see `compile_plans`):
  schedule_nodes  lockstep list scheduling of DAG nodes per device group; every edge,
                  data or temporal, is honoured; when several nodes are ready the order
                  is SEND > collective > compute > RECV, then DAG uid
  to_instructions one instruction per node and group
  insert_frees    FREE after the last reader of each buffer on each group
  dry_run         replay all plans in lockstep: proves they complete, and fixes the one
                  global order in which every process issues its instructions
"""

from __future__ import annotations

import dataclasses
import hashlib
from collections import defaultdict
from collections.abc import Iterable

from piper_jax.ir.dag import EdgeKind, Node, NodeKind, TrainingDAG, group_str
from piper_jax.ir.errors import PlanError
from piper_jax.mpmd_runtime.instructions import (
    ALL_REDUCE,
    BATCH,
    FREE,
    RECV,
    RUN,
    SEND,
    UPD,
    Instruction,
    parse,
)

Group = tuple[int, ...]
_PRIORITY = {NodeKind.SEND: 0, NodeKind.ALL_REDUCE: 1, NodeKind.RECV: 3}


@dataclasses.dataclass(frozen=True)
class Plans:
    """The per-group plans, the DAG node of each instruction and the global order.

    Attributes:
      plans: instructions per device group, in execution order.
      nodes: the DAG uid of each instruction (None for FREE).
      order: every instruction once, as (groups, index) events in the order a single
        controller issues them; a collective is one event for all its member groups.
      rounds: the lockstep round of each instruction (unit time per instruction).
    """

    plans: dict[Group, list[Instruction]]
    nodes: dict[Group, list[int | None]]
    order: list[tuple[tuple[Group, ...], tuple[int, ...]]]
    rounds: dict[Group, list[int]]

    def fingerprint(self) -> str:
        """A digest of every plan; processes compare it to prove they run the same plans."""
        text = "\n".join(
            f"{group_str(g)}: " + "; ".join(str(i) for i in plan)
            for g, plan in sorted(self.plans.items())
        )
        return hashlib.sha256(text.encode()).hexdigest()

    def grid(self) -> str:
        """Text grid: rows are lockstep rounds, columns are device groups."""
        return format_grid(self.plans, self.rounds)


def format_grid(
    plans: dict[Group, list[Instruction]],
    rounds: dict[Group, list[int]],
    mark: dict[Group, int] | None = None,
) -> str:
    groups = sorted(plans)
    cells: dict[tuple[int, Group], str] = {}
    for g in groups:
        for i, (ins, r) in enumerate(zip(plans[g], rounds[g])):
            if ins.op == FREE:
                continue
            text = str(ins)
            if mark and mark.get(g) == i:
                text = ">> " + text
            cells[(r, g)] = text
    mark_rows = {rounds[g][i] for g, i in (mark or {}).items() if i < len(rounds[g])}
    nrows = 1 + max((r for (r, _) in cells), default=-1)
    width = max([len(c) for c in cells.values()] + [len(group_str(g)) for g in groups] + [4])
    lines = ["step  " + " | ".join(group_str(g).ljust(width) for g in groups)]
    for r in range(nrows):
        row = [cells.get((r, g), "").ljust(width) for g in groups]
        if any(row_cell.strip() for row_cell in row) or r in mark_rows:
            lines.append(f"{r:<5} " + " | ".join(row))
    return "\n".join(lines)


def compute_groups(dag: TrainingDAG) -> list[Group]:
    return sorted({n.devices for n in dag.compute_nodes()})


def member_groups(node: Node, groups: Iterable[Group]) -> list[Group]:
    if node.kind is NodeKind.ALL_REDUCE:
        return [g for g in groups if set(g) <= set(node.devices)]
    return [node.devices]


def compile_plans(dag: TrainingDAG, batch_regions: set[int]) -> Plans:
    groups = compute_groups(dag)
    order = {g: sink_receives(dag, uids) for g, uids in schedule_nodes(dag, groups).items()}
    plans = {g: [to_instruction(dag, dag.nodes[u]) for u in order[g]] for g in groups}
    nodes: dict[Group, list[int | None]] = {g: list(order[g]) for g in groups}
    plans, nodes = insert_frees(dag, plans, nodes, batch_regions)
    events, rounds = dry_run(dag, plans, nodes)
    return Plans(plans, nodes, events, rounds)


def schedule_nodes(dag: TrainingDAG, groups: list[Group]) -> dict[Group, list[int]]:
    """Per-group node order by lockstep list scheduling (one node per group per round)."""
    members = {u: member_groups(n, groups) for u, n in dag.nodes.items()}
    preds, succs = dag.adjacency()
    missing = {u: len(p) for u, p in preds.items()}
    ready: dict[Group, set[int]] = {g: set() for g in groups}
    for u, count in missing.items():
        if count == 0:
            for g in members[u]:
                ready[g].add(u)
    arrived: dict[int, set[Group]] = defaultdict(set)
    waiting: dict[Group, int | None] = {g: None for g in groups}
    order: dict[Group, list[int]] = {g: [] for g in groups}
    remaining = sum(len(members[u]) for u in dag.nodes)

    def priority(u: int) -> tuple[int, int]:
        return (_PRIORITY.get(dag.nodes[u].kind, 2), u)

    units: dict[int, list[int]] = defaultdict(list)
    for u, n in sorted(dag.nodes.items()):
        if n.overlap is not None:
            units[n.overlap].append(u)
    done: set[int] = set()
    scheduled: set[int] = set()

    def unit_of(u: int) -> list[int]:
        overlap = dag.nodes[u].overlap
        return [u] if overlap is None else units[overlap]

    def unit_ready(unit: list[int]) -> bool:
        inside = set(unit)
        return all(p in done or p in inside for v in unit for p in preds[v])

    def finish(u: int) -> None:
        done.add(u)
        for v in succs[u]:
            missing[v] -= 1
            if missing[v] == 0 and v not in scheduled:
                for g in members[v]:
                    ready[g].add(v)

    while remaining:
        finished, picked = [], False
        for g in groups:
            # transfers take no time here: a group goes on picking after a SEND or RECV
            while waiting[g] is None and ready[g]:
                candidates = [v for v in ready[g] if unit_ready(unit_of(v))]
                if not candidates:
                    break
                u = min(candidates, key=priority)
                picked = True
                if len(unit_of(u)) > 1:  # an overlap unit: all of it, back to back
                    for v in unit_of(u):
                        scheduled.add(v)
                        ready[g].discard(v)
                        order[g].append(v)
                        remaining -= 1
                        finished.append(v)
                    break
                ready[g].discard(u)
                order[g].append(u)
                remaining -= 1
                arrived[u].add(g)
                if len(arrived[u]) < len(members[u]):
                    waiting[g] = u
                    break
                for m in members[u]:
                    waiting[m] = None
                if dag.nodes[u].kind not in (NodeKind.SEND, NodeKind.RECV):
                    finished.append(u)
                    break
                finish(u)
        if not finished and not picked and remaining:
            stuck = {g: len(order[g]) for g in groups}
            raise PlanError(
                "the DAG cannot be scheduled: no device group can make "
                f"progress.\n{_stuck_report(dag, order, stuck)}"
            )
        for u in finished:
            finish(u)
    return order


def sink_receives(dag: TrainingDAG, uids: list[int]) -> list[int]:
    """Move every RECV to just before its first reader in the plan.

    A RECV only waits for its SEND, and a SEND never waits for its receiver, so a later
    RECV cannot deadlock; placed late, it never holds up independent work before it (it
    acts like a posted receive).
    """
    recvs = {u for u in uids if dag.nodes[u].kind is NodeKind.RECV}
    succs = dag.adjacency()[1]
    readers = {u: set(succs[u]) for u in recvs}
    out: list[int] = []
    pending: list[int] = []
    for i, u in enumerate(uids):
        if u in recvs:
            pending.append(u)
            continue
        overlap = dag.nodes[u].overlap
        unit = {u}
        if overlap is not None:  # keep an overlap unit contiguous: receive before it
            unit.update(v for v in uids[i:] if dag.nodes[v].overlap == overlap)
        for r in [r for r in pending if readers[r] & unit]:
            pending.remove(r)
            out.append(r)
        out.append(u)
    return out + pending


def _stuck_report(dag: TrainingDAG, order: dict[Group, list[int]], at: dict[Group, int]) -> str:
    lines = []
    for g, uids in order.items():
        done = ", ".join(str(dag.nodes[u]) for u in uids[-4:])
        lines.append(f"  {group_str(g)}: ... {done} | stuck after {at[g]} nodes")
    return "\n".join(lines)


def to_instruction(dag: TrainingDAG, node: Node) -> Instruction:
    if node.kind is NodeKind.COMPUTE:
        return Instruction(RUN, node.pass_, node.region, node.microbatch)
    if node.kind is NodeKind.UPD:
        return Instruction(UPD, region=node.region)
    if node.kind in (NodeKind.SEND, NodeKind.RECV):
        op = SEND if node.kind is NodeKind.SEND else RECV
        carried = dag.nodes[node.carries]
        return Instruction(op, carried.pass_, carried.region, carried.microbatch, node.peer)
    if node.kind is NodeKind.ALL_REDUCE:
        return Instruction(ALL_REDUCE, peer=node.devices, uid=node.uid)
    raise PlanError(f"{node}: {node.kind.value} nodes are not supported by the runtime yet")


def buffer_reads(
    dag: TrainingDAG, node: Node, data_preds: list[int], batch_regions: set[int]
) -> list[str]:
    """Labels of the buffers `node` reads on its own group (residuals excluded), given
    its data predecessors."""
    if node.kind not in (NodeKind.COMPUTE, NodeKind.SEND):
        return []
    reads = []
    for p in data_preds:
        src = dag.nodes[p]
        if src.kind is NodeKind.RECV:
            src = dag.nodes[src.carries]
        if src.kind is not NodeKind.COMPUTE:
            continue
        if node.kind is NodeKind.COMPUTE and src.region == node.region:
            continue  # F -> B of one region: the residuals, which B consumes itself
        reads.append(src.compute_label())
    if node.kind is NodeKind.COMPUTE and node.pass_ == "F" and node.region in batch_regions:
        reads.append(f"{BATCH}.{node.microbatch}")
    return reads


def buffer_writes(dag: TrainingDAG, node: Node) -> list[str]:
    """Labels of the buffers `node` leaves on its group for later instructions."""
    if node.kind is NodeKind.COMPUTE:
        return [node.compute_label()]
    if node.kind is NodeKind.RECV:
        return [dag.nodes[node.carries].compute_label()]
    return []


def insert_frees(
    dag: TrainingDAG,
    plans: dict[Group, list[Instruction]],
    nodes: dict[Group, list[int | None]],
    batch_regions: set[int],
) -> tuple[dict[Group, list[Instruction]], dict[Group, list[int | None]]]:
    """A FREE after the last instruction of a group that reads (or else writes) a buffer."""
    new_plans, new_nodes = {}, {}
    data_preds = dag.adjacency(EdgeKind.DATA)[0]
    for g, uids in nodes.items():
        last: dict[str, int] = {}
        for i, u in enumerate(uids):
            node = dag.nodes[u]
            reads = buffer_reads(dag, node, data_preds[u], batch_regions)
            for label in buffer_writes(dag, node) + reads:
                last[label] = i
        frees_after: dict[int, list[str]] = defaultdict(list)
        for label, i in last.items():
            frees_after[i].append(label)
        out_plan, out_nodes = [], []
        for i, (ins, u) in enumerate(zip(plans[g], uids)):
            out_plan.append(ins)
            out_nodes.append(u)
            for label in sorted(frees_after[i]):
                out_plan.append(_free(label))
                out_nodes.append(None)
        new_plans[g], new_nodes[g] = out_plan, out_nodes
    return new_plans, new_nodes


def _free(label: str) -> Instruction:
    return parse(f"FREE {label}")


def dry_run(
    dag: TrainingDAG, plans: dict[Group, list[Instruction]], nodes: dict[Group, list[int | None]]
) -> tuple[list[tuple[tuple[Group, ...], tuple[int, ...]]], dict[Group, list[int]]]:
    """Replay the plans in lockstep; a PlanError with the marked grid if they cannot finish.

    Each round every group runs its next instruction if its inputs are done; a collective
    runs when every member group has reached it. Results count from the next round.
    """
    groups = sorted(plans)
    preds = dag.adjacency()[0]
    pc = {g: 0 for g in groups}
    rounds: dict[Group, list[int]] = {g: [-1] * len(plans[g]) for g in groups}
    done: set[int] = set()
    events: list[tuple[tuple[Group, ...], tuple[int, ...]]] = []
    r = 0
    while any(pc[g] < len(plans[g]) for g in groups):
        finished, progressed = [], False
        for g in groups:
            while pc[g] < len(plans[g]) and nodes[g][pc[g]] is None:
                rounds[g][pc[g]] = r
                events.append(((g,), (pc[g],)))
                pc[g] += 1
            if pc[g] == len(plans[g]):
                continue
            u = nodes[g][pc[g]]
            if not all(p in done for p in preds[u]):
                continue
            members = member_groups(dag.nodes[u], groups)
            if any(pc[m] >= len(plans[m]) or nodes[m][pc[m]] != u for m in members):
                continue
            if g != members[-1]:
                continue  # a collective runs once, when its last member group comes by
            for m in members:
                rounds[m][pc[m]] = r
            events.append((tuple(members), tuple(pc[m] for m in members)))
            for m in members:
                pc[m] += 1
            finished.append(u)
            progressed = True
        if not progressed and any(pc[g] < len(plans[g]) for g in groups):
            stuck_groups = [g for g in groups if pc[g] < len(plans[g])]
            for g in groups:
                for i in range(pc[g], len(plans[g])):
                    rounds[g][i] = r + i - pc[g]
            stuck = ", ".join(f"{plans[g][pc[g]]} on {group_str(g)}" for g in stuck_groups)
            raise PlanError(
                f"plan deadlock: no device group can run its next instruction ({stuck}); "
                "each waits for data or a collective that never comes. Check the order "
                "directives against the data flow.\n"
                + format_grid(plans, rounds, mark={g: pc[g] for g in stuck_groups})
            )
        done.update(finished)
        r += 1
    return events, rounds
