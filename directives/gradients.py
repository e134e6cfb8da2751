"""The optimizer side of the DAG: UPD nodes and the gradient collectives that feed them.

Runs once placement is known, after `place` and `replicate`.

Note [parameter groups and tied weights]
A parameter is updated once per device group that holds it: by the UPD node of the
first region on that group that reads it. A parameter read by regions on several
groups (tied embeddings) is a copy on each; its gradient contributions are summed by one
ALL_REDUCE over the union of those groups, and every copy takes the same optimizer step,
so the copies stay equal. Replicas of a group (data parallelism) are covered by the
same rule: the ALL_REDUCE spans every replica device. A parameter no region reads still
gets its (zero-gradient) update, from the first region's UPD, as `jax.grad` would.
ZeRO groups reduce their gradients inside the group with a REDUCE_SCATTER after every
backward (directives/zero.py), so only a sum across groups is left for an ALL_REDUCE.
"""

from __future__ import annotations

from piper_jax.directives import zero
from piper_jax.directives.buckets import buckets_by_size, param_nbytes
from piper_jax.ir.build import region_meshes
from piper_jax.ir.dag import WEIGHT_GRAD_PASSES, Node, NodeKind, TrainingDAG
from piper_jax.ir.layout import DP, DeviceMesh
from piper_jax.ir.lift import LiftedLoss

SYNC_KINDS = (NodeKind.UPD, NodeKind.ALL_REDUCE, NodeKind.REDUCE_SCATTER, NodeKind.ALL_GATHER)
STREAM = "dp"


def insert_updates(dag: TrainingDAG, lifted: LiftedLoss, global_norm: bool = False) -> TrainingDAG:
    """Replace the UPD nodes and gradient collectives to fit the current placement.

    See Note [parameter groups and tied weights]. With `global_norm`, one ALL_REDUCE
    `gnorm` over every group sums the squared gradient norms before any update, for
    optimizers that clip by the global norm and for the non-finite gradient guard.
    """
    dag = dag.copy()
    for n in list(dag.of_kind(*SYNC_KINDS)):
        dag.remove_node(n.uid)
    meshes = region_meshes(dag)
    layout = {n.region: n.param_layout for n in dag.compute_nodes()}
    users = {p: lifted.param_users(p) or [0] for p in range(len(lifted.param_names))}
    owner: dict[tuple[int, tuple[int, ...]], int] = {}
    for p in sorted(users):
        for r in users[p]:
            owner.setdefault((p, meshes[r].devices), r)

    upd_of: dict[tuple[int, tuple[int, ...]], int] = {}
    for region in lifted.regions:
        r = region.index
        owned = tuple(p for p in sorted(users) if owner.get((p, meshes[r].devices)) == r)
        if not owned:
            continue
        node = dag.add(
            Node(
                dag.new_uid(),
                NodeKind.UPD,
                r,
                region.key,
                mesh=meshes[r],
                params=owned,
                param_layout=layout[r],
            )
        )
        for p in owned:
            upd_of[(p, meshes[r].devices)] = node.uid

    # the nodes whose output is a region's (ZeRO: reduce-scattered) weight gradients
    nbytes = param_nbytes(lifted)
    sources: dict[tuple[int, int], list[int]] = {}  # (param, region) -> nodes
    for n in list(dag.compute_nodes()):
        if n.pass_ not in WEIGHT_GRAD_PASSES:
            continue
        params = lifted.regions[n.region].param_ids
        if layout[n.region].zero_level >= 2 and params:  # a region without weights has none
            for rs in zero.insert_reduce_scatters(dag, n, params, nbytes):
                for p in rs.params:
                    sources.setdefault((p, n.region), []).append(rs.uid)
        else:
            for p in params:
                sources.setdefault((p, n.region), []).append(n.uid)

    by_union: dict[tuple[int, ...], list[int]] = {}
    for p, rs in users.items():
        union = tuple(dict.fromkeys(d for r in rs for d in meshes[r].devices))
        by_union.setdefault(union, []).append(p)
    reduces = []
    for union, all_params in by_union.items():
        groups = {meshes[r].devices for p in all_params for r in users[p]}
        replicas = max(meshes[r].axis_size(DP) for p in all_params for r in users[p])
        sharded = any(layout[r].zero_level >= 2 for p in all_params for r in users[p])
        # ZeRO groups reduce inside each group already; a sum across groups is left
        needs_reduce = len(groups) > 1 or (not sharded and replicas > 1)
        limits = {layout[r].bucket_mb for p in all_params for r in users[p]} - {None}
        buckets = (
            buckets_by_size(all_params, lambda p: (-min(users[p]), p), nbytes, min(limits))
            if needs_reduce and limits and not sharded
            else [all_params]
        )
        for k, params in enumerate(buckets):
            ar = None
            if needs_reduce:
                owners = sorted({owner[(p, g)] for p in params for g in groups if (p, g) in owner})
                value = f"grad[{','.join(map(str, owners))}]" + (
                    f"/{k}" if len(buckets) > 1 else ""
                )
                ar = dag.add(
                    Node(
                        dag.new_uid(),
                        NodeKind.ALL_REDUCE,
                        mesh=DeviceMesh.data_parallel(union),
                        stream=STREAM,
                        params=tuple(params),
                        value=value,
                    )
                )
                reduces.append(ar.uid)
            for p in params:
                for r in lifted.param_users(p):
                    for uid in sources.get((p, r), []):
                        dag.connect(uid, ar.uid if ar else upd_of[(p, meshes[r].devices)])
                if ar:
                    for r in users[p]:
                        dag.connect(ar.uid, upd_of[(p, meshes[r].devices)])
    zero.insert_gathers(dag, lifted)
    if global_norm:
        _insert_global_norm(dag, meshes, reduces)
    return dag


def _insert_global_norm(
    dag: TrainingDAG, meshes: dict[int, DeviceMesh], reduces: list[int]
) -> None:
    """One ALL_REDUCE of squared gradient norms over every group, after every gradient is
    complete and before any update."""
    everything = tuple(
        dict.fromkeys(d for g in sorted({m.devices for m in meshes.values()}) for d in g)
    )
    norm = dag.add(
        Node(
            dag.new_uid(),
            NodeKind.ALL_REDUCE,
            mesh=DeviceMesh.data_parallel(everything),
            stream=STREAM,
            value="gnorm",
        )
    )
    for n in list(dag.nodes.values()):
        if n.kind is NodeKind.UPD:
            dag.connect(norm.uid, n.uid)
        elif (
            n.uid in reduces
            or n.kind is NodeKind.REDUCE_SCATTER
            or (n.kind is NodeKind.COMPUTE and n.pass_ in WEIGHT_GRAD_PASSES)
        ):
            dag.connect(n.uid, norm.uid)
