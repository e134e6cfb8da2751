"""shard_tensor: tensor parallelism inside a device group.

The matched regions' group becomes a `dp x tp` mesh (Note [device groups as named
meshes]); their parameters lie split over `tp` by a partition of their dimensions, from
`params` (Megatron's column- and row-parallel Linear layers, by module name) or `rules`
(a parameter path pattern and a partition). The runtime compiles each region's passes
for that mesh: SPMD over `tp` inside every data-parallel replica, with XLA inserting
the collectives, so the model code stays the unsharded model.
"""

from __future__ import annotations

import dataclasses
import re
from collections.abc import Sequence

from piper_jax.directives.filters import NodeIndex, filter_str
from piper_jax.directives.place import check_range
from piper_jax.directives.types import Shard, ShardTensor
from piper_jax.ir.dag import Node, TrainingDAG
from piper_jax.ir.errors import DirectiveError
from piper_jax.ir.layout import DP, TP, DeviceMesh
from piper_jax.ir.lift import LiftedLoss

Spec = tuple[str | None, ...]
_KEY = re.compile(r"\[(?:'([^']*)'|(\d+))\]")


def path_parts(name: str) -> list[str]:
    """The components of a parameter's name: ['blocks'][0]['fc1']['kernel'] ->
    ['blocks', '0', 'fc1', 'kernel']."""
    return [a or b for a, b in _KEY.findall(name)]


def _megatron(split: str, leaf: str, ndim: int, param: str, where: str) -> Spec:
    if (leaf, ndim) == ("kernel", 2):
        return (None, TP) if split == "colwise" else (TP, None)
    if (leaf, ndim) == ("bias", 1):
        return (TP,) if split == "colwise" else (None,)
    raise DirectiveError(
        f"{where}: {split} splits the kernel (in, out) and bias (out,) of a Linear-like "
        f"module, but {param} is {leaf!r} of rank {ndim}; name the Linear module itself, or "
        "give a rule for this parameter"
    )


def module_partition(name: str, ndim: int, params: dict[str, str]) -> Spec | None:
    """A leaf's Megatron partition if `params` (module name -> colwise/rowwise) names its
    module, else None; for baselines that shard a model the way `shard_tensor` does."""
    parts = path_parts(name)
    for module, split in params.items():
        want = [c for c in module.split("/") if c]
        if parts[:-1][-len(want) :] == want:
            return _megatron(split, parts[-1], ndim, name, "partition")
    return None


def specs_of(
    directive: ShardTensor, lifted: LiftedLoss, params: Sequence[int], tp: int, where: str
) -> dict[int, Spec]:
    """The partition of each of `params` the directive asks for (unsplit ones left out)."""
    shapes = {p: s for r in lifted.regions for p, (s, _) in zip(r.param_ids, r.in_shapes)}
    out: dict[int, Spec] = {}
    for module, split in directive.params.items():
        want = [c for c in module.split("/") if c]
        hits = [p for p in params if path_parts(lifted.param_names[p])[:-1][-len(want) :] == want]
        if not hits:
            modules = sorted(
                {"/".join(path_parts(lifted.param_names[p])[:-1]) or "(the model)" for p in params}
            )
            raise DirectiveError(
                f"{where}: params names module {module!r}, which holds no parameter of the "
                f"matched regions; their modules are {', '.join(modules)}"
            )
        for p in hits:
            leaf = path_parts(lifted.param_names[p])[-1]
            out[p] = _megatron(split, leaf, len(shapes[p]), lifted.param_names[p], where)
    for pattern, spec in directive.rules.items():
        hits = [p for p in params if re.search(pattern, lifted.param_names[p])]
        if not hits:
            raise DirectiveError(
                f"{where}: rule {pattern!r} matches no parameter of the matched regions"
            )
        for p in hits:
            if len(spec) != len(shapes[p]):
                raise DirectiveError(
                    f"{where}: rule {pattern!r} partitions {len(spec)} dimensions, but "
                    f"{lifted.param_names[p]} has shape {list(shapes[p])}"
                )
            out[p] = spec
    for p, spec in out.items():
        for dim, axis in zip(shapes[p], spec):
            if axis == TP and dim % tp:
                raise DirectiveError(
                    f"{where}: {lifted.param_names[p]} of shape {list(shapes[p])} cannot be "
                    f"split {tp} ways along a dimension of size {dim}; choose a tensor-"
                    "parallel degree that divides it"
                )
    return out


def matched_nodes(
    dag: TrainingDAG, index: NodeIndex, directive: ShardTensor | Shard, num_devices: int, where: str
) -> list[Node]:
    """The compute nodes a shard_tensor or shard directive matches (at least one), after
    checking its devices exist."""
    check_range(directive.devices, num_devices, where)
    nodes = [dag.nodes[n.uid] for n in index.select(directive.filter)]
    if not nodes:
        raise DirectiveError(f"{where}: filter matches no region")
    return nodes


def inner_mesh(node: Node, devices: tuple[int, ...], where: str, axis: str = TP) -> DeviceMesh:
    """The node's group as dp x `axis` (tp or ep), with `devices` one run of consecutive
    devices of the group."""
    group = node.devices or devices
    width = len(devices)
    runs = [group[i : i + width] for i in range(0, len(group), width)]
    if len(group) % width or devices not in runs:
        raise DirectiveError(
            f"{where}: devices {list(devices)} are not a run of consecutive devices of the "
            f"region's group {list(group)}; a group of n devices splits into n / {axis} "
            f"runs, e.g. {[list(r) for r in runs]}"
        )
    if node.mesh is not None and not node.mesh.axes and len(group) > width:
        raise DirectiveError(
            f"{where}: the region's group {list(group)} is larger than its {axis} devices; "
            "replicate it over the group to make the rest data-parallel replicas"
        )
    return DeviceMesh(group, ((DP, len(group) // width), (axis, width)))


def apply_shard_tensors(
    dag: TrainingDAG, lifted: LiftedLoss, directives: Sequence[ShardTensor], num_devices: int
) -> TrainingDAG:
    """Every `shard_tensor`, in turn, on one copy of `dag`."""
    if not directives:
        return dag
    dag = dag.copy()
    index = NodeIndex(dag.compute_nodes())
    for directive in directives:
        where = f"shard_tensor {filter_str(directive.filter)}"
        nodes = matched_nodes(dag, index, directive, num_devices, where)
        params = sorted({p for n in nodes for p in lifted.regions[n.region].param_ids})
        specs = specs_of(directive, lifted, params, len(directive.devices), where)
        for n in nodes:
            if n.param_layout.zero_level:
                raise DirectiveError(
                    f"{where}: {n} is also sharded by ZeRO (replicate with shard_grads or "
                    "shard_params); ZeRO and tensor parallelism do not combine yet"
                )
            mine = tuple(
                sorted((p, s) for p, s in specs.items() if p in lifted.regions[n.region].param_ids)
            )
            layout = dataclasses.replace(n.param_layout, tensor=mine)
            mesh = inner_mesh(n, directive.devices, where)
            dag.replace(dataclasses.replace(n, mesh=mesh, param_layout=layout))
    return dag
