"""place: give compute nodes their device groups; and the placement check after
`replicate` has said how each group is split.

`place` puts matched regions on a device group. A group of several devices must also be
given a mesh by `replicate` (data parallelism over a `dp` axis); a group of one device
is `dp=1`. Groups are disjoint or equal, and may differ in size from one stage to the
next (Note [device groups as named meshes]).
"""

from __future__ import annotations

import dataclasses
from collections.abc import Sequence

from piper_jax.directives.filters import NodeIndex, filter_str
from piper_jax.directives.types import Place, Replicate
from piper_jax.ir.dag import Node, TrainingDAG
from piper_jax.ir.errors import DirectiveError
from piper_jax.ir.layout import DeviceMesh


def check_range(devices: tuple[int, ...], num_devices: int, where: str) -> None:
    bad = [d for d in devices if d >= num_devices]
    if bad:
        raise DirectiveError(
            f"{where}: device index {bad[0]} is out of range: the step has {num_devices} "
            f"devices (indices 0..{num_devices - 1}); pass devices= to compile or fix the index"
        )


def matched_nodes(
    dag: TrainingDAG, index: NodeIndex, directive: Place | Replicate, where: str
) -> list[Node]:
    """The compute nodes `directive` names, as they are in `dag` now."""
    nodes = [dag.nodes[n.uid] for n in index.select(directive.filter)]
    if not nodes:
        regions = sorted({str(dict(n.region_tags)) for n in index.nodes})
        raise DirectiveError(
            f"{where} {filter_str(directive.filter)}: filter matches no region; the regions "
            f"are {', '.join(regions)}"
        )
    return nodes


def apply_places(dag: TrainingDAG, directives: Sequence[Place], num_devices: int) -> TrainingDAG:
    """Every `place`, in turn, on one copy of `dag`."""
    dag = dag.copy()
    index = NodeIndex(dag.compute_nodes())
    for directive in directives:
        apply_place(dag, index, directive, num_devices)
    return dag


def apply_place(dag: TrainingDAG, index: NodeIndex, directive: Place, num_devices: int) -> None:
    check_range(directive.devices, num_devices, "place")
    for node in matched_nodes(dag, index, directive, "place"):
        if node.mesh is not None and node.devices != directive.devices:
            raise DirectiveError(
                f"place {filter_str(directive.filter)}: {node} is already placed on "
                f"{list(node.devices)}, cannot also go to {list(directive.devices)}"
            )
        dag.replace(
            dataclasses.replace(node, mesh=DeviceMesh(directive.devices), stream=directive.stream)
        )


def check_placement(dag: TrainingDAG, placed: bool) -> TrainingDAG:
    """Every compute node placed (or none, meaning device 0), every group given a mesh,
    groups disjoint or equal, one parameter layout per group."""
    dag = dag.copy()
    nodes = list(dag.compute_nodes())
    if not placed:
        for n in nodes:
            dag.replace(dataclasses.replace(n, mesh=DeviceMesh.data_parallel((0,))))
        return dag
    for n in nodes:
        if n.mesh is None:
            raise DirectiveError(
                f"region {dict(n.region_tags)} ({n}) is not placed while others are: add "
                f"place({dict(n.region_tags)}, devices=[...])"
            )
        if not n.mesh.axes:
            if n.mesh.size > 1:
                raise DirectiveError(
                    f"region {dict(n.region_tags)} is placed on {list(n.devices)} without "
                    "replicate: say how it is split over those devices, e.g. add "
                    f"replicate({dict(n.region_tags)}, devices={list(n.devices)})"
                )
            dag.replace(dataclasses.replace(n, mesh=DeviceMesh.data_parallel(n.devices)))
    nodes = list(dag.compute_nodes())
    groups = sorted({n.devices for n in nodes})
    for g in groups:
        on_g = [n for n in nodes if n.devices == g]
        layouts = {n.param_layout for n in on_g}
        if len({pl.zero_level for pl in layouts}) > 1:
            raise DirectiveError(
                f"device group {list(g)} mixes ZeRO settings "
                f"{sorted({pl.zero_level for pl in layouts})}: replicate every region on one "
                "group with the same shard_grads/shard_params"
            )
        specs: dict[int, object] = {}
        for n in on_g:
            for p, spec in n.param_layout.tensor:
                if specs.setdefault(p, spec) != spec:
                    raise DirectiveError(
                        f"parameter {p} of device group {list(g)} is split two ways by "
                        f"shard_tensor ({specs[p]} and {spec}); split it one way"
                    )
        if len({n.mesh for n in on_g}) > 1:
            raise DirectiveError(
                f"device group {list(g)} is split in different ways by its regions' "
                f"directives: {sorted({n.mesh.axes_str() for n in on_g})}; replicate all its "
                "regions alike"
            )
    for i, a in enumerate(groups):
        for b in groups[i + 1 :]:
            if set(a) & set(b):
                raise DirectiveError(
                    f"device groups {list(a)} and {list(b)} overlap: regions must share a "
                    "group exactly or use disjoint devices"
                )
    return dag
