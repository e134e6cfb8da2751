"""shard: expert parallelism inside a device group.

The matched regions hold a mixture-of-experts layer's experts: every parameter stacked
with the expert dimension first, and tokens coming in dispatched as (batch, experts,
capacity, ...). `shard` makes their device group a `dp x ep` mesh (Note [device groups
as named meshes]) and splits the experts over `ep`. Inside each data-parallel replica the
group's programs are SPMD over `ep` (Note [replicas as a leading axis]): every region of
the group works on its own slice of the replica's batch, the expert regions on their own
experts, and XLA turns the change between the two layouts into the all-to-all that
dispatches tokens to their experts and the one that combines them back. The experts'
gradients stay with their experts; every other gradient is summed over the whole group.

`insert_all_to_alls` makes those moves DAG nodes: an ALL_TO_ALL on every data edge into
an expert pass (dispatch) and out of it (combine), forward and backward alike. Each runs
inside the program of the pass that reads what it moves, so that a fused overlap unit
(DualPipeV) holds one microbatch's all-to-all beside another microbatch's compute.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Sequence

from piper_jax.directives.filters import NodeIndex, filter_str
from piper_jax.directives.tensor import inner_mesh, matched_nodes
from piper_jax.directives.types import Shard
from piper_jax.ir.dag import EdgeKind, Node, NodeKind, TrainingDAG
from piper_jax.ir.errors import DirectiveError
from piper_jax.ir.layout import DP, EP, DeviceMesh
from piper_jax.ir.lift import LiftedLoss, Region


def expert_count(lifted: LiftedLoss, regions: Sequence[int], where: str) -> int:
    """The number of experts the regions hold: the leading dimension shared by all their
    parameters, which must also be the second dimension of a dispatched input."""
    leading: dict[str, int] = {}
    for r in regions:
        region = lifted.regions[r]
        for p, (shape, _) in zip(region.param_ids, region.in_shapes):
            leading[lifted.param_names[p]] = shape[0] if shape else 0
    sizes = set(leading.values())
    if not leading or len(sizes) != 1 or min(sizes) < 2:
        found = ", ".join(f"{n}: {s}" for n, s in sorted(leading.items())) or "no parameters"
        raise DirectiveError(
            f"{where}: the matched regions hold no experts: shard splits parameters stacked "
            f"with the expert dimension first (all alike, at least 2), but their leading "
            f"dimensions are {found}; annotate only the experts' call (e.g. "
            "`with piper.annotate('EP', i): y = self.experts(x_dispatched)`)"
        )
    experts = sizes.pop()
    for r in regions:
        if not any(len(s) >= 2 and s[1] == experts for s, _ in dispatched(lifted.regions[r])):
            raise DirectiveError(
                f"{where}: region {lifted.regions[r]} takes no tokens dispatched to its "
                f"{experts} experts: an expert region's input must be laid out (batch, "
                f"experts, capacity, ...), got inputs of shapes "
                f"{[list(s) for s, _ in dispatched(lifted.regions[r])]}"
            )
    return experts


def dispatched(region: Region) -> list[tuple[tuple[int, ...], object]]:
    """The (shape, dtype) of each activation input of `region`."""
    return list(region.in_shapes[len(region.param_ids) + len(region.batch_ids) :])


def apply_shards(
    dag: TrainingDAG, lifted: LiftedLoss, directives: Sequence[Shard], num_devices: int
) -> TrainingDAG:
    """Every `shard`, in turn, on one copy of `dag`: the expert regions' parameters split
    over `ep`, and every region on their device group given the `dp x ep` mesh."""
    if not directives:
        return dag
    dag = dag.copy()
    index = NodeIndex(dag.compute_nodes())
    meshes: dict[tuple[int, ...], DeviceMesh] = {}
    for directive in directives:
        where = f"shard {filter_str(directive.filter)}"
        nodes = matched_nodes(dag, index, directive, num_devices, where)
        regions = sorted({n.region for n in nodes})
        experts = expert_count(lifted, regions, where)
        ep = len(directive.devices)
        if experts % ep:
            raise DirectiveError(
                f"{where}: {experts} experts cannot be split over {ep} devices "
                f"{list(directive.devices)}; use a number of devices that divides {experts}"
            )
        for n in nodes:
            mesh = inner_mesh(n, directive.devices, where, EP)
            region = lifted.regions[n.region]
            split = tuple(
                (p, (EP,) + (None,) * (len(shape) - 1))
                for p, (shape, _) in sorted(zip(region.param_ids, region.in_shapes))
            )
            layout = dataclasses.replace(n.param_layout, tensor=split)
            dag.replace(dataclasses.replace(n, mesh=mesh, param_layout=layout))
            meshes[n.devices] = mesh
    for other in dag.compute_nodes():
        mesh = meshes.get(other.devices)
        if mesh is None or other.mesh == mesh:
            continue
        if other.mesh is not None and set(dict(other.mesh.axes)) - {DP}:
            raise DirectiveError(
                f"shard: the experts' group {list(other.devices)} is split as "
                f"{other.mesh.axes_str()} by another directive (at {other}) and as "
                f"{mesh.axes_str()} by shard; one device group has one layout"
            )
        dag.replace(dataclasses.replace(other, mesh=mesh))
    return dag


def insert_all_to_alls(dag: TrainingDAG) -> TrainingDAG:
    """An ALL_TO_ALL on each data edge of an `ep` group where tokens change layout: from
    another pass (or a RECV) into an expert pass, and from an expert pass into another
    region's pass; in the backward these carry cotangents the same two ways."""
    experts = {n.uid for n in dag.compute_nodes() if n.param_layout.holds_experts}
    if not experts:
        return dag
    dag = dag.copy()
    for edge in dag.edges:
        src, dst = dag.nodes[edge.src], dag.nodes[edge.dst]
        if (
            edge.kind is not EdgeKind.DATA
            or dst.kind is not NodeKind.COMPUTE
            or src.kind not in (NodeKind.COMPUTE, NodeKind.RECV)
            or src.region == dst.region
            or (src.uid in experts) == (dst.uid in experts)
        ):
            continue
        source = src.compute_label() if src.kind is NodeKind.COMPUTE else src.value
        direction = "dispatch" if dst.uid in experts else "combine"
        relay = dag.add(
            Node(
                dag.new_uid(),
                NodeKind.ALL_TO_ALL,
                region=dst.region,
                region_tags=dst.region_tags,
                microbatch=dst.microbatch,
                mesh=dst.mesh,
                stream=dst.stream,
                carries=dst.uid,
                value=f"{direction}[{source}>{dst.compute_label()}]",
            )
        )
        dag.disconnect(edge)
        dag.connect(src.uid, relay.uid)
        dag.connect(relay.uid, dst.uid)
    return dag
