"""replicate: data parallelism. The matched regions' device group becomes a mesh with a
`dp` axis over its devices, each replica running the region on its slice of the batch,
and the group's parameter layout says how gradients are synchronised: all-reduced once
per step, or ZeRO (`shard_grads`, `shard_params`; Note [ZeRO in piper-jax]).
"""

from __future__ import annotations

import dataclasses
from collections.abc import Sequence

from piper_jax.directives.filters import NodeIndex, filter_str
from piper_jax.directives.place import check_range, matched_nodes
from piper_jax.directives.types import Replicate
from piper_jax.ir.dag import TrainingDAG
from piper_jax.ir.errors import DirectiveError
from piper_jax.ir.layout import DeviceMesh, ParamLayout


def apply_replicates(
    dag: TrainingDAG, directives: Sequence[Replicate], num_devices: int
) -> TrainingDAG:
    """Every `replicate`, in turn, on one copy of `dag`."""
    dag = dag.copy()
    index = NodeIndex(dag.compute_nodes())
    for directive in directives:
        apply_replicate(dag, index, directive, num_devices)
    return dag


def apply_replicate(
    dag: TrainingDAG, index: NodeIndex, directive: Replicate, num_devices: int
) -> None:
    where = "replicate"
    check_range(directive.devices, num_devices, where)
    level = 3 if directive.shard_params else 2 if directive.shard_grads else 0
    layout = ParamLayout(zero_level=level, bucket_mb=directive.bucket_size)
    mesh = DeviceMesh.data_parallel(directive.devices)
    for node in matched_nodes(dag, index, directive, where):
        if node.mesh is not None and node.devices != directive.devices:
            raise DirectiveError(
                f"replicate {filter_str(directive.filter)}: {node} is placed on "
                f"{list(node.devices)} but replicated over {list(directive.devices)}; "
                "use the same devices in both"
            )
        dag.replace(dataclasses.replace(node, mesh=mesh, param_layout=layout))
