"""ZeRO's communication nodes (Note [ZeRO in piper-jax], mpmd_runtime/zero.py).

For a group replicated with `shard_grads` (ZeRO level 2) or `shard_params` (level 3):

  B0.3 -> REDUCE_SCATTER grad[B0.3]   every weight-gradient pass reduce-scatters its
                                      gradients into the replica's flat shard (cut into
                                      buckets of `bucket_size` MB, `grad[B0.3]/k`);
  ALL_GATHER param[F0.3] -> F0.3      level 3: every pass first gathers the parameters
                                      it reads from their shards;
  UPD0 -> ALL_GATHER param[UPD0]      level 2: the updated shards are gathered back
                                      into the replicated parameters.

The plan compiler fuses each of them into the program of the pass it serves (see
mpmd_runtime/units.py), so a gathered parameter lives only as long as that program.
"""

from __future__ import annotations

from collections.abc import Sequence

from piper_jax.directives.buckets import buckets_by_size
from piper_jax.ir.dag import Node, NodeKind, TrainingDAG
from piper_jax.ir.lift import LiftedLoss

STREAM = "dp"


def insert_reduce_scatters(
    dag: TrainingDAG, producer: Node, params: Sequence[int], nbytes: dict[int, int]
) -> list[Node]:
    """REDUCE_SCATTER nodes (one per bucket) of the gradients `producer` computes."""
    limit = producer.param_layout.bucket_mb
    buckets = buckets_by_size(params, lambda p: p, nbytes, limit) if limit and params else [params]
    out = []
    for k, bucket in enumerate(buckets):
        suffix = f"/{k}" if len(buckets) > 1 else ""
        rs = dag.add(
            Node(
                dag.new_uid(),
                NodeKind.REDUCE_SCATTER,
                producer.region,
                producer.region_tags,
                microbatch=producer.microbatch,
                mesh=producer.mesh,
                stream=STREAM,
                params=tuple(bucket),
                carries=producer.uid,
                value=f"grad[{producer.compute_label()}]{suffix}",
                param_layout=producer.param_layout,
            )
        )
        dag.connect(producer.uid, rs.uid)
        out.append(rs)
    return out


def insert_gathers(dag: TrainingDAG, lifted: LiftedLoss) -> None:
    """ALL_GATHER before every pass of a level-3 group and after every update of a
    level-2 group (in place)."""
    for n in list(dag.nodes.values()):
        level = n.param_layout.zero_level
        if n.kind is NodeKind.COMPUTE and level >= 3:
            params = lifted.regions[n.region].param_ids
            if not params:
                continue
            ag = _gather(dag, n, params, f"param[{n.compute_label()}]")
            dag.connect(ag.uid, n.uid)  # it reads only the shards: the plan puts it just before
        elif n.kind is NodeKind.UPD and level == 2:
            ag = _gather(dag, n, n.params, f"param[UPD{n.region}]")
            dag.connect(n.uid, ag.uid)


def _gather(dag: TrainingDAG, served: Node, params: Sequence[int], value: str) -> Node:
    return dag.add(
        Node(
            dag.new_uid(),
            NodeKind.ALL_GATHER,
            served.region,
            served.region_tags,
            microbatch=served.microbatch,
            mesh=served.mesh,
            stream=STREAM,
            params=tuple(params),
            carries=served.uid,
            value=value,
            param_layout=served.param_layout,
        )
    )
