"""Build the training DAG of a lifted loss, and (re)attach its optimizer side.

Note [parameter groups and tied weights]
A parameter is updated once per device group that holds it: by the UPD node of the
first region on that group that reads it. A parameter read by regions on several
groups (tied embeddings) is a copy on each; its gradient contributions are summed by one
ALL_REDUCE over the union of those groups, and every copy takes the same optimizer step,
so the copies stay equal. Replicas of a group (data parallelism) are covered by the
same rule: the ALL_REDUCE spans every replica device. A parameter no region reads still
gets its (zero-gradient) update, from the first region's UPD, as `jax.grad` would.
"""

from __future__ import annotations

import math

import numpy as np
from piper_jax.ir.dag import Node, NodeKind, TrainingDAG
from piper_jax.ir.errors import DirectiveError
from piper_jax.ir.lift import LiftedLoss

WEIGHT_GRAD_PASSES = ("B", "BW")


def build_dag(lifted: LiftedLoss) -> TrainingDAG:
    """One F and one B node per region, data edges between them, then the UPD side."""
    dag = TrainingDAG()
    fwd, bwd = {}, {}
    for region in lifted.regions:
        fwd[region.index] = dag.add(
            Node(dag.new_uid(), NodeKind.COMPUTE, region.index, region.key, pass_="F")
        )
    for region in reversed(lifted.regions):
        bwd[region.index] = dag.add(
            Node(dag.new_uid(), NodeKind.COMPUTE, region.index, region.key, pass_="B")
        )
    for region in lifted.regions:
        r = region.index
        dag.connect(fwd[r].uid, bwd[r].uid)
        for ref in region.act_inputs:
            dag.connect(fwd[ref.region].uid, fwd[r].uid)
            if lifted.regions[ref.region].out_is_float(ref.position):
                dag.connect(bwd[r].uid, bwd[ref.region].uid)
    return attach_updates(dag, lifted)


def region_groups(dag: TrainingDAG) -> dict[int, tuple[int, ...]]:
    """The device group of each region; all its compute nodes must share it."""
    groups: dict[int, tuple[int, ...]] = {}
    first_node: dict[int, Node] = {}
    for n in dag.compute_nodes():
        if n.region not in groups:
            groups[n.region], first_node[n.region] = n.devices, n
        elif groups[n.region] != n.devices:
            raise DirectiveError(
                f"region {n.region} has {first_node[n.region]} on devices "
                f"{list(groups[n.region])} but {n} on {list(n.devices)}: all passes and "
                "microbatches of a region must be placed on the same devices"
            )
    return groups


def attach_updates(
    dag: TrainingDAG, lifted: LiftedLoss, stream: str = "dp", global_norm: bool = False
) -> TrainingDAG:
    """Replace UPD and gradient ALL_REDUCE nodes to fit the current placement.

    See Note [parameter groups and tied weights]. With `global_norm`, one more
    ALL_REDUCE (with no parameters) sums the squared gradient norms of every group
    before any update, for optimizers that clip by the global norm.
    """
    dag = dag.copy()
    for n in list(dag.of_kind(NodeKind.UPD, NodeKind.ALL_REDUCE)):
        dag.remove_node(n.uid)
    groups = region_groups(dag)
    replicated = {n.region: n.replicated for n in dag.compute_nodes()}
    zero = {n.region: n.zero for n in dag.compute_nodes()}
    bucket = {n.region: n.bucket_mb for n in dag.compute_nodes()}
    grad_nodes: dict[int, list[int]] = {}
    for n in dag.compute_nodes():
        if n.pass_ in WEIGHT_GRAD_PASSES:
            grad_nodes.setdefault(n.region, []).append(n.uid)

    owner: dict[tuple[int, tuple[int, ...]], int] = {}
    users: dict[int, list[int]] = {}
    for p in range(len(lifted.param_names)):
        users[p] = lifted.param_users(p) or [0]
        for r in users[p]:
            owner.setdefault((p, groups[r]), r)
    upd_of: dict[tuple[int, tuple[int, ...]], int] = {}
    for region in lifted.regions:
        r = region.index
        owned = tuple(p for p in sorted(users) if owner.get((p, groups[r])) == r)
        if not owned:
            continue
        node = dag.add(
            Node(
                dag.new_uid(),
                NodeKind.UPD,
                r,
                region.key,
                devices=groups[r],
                replicated=replicated[r],
                params=owned,
                zero=zero[r],
            )
        )
        for p in owned:
            upd_of[(p, groups[r])] = node.uid

    by_union: dict[tuple[int, ...], list[int]] = {}
    for p, rs in users.items():
        union = tuple(dict.fromkeys(d for r in rs for d in groups[r]))
        by_union.setdefault(union, []).append(p)
    for union, all_params in by_union.items():
        stages = {zero[r] for p in all_params for r in users[p]}
        if len(stages) > 1:
            raise DirectiveError(
                f"parameters {[lifted.param_names[p] for p in all_params][:3]} are shared by "
                "regions with different ZeRO settings; replicate them the same way"
            )
        user_groups = {groups[r] for p in all_params for r in users[p]}
        # ZeRO groups reduce-scatter inside each backward; only ties across groups remain
        needs_reduce = len(user_groups) > 1 if stages - {0} else len(union) > 1
        limits = {bucket[r] for p in all_params for r in users[p]} - {None}
        buckets = (
            _buckets(all_params, users, lifted, min(limits))
            if needs_reduce and limits and not stages - {0}
            else [all_params]
        )
        for params in buckets:
            ar = None
            if needs_reduce:
                ar = dag.add(
                    Node(
                        dag.new_uid(),
                        NodeKind.ALL_REDUCE,
                        devices=union,
                        stream=stream,
                        params=tuple(params),
                        zero=next(iter(stages)),
                    )
                )
            for p in params:
                for r in lifted.param_users(p):
                    for uid in grad_nodes[r]:
                        dag.connect(uid, ar.uid if ar else upd_of[(p, groups[r])])
                if ar:
                    for r in users[p]:
                        dag.connect(ar.uid, upd_of[(p, groups[r])])
    if global_norm:
        everything = tuple(dict.fromkeys(d for g in sorted(set(groups.values())) for d in g))
        norm = dag.add(Node(dag.new_uid(), NodeKind.ALL_REDUCE, devices=everything, stream=stream))
        for n in list(dag.nodes.values()):
            if n.kind is NodeKind.UPD:
                dag.connect(norm.uid, n.uid)
            elif (
                n.kind is NodeKind.ALL_REDUCE
                and n.uid != norm.uid
                or (n.kind is NodeKind.COMPUTE and n.pass_ in WEIGHT_GRAD_PASSES)
            ):
                dag.connect(n.uid, norm.uid)
    return dag


def _buckets(
    params: list[int], users: dict[int, list[int]], lifted: LiftedLoss, limit_mb: float
) -> list[list[int]]:
    """Gradient all-reduce buckets of at most `limit_mb` (one parameter at least), filled
    in the order backward finishes with them (the last region's first), so a bucket's
    all-reduce can start as soon as the regions it serves are done."""
    nbytes = {}
    for region in lifted.regions:
        for p, (shape, dtype) in zip(region.param_ids, region.in_shapes):
            nbytes[p] = math.prod(shape) * np.dtype(dtype).itemsize
    order = sorted(params, key=lambda p: (-min(users[p]), p))
    out: list[list[int]] = [[]]
    size = 0
    for p in order:
        if out[-1] and size + nbytes.get(p, 0) > limit_mb * 2**20:
            out.append([])
            size = 0
        out[-1].append(p)
        size += nbytes.get(p, 0)
    return out
