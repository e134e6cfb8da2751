"""Build the training DAG of a lifted loss: one F and one B node per region.

The optimizer side (UPD nodes, gradient collectives) depends on where regions are
placed, so the directive passes add it once placement is known
(directives/gradients.py).
"""

from __future__ import annotations

from piper_jax.ir.dag import Node, NodeKind, TrainingDAG
from piper_jax.ir.errors import DirectiveError
from piper_jax.ir.layout import DeviceMesh
from piper_jax.ir.lift import LiftedLoss


def build_dag(lifted: LiftedLoss, forward_only: bool = False) -> TrainingDAG:
    """One F and (unless `forward_only`, for evaluation) one B node per region, with the
    data edges between them."""
    dag = TrainingDAG()
    fwd, bwd = {}, {}
    for region in lifted.regions:
        fwd[region.index] = dag.add(
            Node(dag.new_uid(), NodeKind.COMPUTE, region.index, region.key, pass_="F")
        )
    if forward_only:
        for region in lifted.regions:
            for ref in region.act_inputs:
                dag.connect(fwd[ref.region].uid, fwd[region.index].uid)
        return dag
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
    return dag


def region_meshes(dag: TrainingDAG) -> dict[int, DeviceMesh]:
    """The device group of each region; all its compute nodes must share it."""
    meshes: dict[int, DeviceMesh] = {}
    first_node: dict[int, Node] = {}
    for n in dag.compute_nodes():
        assert n.mesh is not None, n
        if n.region not in meshes:
            meshes[n.region], first_node[n.region] = n.mesh, n
        elif meshes[n.region] != n.mesh:
            raise DirectiveError(
                f"region {n.region} has {first_node[n.region]} on devices "
                f"{list(meshes[n.region].devices)} but {n} on {list(n.devices)}: all passes "
                "and microbatches of a region must be placed on the same devices"
            )
    return meshes
