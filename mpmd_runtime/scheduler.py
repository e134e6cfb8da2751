"""The first plan passes: the order in which each device group runs its DAG nodes.

schedule_nodes        lockstep list scheduling of DAG nodes per device group; every
                      edge, data or temporal, is honoured; when several nodes are ready
                      the order is SEND > collective > compute > RECV, then the lower
                      microbatch (one group without orders finishes a microbatch's
                      backward before the next forward: one microbatch's activations
                      alive), then DAG uid; an overlap unit (one order group) is picked
                      whole
attach_collectives    each ZeRO collective moves next to the pass it serves: a
                      parameter gather just before it, a gradient reduce-scatter just
                      after it, the gather of updated shards just after the update; each
                      ALL_TO_ALL just before the pass that reads what it moves
sink_receives         each RECV moves to just before its first reader
unit_keys             which consecutive nodes form one step (one program): an overlap
                      unit, each ALL_TO_ALL with its reader, and (when fusing) each ZeRO
                      collective with its pass
fuse_forward_backward a region's B that directly follows its F of the same microbatch
                      joins F's step (Note [a forward and its backward in one program])
"""

from __future__ import annotations

from collections import defaultdict
from collections.abc import Mapping, Sequence

from piper_jax.ir.dag import Node, NodeKind, TrainingDAG
from piper_jax.ir.errors import PlanError
from piper_jax.ir.layout import group_str
from piper_jax.mpmd_runtime.replay import groups_within

Group = tuple[int, ...]
_PRIORITY = {
    NodeKind.SEND: 0,
    NodeKind.ALL_REDUCE: 1,
    NodeKind.REDUCE_SCATTER: 1,
    NodeKind.ALL_GATHER: 1,
    NodeKind.RECV: 3,
}
ZERO_COLLECTIVES = (NodeKind.REDUCE_SCATTER, NodeKind.ALL_GATHER)
ATTACHED = (*ZERO_COLLECTIVES, NodeKind.ALL_TO_ALL)


def compute_groups(dag: TrainingDAG) -> list[Group]:
    return sorted({n.devices for n in dag.compute_nodes()})


def member_groups(node: Node, groups: Sequence[Group]) -> list[Group]:
    """The device groups whose plans hold `node`: a gradient ALL_REDUCE spans several."""
    if node.kind is NodeKind.ALL_REDUCE:
        return groups_within(node.devices, tuple(groups))
    return [node.devices]


def attached(dag: TrainingDAG) -> dict[int, int]:
    """ZeRO collectives and ALL_TO_ALLs -> the node each serves (its `carries`)."""
    return {
        u: n.carries for u, n in dag.nodes.items() if n.kind in ATTACHED and n.carries is not None
    }


def _bypass(
    relays: set[int], preds: dict[int, list[int]], succs: dict[int, list[int]]
) -> tuple[dict[int, list[int]], dict[int, list[int]]]:
    """The adjacency with every relay cut out and its neighbours joined: an ALL_TO_ALL
    runs inside its reader's program, so to the scheduler the reader reads its source."""
    if not relays:
        return preds, succs
    pred_sets = {u: set(p) - relays for u, p in preds.items() if u not in relays}
    succ_sets = {u: set(s) - relays for u, s in succs.items() if u not in relays}
    for r in relays:
        for p in preds[r]:
            succ_sets[p].update(succs[r])
        for s in succs[r]:
            pred_sets[s].update(preds[r])
    return (
        {u: sorted(p) for u, p in pred_sets.items()},
        {u: sorted(s) for u, s in succ_sets.items()},
    )


def schedule_nodes(dag: TrainingDAG, groups: list[Group]) -> dict[Group, list[int]]:
    """Per-group node order by lockstep list scheduling (one node per group per round).
    ZeRO collectives are not scheduled (see `attach_collectives`): a gather counts as
    done from the start, the others when the node they serve is. ALL_TO_ALLs are not
    either: the scheduler sees their readers read their sources directly (`_bypass`)."""
    relays = {u for u in dag.nodes if dag.nodes[u].kind is NodeKind.ALL_TO_ALL}
    serves = {u: c for u, c in attached(dag).items() if u not in relays}
    after: dict[int, list[int]] = defaultdict(list)
    for u, carried in serves.items():
        if not _runs_before(dag, u):
            after[carried].append(u)
    preds, succs = _bypass(relays, *dag.adjacency())
    members = {u: [] if u in serves else member_groups(dag.nodes[u], groups) for u in preds}
    missing = {u: len(p) for u, p in preds.items()}
    ready: dict[Group, set[int]] = {g: set() for g in groups}
    done: set[int] = set()
    scheduled: set[int] = set()
    for u, count in missing.items():
        if count == 0:
            for g in members[u]:
                ready[g].add(u)
    arrived: dict[int, set[Group]] = defaultdict(set)
    waiting: dict[Group, int | None] = {g: None for g in groups}
    order: dict[Group, list[int]] = {g: [] for g in groups}
    remaining = sum(len(m) for m in members.values())

    def priority(u: int) -> tuple[int, int, int]:
        n = dag.nodes[u]
        return (_PRIORITY.get(n.kind, 2), -1 if n.microbatch is None else n.microbatch, u)

    units: dict[int, list[int]] = defaultdict(list)
    for u, n in sorted(dag.nodes.items()):
        if n.overlap is not None:
            units[n.overlap].append(u)

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
        for v in after[u]:
            finish(v)

    for u in serves:
        if _runs_before(dag, u):
            finish(u)

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
                if len(unit_of(u)) > 1:  # an overlap unit: all of it, in data order
                    for v in _data_order(unit_of(u), preds):
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


def _data_order(unit: list[int], preds: dict[int, list[int]]) -> list[int]:
    """The members of an overlap unit with every member after those it reads from."""
    inside, out, placed = set(unit), [], set()
    while len(out) < len(unit):
        for u in unit:
            if u not in placed and all(p in placed or p not in inside for p in preds[u]):
                out.append(u)
                placed.add(u)
    return out


def _stuck_report(dag: TrainingDAG, order: dict[Group, list[int]], at: dict[Group, int]) -> str:
    lines = []
    for g, uids in order.items():
        done = ", ".join(str(dag.nodes[u]) for u in uids[-4:])
        lines.append(f"  {group_str(g)}: ... {done} | stuck after {at[g]} nodes")
    return "\n".join(lines)


def _runs_before(dag: TrainingDAG, u: int) -> bool:
    """A gather of a pass's parameters (it runs before the pass it serves; the other
    ZeRO collectives run after it)."""
    node = dag.nodes[u]
    return node.kind is NodeKind.ALL_GATHER and dag.nodes[node.carries].kind is NodeKind.COMPUTE


def attach_collectives(
    dag: TrainingDAG, uids: list[int], group: Group, serves: dict[int, int]
) -> list[int]:
    """`uids` (a group's scheduled nodes) with each ZeRO collective of the group put next
    to the node it serves, or around the overlap unit holding that node: gathers before,
    reduce-scatters and gathers of updated shards after; each ALL_TO_ALL just before its
    reader, inside the reader's unit, after the pass it reads from (`serves`:
    `attached(dag)`)."""
    before: dict[object, list[int]] = defaultdict(list)
    after: dict[object, list[int]] = defaultdict(list)

    def unit(u: int) -> object:
        overlap = dag.nodes[u].overlap
        return ("node", u) if overlap is None else ("overlap", overlap)

    relays: dict[int, list[int]] = defaultdict(list)  # inside a unit, after its source
    for u, carried in sorted(serves.items()):
        if dag.nodes[u].devices != group:
            continue
        if dag.nodes[u].kind is NodeKind.ALL_TO_ALL:
            relays[carried].append(u)
        else:
            (before if _runs_before(dag, u) else after)[unit(carried)].append(u)
    out: list[int] = []
    for i, u in enumerate(uids):
        key = unit(u)
        if i == 0 or unit(uids[i - 1]) != key:
            out += before.pop(key, [])
        out += relays.pop(u, [])
        out.append(u)
        if i + 1 == len(uids) or unit(uids[i + 1]) != key:
            out += after.pop(key, [])
    return out


def sink_receives(dag: TrainingDAG, uids: list[int], units: dict[int, object]) -> list[int]:
    """Move every RECV to just before the first step that reads it.

    A RECV only waits for its SEND, and a SEND never waits for its receiver, so a later
    RECV cannot deadlock; placed late, it never holds up independent work before it (it
    acts like a posted receive). `units` keeps a fused step contiguous.
    """
    recvs = {u for u in uids if dag.nodes[u].kind is NodeKind.RECV}
    readers = {u: set(dag.succs(u)) for u in recvs}
    out: list[int] = []
    pending: list[int] = []
    for i, u in enumerate(uids):
        if u in recvs:
            pending.append(u)
            continue
        unit = {u}
        j = i + 1
        while j < len(uids) and units[uids[j]] == units[u] and uids[j] not in recvs:
            unit.add(uids[j])
            j += 1
        for r in [r for r in pending if readers[r] & unit]:
            pending.remove(r)
            out.append(r)
        out.append(u)
    return out + pending


def unit_keys(dag: TrainingDAG, fuse_collectives: bool) -> dict[int, object]:
    """Consecutive nodes of a group with one key run as one step: an overlap unit's
    members, each ALL_TO_ALL with its reader (it runs inside the reader's program, Note
    [experts over ep]), and with `fuse_collectives` each ZeRO collective with the node it
    serves."""
    keys: dict[int, object] = {}
    for u, n in dag.nodes.items():
        keys[u] = ("overlap", n.overlap) if n.overlap is not None else ("node", u)
    for u, n in dag.nodes.items():
        fused = n.kind is NodeKind.ALL_TO_ALL or (fuse_collectives and n.kind in ZERO_COLLECTIVES)
        if fused and n.carries is not None:
            keys[u] = keys[n.carries]
    return keys


# Note [a forward and its backward in one program]
# Where a group runs a region's backward right after its forward of the same microbatch
# (one group without a pipeline; the last stage of 1F1B), the two can run as one program:
# the forward's VJP residuals then never leave it, and XLA keeps, fuses and frees them as
# in one jit of value_and_grad. Run apart, F writes every residual (hundreds of arrays) and
# B reads them back. On one H200 the GPT of benchmarks/gpu_step.py (d_model 768, 12
# layers) spent 20.3 ms in the fused program's kernels against 7.9 + 15.5 ms apart, and
# its step took 24.7 ms against 28.6 ms. On XLA:CPU the separate programs ran faster
# (172-182 ms against 189-199 ms, a d_model 256 GPT), so `fuse_passes` defaults to off
# there. Where it is asked for on the CPU, the residuals reach the backward through an
# optimization barrier (programs.fences_residuals): the DP GPT of
# benchmarks/compile_time.py (d_model 128, 4 devices) ran F+B in 206-225 ms against
# 255 ms without it (F and B apart: 216-233 ms), and its losses equal those of the
# programs apart bit for bit. At d_model 256 it was still slower than two programs
# (583-641 ms against 557-584 ms; 623-693 ms unfenced): XLA:CPU lays the MLP's hidden
# activation out transposed for its weight-gradient product and computes it so, 4 times
# 25 ms of copies a step where the backward apart transposes its input in 7 ms. The
# barrier cannot keep that layout out: XLA:CPU expands it before layout assignment and
# fusion (the optimized program holds none), and residuals transposed or flattened to
# one dimension around it were laid out and fused the same way (645-699 ms a step
# against 574-603 ms apart). The global norm and the update were not fused in as well:
# the whole step as one program made one CUDA graph of 1,264 kernels, whose launch took
# 6 ms of host time before the GPU started (30.4 ms a step). Passes of an overlap unit
# stay as it says.
def fuse_forward_backward(
    dag: TrainingDAG, orders: Mapping[Group, Sequence[int]], keys: dict[int, object]
) -> dict[int, object]:
    """`keys` with each B that follows its F in its group's order in F's step (and the
    collectives attached to that B with it)."""
    moved: dict[object, object] = {}
    for order in orders.values():
        for f, b in zip(order, order[1:]):
            nf, nb = dag.nodes[f], dag.nodes[b]
            if (
                nf.kind is NodeKind.COMPUTE
                and nb.kind is NodeKind.COMPUTE
                and (nf.pass_, nb.pass_) == ("F", "B")
                and (nf.region, nf.microbatch) == (nb.region, nb.microbatch)
                and nf.overlap is None
                and nb.overlap is None
            ):
                moved[keys[b]] = keys[f]
    if not moved:
        return keys
    return {u: moved.get(k, k) for u, k in keys.items()}


# Note [reductions inside the update]
# Within one device group, the all-reduces that run right before an update (its
# gradients' last bucket, the global norm when the group holds every gradient) run in the
# update's program, as a pjit step runs its all-reduce and update in one program. Apart,
# each was a program of its own: XLA:CPU spends most of a small program's compile in
# partitioning and emitting it, not in its kernels (a GPT's all-reduce of 52 gradients,
# no kernel at all, took 0.11-0.19 s), and each costs a dispatch per step. Together the
# GPT's DP first step took 2.58-2.73 s against 2.72-2.95 s (three runs each), and its
# steps 0.98-1.01x the time of a pjit step against 1.04-1.08x (two runs each). A
# reduction over several groups (a tied weight, the norm over stages) stays apart, and
# so does every bucket that has a backward after it, to overlap with that backward.
def fuse_reductions_into_updates(
    dag: TrainingDAG, orders: Mapping[Group, Sequence[int]], keys: dict[int, object]
) -> dict[int, object]:
    """`keys` with the ALL_REDUCEs of a group that directly precede one of its UPDs in
    its order in that UPD's step."""
    keys = dict(keys)
    for g, order in orders.items():
        for i, u in enumerate(order):
            if dag.nodes[u].kind is not NodeKind.UPD:
                continue
            j = i - 1
            while j >= 0 and _local_reduce(dag.nodes[order[j]], g):
                keys[order[j]] = keys[u]
                j -= 1
    return keys


def _local_reduce(node: Node, g: Group) -> bool:
    return node.kind is NodeKind.ALL_REDUCE and node.devices == g and node.overlap is None
