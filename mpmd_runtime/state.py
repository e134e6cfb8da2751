"""The state a device group keeps across steps: parameters, gradient accumulators and
optimizer state (Note [buffers of a device group]); and reading it back whole, on every
process, for `params()`, checkpoints and memory reports.
"""

from __future__ import annotations

import functools
from collections.abc import Callable, Mapping, Sequence
from typing import TYPE_CHECKING, Any

import jax
import numpy as np
from jax.experimental import multihost_utils
from jax.tree_util import keystr
from piper_jax.ir.errors import PiperError
from piper_jax.ir.layout import group_str
from piper_jax.mpmd_runtime import buffers as bf
from piper_jax.mpmd_runtime import opt_layout, zero
from piper_jax.mpmd_runtime import programs as pg
from piper_jax.mpmd_runtime.instructions import UPD
from piper_jax.mpmd_runtime.transport import host_to_group

if TYPE_CHECKING:
    from piper_jax.mpmd_runtime.executor import Runtime

Group = tuple[int, ...]
Avals = Mapping[str, tuple[tuple[int, ...], Any]]


def updates(rt: Runtime) -> list[tuple[int, Group]]:
    """(region, group) of every UPD, in region order."""
    return sorted(
        (int(i.value), g) for g, plan in rt.plans.plans.items() for i in plan if i.op == UPD
    )


def held(rt: Runtime, g: Group) -> list[str]:
    """The parameters group g holds: those its updates own."""
    return [n for r, h in updates(rt) if h == g for n in rt.ctx.names(rt.ctx.param_sets[f"UPD{r}"])]


def place_param(rt: Runtime, g: Group, name: str, value: Any) -> jax.Array:
    """A parameter's host value on group g: replicated, or as ZeRO-3 shards."""
    mesh = rt.meshes[g]
    if rt.ctx.zero_level[g] >= 3:
        return host_to_group(zero.to_shards(np.asarray(value), pg.replicas(mesh)), pg.stacked(mesh))
    return host_to_group(value, rt.param_sharding(g, name))


def init_state(rt: Runtime, values: Mapping[str, Any]) -> None:
    """Parameters, zero accumulators and optimizer state on every local group."""
    for g in rt.local:
        store, mesh, level = rt.stores[g], rt.meshes[g], rt.ctx.zero_level[g]
        width = pg.replicas(mesh)
        for name in held(rt, g):
            store[bf.param(name)] = place_param(rt, g, name, values[name])
            shape, dtype = rt.param_avals[name]
            rows = (width, zero.shard_len(shape, width)) if level >= 2 else (width, *shape)
            store[bf.acc(name)] = host_to_group(np.zeros(rows, dtype), rt.acc_sharding(g, name))
    for r, g in updates(rt):
        if g in rt.local:
            program = rt.update_program(r, g)
            rt.stores[g][bf.opt(r)] = program.init(
                [rt.stores[g][bf.param(n)] for n in program.names],
                rt.same_programs if rt.updates_held[g] > 1 else None,
            )


def host_value(rt: Runtime, g: Group, x: jax.Array) -> np.ndarray:
    """The whole of an array of group g on this host, also where it is stacked over
    devices of other processes (then the group replicates it in one program)."""
    if x.is_fully_addressable:
        return np.asarray(x)
    if x.sharding.is_fully_replicated:
        return np.asarray(x.addressable_shards[0].data)
    whole = _replicate_program(rt.meshes[g])(x)
    return np.asarray(whole.addressable_shards[0].data)


@functools.cache
def _replicate_program(mesh: Any) -> Callable:
    return jax.jit(lambda x: x, out_shardings=pg.replicated(mesh))


def host_param(rt: Runtime, g: Group, name: str) -> np.ndarray:
    """One parameter's full value on this host, read from group g."""
    value = host_value(rt, g, rt.stores[g][bf.param(name)])
    if rt.ctx.zero_level[g] >= 3:
        return zero.from_shards(value, rt.param_avals[name][0])
    return value


def _owner_process(rt: Runtime, g: Group) -> int:
    return min(d.process_index for d in rt.meshes[g].devices.flat)


def gather_params(rt: Runtime) -> dict[str, np.ndarray]:
    """Every parameter's current value on the host of every process."""
    owner: dict[str, tuple[int, Group]] = {}
    for r, g in updates(rt):
        process = _owner_process(rt, g)
        for name in rt.ctx.names(rt.ctx.param_sets[f"UPD{r}"]):
            owner[name] = min(owner.get(name, (process, g)), (process, g))
    # every process holding part of the owning group reads it (ZeRO-3 shards are read in
    # one program of the whole group), in the same order on every process
    local = {n: host_param(rt, g, n) for n, (_, g) in owner.items() if g in rt.local}
    return share(rt, {n: p for n, (p, _) in owner.items()}, local.__getitem__, rt.param_avals)


def optimizer_avals(rt: Runtime) -> dict[str, tuple[tuple[int, ...], Any]]:
    """{key path: (shape, dtype)} of `optimizer.init` of the whole model: the layout of
    `optimizer_state` (Note [portable optimizer state])."""
    return _state_avals(rt, list(rt.param_avals))


def _state_avals(rt: Runtime, names: Sequence[str]) -> dict[str, tuple[tuple[int, ...], Any]]:
    treedef, order = rt.param_tree(names, False)
    shapes = [jax.ShapeDtypeStruct(*rt.param_avals[n]) for n in order]
    tree = jax.tree_util.tree_unflatten(treedef, shapes)
    leaves = jax.tree_util.tree_flatten_with_path(jax.eval_shape(rt.optimizer.init, tree))
    return {keystr(path): (leaf.shape, leaf.dtype) for path, leaf in leaves[0]}


def optimizer_state(rt: Runtime) -> dict[str, np.ndarray]:
    """The optimizer state on the host of every process, in the single-device layout,
    keyed by key path (Note [portable optimizer state]). Refuses optimizers whose state
    does not split by parameter (e.g. optax.flatten keeps one vector per update), naming
    the leaf."""
    avals = optimizer_avals(rt)
    owners: dict[str, int] = {}
    for r, g in updates(rt):  # the same checks on every process
        process = _owner_process(rt, g)
        names = rt.ctx.names(rt.ctx.param_sets[f"UPD{r}"])
        for key, (shape, _) in _state_avals(rt, names).items():
            if key in avals and shape != avals[key][0]:
                raise _unportable(
                    key, f"is {list(shape)} on {group_str(g)}, not {list(avals[key][0])}"
                )
            owners[key] = min(owners.get(key, process), process)
    if owners.keys() != avals.keys():
        key = sorted(owners.keys() ^ avals.keys())[0]
        raise _unportable(key, "is not held by the updates of the parameter groups")
    local: dict[str, np.ndarray] = {}
    for r, g in updates(rt):
        if g not in rt.local:
            continue
        names = rt.ctx.names(rt.ctx.param_sets[f"UPD{r}"])
        full = opt_layout.to_full(
            rt.update_program(r, g).state_tree(rt.stores[g][bf.opt(r)]),
            {n: rt.param_avals[n][0] for n in names},
            rt.ctx.zero_level[g],
            lambda x, g=g: host_value(rt, g, x),
        )
        for key, value in full.items():
            if key in local and not _agree(local[key], value):
                raise _unportable(key, "differs between the parameter groups")
            local.setdefault(key, value)
    return share(rt, owners, local.__getitem__, avals)


def _agree(a: np.ndarray, b: np.ndarray) -> bool:
    """Whether two groups' copies of a leaf of a shared (tied) parameter's state are one
    value: equal up to rounding, as each group's update sees the global gradient norm
    summed in its own order (the carrier, global_norm.py), so under clip_by_global_norm
    the copies differ in the last bits. State kept across parameters differs by more."""
    scale = float(np.max(np.abs(a), initial=0.0))
    return a.shape == b.shape and bool(np.allclose(a, b, rtol=1e-5, atol=1e-5 * scale))


def _unportable(key: str, what: str) -> PiperError:
    return PiperError(
        f"optimizer state leaf {key} {what}: this optimizer keeps state across "
        "parameters, so it cannot be saved in the single-device layout"
    )


def load_state(
    rt: Runtime, params: Mapping[str, np.ndarray], opt_state: Mapping[str, np.ndarray]
) -> None:
    """Replace every parameter copy and the optimizer state with full-layout host values."""
    for g in rt.local:
        for name in held(rt, g):
            value = np.asarray(params[name], rt.param_avals[name][1])
            rt.stores[g][bf.param(name)] = place_param(rt, g, name, value)
    for r, g in updates(rt):
        if g not in rt.local:
            continue
        names = rt.ctx.names(rt.ctx.param_sets[f"UPD{r}"])
        program = rt.update_program(r, g)
        state = opt_layout.from_full(
            opt_state,
            program.state_tree(rt.stores[g][bf.opt(r)]),
            {n: rt.param_avals[n][0] for n in names},
            rt.ctx.zero_level[g],
            rt.meshes[g],
        )
        rt.stores[g][bf.opt(r)] = jax.tree.leaves(state)


def share(
    rt: Runtime, owners: Mapping[str, int], read: Callable[[str], np.ndarray], avals: Avals
) -> dict[str, np.ndarray]:
    """{key: value} on every process: each value is read on the process that `owners`
    names and broadcast from there to the others."""
    out: dict[str, np.ndarray] = {}
    for process in sorted(set(owners.values())):
        keys = [k for k, p in owners.items() if p == process]
        mine = jax.process_index() == process
        values = {k: read(k) if mine else np.zeros(*avals[k]) for k in keys}
        if jax.process_count() > 1:
            values = multihost_utils.broadcast_one_to_all(values, is_source=mine)
        out.update({k: np.asarray(v) for k, v in values.items()})
    return out


def memory(rt: Runtime, devices: Sequence[jax.Device]) -> dict[int, dict[str, int]]:
    """Bytes per local device (index into the step's devices) held in parameters,
    gradient accumulators and optimizer state between steps."""
    index = {d: i for i, d in enumerate(devices)}
    kinds = {"params": bf.Kind.PARAM, "grads": bf.Kind.ACC, "opt_state": bf.Kind.OPT}
    out: dict[int, dict[str, int]] = {}
    for g in rt.local:
        for b, value in rt.stores[g].items():
            kind = next((k for k, v in kinds.items() if v is b.kind), None)
            if kind is None:
                continue
            for array in jax.tree.leaves(value):
                for shard in array.addressable_shards:
                    row = out.setdefault(index[shard.device], dict.fromkeys(kinds, 0))
                    row[kind] += shard.data.nbytes
    return out
