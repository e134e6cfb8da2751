"""place and replicate: give compute nodes their device groups.

`place` puts matched regions on a device group; `replicate` makes a group's devices
replicas (data parallelism), each running the region on its slice of the batch. A region
placed on several devices must also be replicated: the directives say how it is split.
"""

from __future__ import annotations

import dataclasses

from piper_jax.directives.filters import filter_str, select
from piper_jax.directives.types import Place, Replicate
from piper_jax.ir.dag import TrainingDAG
from piper_jax.ir.errors import DirectiveError


def _check_range(devices: tuple[int, ...], num_devices: int, where: str) -> None:
    bad = [d for d in devices if d >= num_devices]
    if bad:
        raise DirectiveError(
            f"{where}: device index {bad[0]} is out of range: the step has {num_devices} "
            f"devices (indices 0..{num_devices - 1}); pass devices= to compile or fix the index"
        )


def _matched(dag: TrainingDAG, directive: Place | Replicate, where: str) -> list:
    nodes = select(dag.compute_nodes(), directive.filter)
    if not nodes:
        regions = sorted({str(dict(n.region_tags)) for n in dag.compute_nodes()})
        raise DirectiveError(
            f"{where} {filter_str(directive.filter)}: filter matches no region; the regions "
            f"are {', '.join(regions)}"
        )
    return nodes


def apply_place(dag: TrainingDAG, directive: Place, num_devices: int) -> TrainingDAG:
    _check_range(directive.devices, num_devices, "place")
    dag = dag.copy()
    for node in _matched(dag, directive, "place"):
        if node.devices and node.devices != directive.devices:
            raise DirectiveError(
                f"place {filter_str(directive.filter)}: {node} is already placed on "
                f"{list(node.devices)}, cannot also go to {list(directive.devices)}"
            )
        dag.replace(dataclasses.replace(node, devices=directive.devices, stream=directive.stream))
    return dag


def apply_replicate(dag: TrainingDAG, directive: Replicate, num_devices: int) -> TrainingDAG:
    where = "replicate"
    _check_range(directive.devices, num_devices, where)
    stage = 3 if directive.shard_params else 2 if directive.shard_grads else 0
    dag = dag.copy()
    for node in _matched(dag, directive, where):
        if node.devices and node.devices != directive.devices:
            raise DirectiveError(
                f"replicate {filter_str(directive.filter)}: {node} is placed on "
                f"{list(node.devices)} but replicated over {list(directive.devices)}; "
                "use the same devices in both"
            )
        dag.replace(
            dataclasses.replace(
                node,
                devices=directive.devices,
                replicated=True,
                zero=stage,
                bucket_mb=directive.bucket_size,
            )
        )
    return dag


def check_placement(dag: TrainingDAG, placed: bool) -> TrainingDAG:
    """Every compute node placed (or none, meaning device 0); groups disjoint or equal."""
    dag = dag.copy()
    nodes = list(dag.compute_nodes())
    if not placed:
        for n in nodes:
            dag.replace(dataclasses.replace(n, devices=(0,)))
        return dag
    for n in nodes:
        if not n.devices:
            raise DirectiveError(
                f"region {dict(n.region_tags)} ({n}) is not placed while others are: add "
                f"place({dict(n.region_tags)}, devices=[...])"
            )
        if len(n.devices) > 1 and not n.replicated:
            raise DirectiveError(
                f"region {dict(n.region_tags)} is placed on {list(n.devices)} without "
                "replicate: say how it is split over those devices, e.g. add "
                f"replicate({dict(n.region_tags)}, devices={list(n.devices)})"
            )
    groups = sorted({n.devices for n in nodes})
    for g in groups:
        stages = {n.zero for n in nodes if n.devices == g}
        if len(stages) > 1:
            raise DirectiveError(
                f"device group {list(g)} mixes ZeRO settings {sorted(stages)}: replicate "
                "every region on one group with the same shard_grads/shard_params"
            )
    for i, a in enumerate(groups):
        for b in groups[i + 1 :]:
            if set(a) & set(b):
                raise DirectiveError(
                    f"device groups {list(a)} and {list(b)} overlap: regions must share a "
                    "group exactly or use disjoint devices"
                )
    widths = {len(g) for g in groups}
    if len(widths) > 1:
        raise DirectiveError(
            f"device groups {[list(g) for g in groups]} have different replica counts: every "
            "region must be replicated the same number of times"
        )
    return dag
