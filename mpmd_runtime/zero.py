"""ZeRO layouts: a parameter, its gradient and its optimizer state as flat shards.

Note [ZeRO in piper-jax]
A group replicated with `shard_grads` (ZeRO-1/2) or `shard_params` (ZeRO-3) keeps, per
parameter, the flattened value padded to a multiple of R (the group's replica count) and
cut into R equal shards; replica i owns shard i. Each backward reduce-scatters its
weight gradients inside its own program (`psum_scatter` over the replica axis), so a
replica only ever accumulates its shard: gradient memory is 1/R (ZeRO-2; there is no
separate ZeRO-1 setting, since ZeRO-2 saves strictly more at the same communication
volume). The optimizer updates the owned shard with shard-shaped state (1/R), then:
ZeRO-2 all-gathers the updated shards into full replicated parameters; ZeRO-3 keeps
only the shards and all-gathers the full parameters inside every F and B program, so a
gathered parameter lives only as long as the program that uses it (residuals that are a
parameter itself are dropped by F and regathered by B, or by both BI and BW when the
backward is split; under `recompute` F keeps only the region's inputs and B gathers the
parameters to run the forward again). Flat shards
make the update elementwise-exact only for optimizers that treat every element alike
(sgd, adam, adamw, schedules ...), which `piper_jax.optimizer_check.plan_optimizer` verifies.

Note [one collective for many parameters]
A program that gathers, reduce-scatters or all-reduces many parameters does it as one
collective per dtype over their concatenation, not one per parameter (as FSDP's flat
parameters and DDP's buckets do). Collectives cost a fixed latency each (a rendezvous of
every device thread on CPU, a kernel launch and a ring set-up under NCCL), and a GPT
block has a dozen parameters, so per-parameter collectives were most of ZeRO-3's
overhead against pjit. The concatenation and the split back are local copies.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Sequence
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
import optax
from jax.sharding import Mesh
from jax.sharding import PartitionSpec as P
from piper_jax.mpmd_runtime.global_norm import CARRIER, with_carrier

AXIS = "r"
Shape = tuple[int, ...]


def shard_len(shape: Shape, replicas: int) -> int:
    return max(1, math.ceil(math.prod(shape) / replicas))


def to_shards(x: jax.Array | np.ndarray, replicas: int) -> Any:
    """Flatten, pad and cut into (replicas, shard_len) rows; works on numpy and jax."""
    xp = jnp if isinstance(x, jax.Array) else np
    flat = xp.ravel(x)
    k = shard_len(x.shape, replicas)
    return xp.pad(flat, (0, k * replicas - flat.size)).reshape(replicas, k)


def from_shards(rows: Any, shape: Shape) -> Any:
    """Inverse of `to_shards` for the full (replicas, shard_len) array."""
    return rows.reshape(-1)[: math.prod(shape)].reshape(shape)


def dtype_groups(xs: Sequence[jax.Array]) -> list[list[int]]:
    """Positions of `xs` grouped by dtype: values of one dtype share one collective."""
    groups: dict[Any, list[int]] = {}
    for i, x in enumerate(xs):
        groups.setdefault(x.dtype, []).append(i)
    return list(groups.values())


def split_columns(rows: jax.Array, widths: Sequence[int], axis: int = 1) -> list[jax.Array]:
    """Cut `rows` along `axis` into consecutive pieces of the given widths."""
    offsets = np.cumsum([0, *widths])
    return [jax.lax.slice_in_dim(rows, a, b, axis=axis) for a, b in zip(offsets[:-1], offsets[1:])]


def gather_all(shard_rows: Sequence[jax.Array], shapes: Sequence[Shape]) -> list[jax.Array]:
    """Inside shard_map: each replica's (1, k) shards -> the full parameters, with one
    all-gather per dtype for all of them (Note [one collective for many parameters])."""
    out: list[Any] = [None] * len(shard_rows)
    for idx in dtype_groups(shard_rows):
        flat = jnp.concatenate([shard_rows[i][0] for i in idx])
        rows = jax.lax.all_gather(flat, AXIS)  # (R, sum of k)
        widths = [shard_rows[i].shape[-1] for i in idx]
        for i, part in zip(idx, split_columns(rows, widths)):
            out[i] = from_shards(part, shapes[i])
    return out


def scatter_all(grads: Sequence[jax.Array], replicas: int) -> list[jax.Array]:
    """Inside shard_map: this replica's full gradients -> its (1, k) shards of their sums
    over the replicas, with one reduce-scatter per dtype."""
    out: list[Any] = [None] * len(grads)
    for idx in dtype_groups(grads):
        parts = [to_shards(grads[i], replicas) for i in idx]
        rows = jnp.concatenate(parts, axis=1)  # (R, sum of k)
        mine = jax.lax.psum_scatter(rows, AXIS, scatter_dimension=0, tiled=True)
        for i, part in zip(idx, split_columns(mine, [p.shape[1] for p in parts])):
            out[i] = part
    return out


def _own_shard(full: jax.Array, replicas: int) -> jax.Array:
    rows = to_shards(full, replicas)
    return jax.lax.dynamic_index_in_dim(rows, jax.lax.axis_index(AXIS), keepdims=False)


def init_program(
    optimizer: optax.GradientTransformation, mesh: Mesh, stage: int, carrier: bool = False
) -> Callable:
    """Optimizer state of the owned shards, stacked over replicas."""
    replicas = mesh.size

    def local(params: dict) -> Any:
        if stage == 3:
            shards = {n: p[0] for n, p in params.items()}
        else:
            shards = {n: _own_shard(p, replicas) for n, p in params.items()}
        if carrier:
            shards[CARRIER] = jnp.zeros((), jnp.float32)
        return jax.tree.map(lambda x: jnp.expand_dims(x, 0), optimizer.init(shards))

    in_spec = P(AXIS) if stage == 3 else P()
    return jax.jit(
        jax.shard_map(local, mesh=mesh, in_specs=(in_spec,), out_specs=P(AXIS), check_vma=False)
    )


def update_program(
    optimizer: optax.GradientTransformation,
    mesh: Mesh,
    stage: int,
    shapes: dict[str, Shape],
    carrier: bool = False,
) -> Callable:
    """(params, grad shards, state[, total squared norm]) -> (params, state, zero
    accumulators), sharded; each replica's update sees its own shards (and the carrier)."""
    replicas = mesh.size

    def local(params: dict, grads: dict, state: Any, total_sq: Any = None) -> tuple:
        if stage == 3:
            shards = {n: p[0] for n, p in params.items()}
        else:
            shards = {n: _own_shard(p, replicas) for n, p in params.items()}
        grads = {n: g[0].astype(shards[n].dtype) for n, g in grads.items()}
        state = jax.tree.map(lambda x: x[0], state)
        if carrier:
            shards, grads = with_carrier(shards, grads, total_sq)
        updates, state = optimizer.update(grads, state, shards)
        shards = optax.apply_updates(shards, updates)
        shards.pop(CARRIER, None)
        if stage == 3:
            new_params = {n: s[None] for n, s in shards.items()}
        else:
            names = list(shards)
            full = gather_all([shards[n][None] for n in names], [shapes[n] for n in names])
            new_params = dict(zip(names, full))
        zeros = {n: jnp.zeros_like(s)[None] for n, s in shards.items()}
        return new_params, jax.tree.map(lambda x: jnp.expand_dims(x, 0), state), zeros

    param_spec = P(AXIS) if stage == 3 else P()
    mapped = jax.shard_map(
        local,
        mesh=mesh,
        in_specs=(param_spec, P(AXIS), P(AXIS)) + ((P(),) if carrier else ()),
        out_specs=(param_spec, P(AXIS), P(AXIS)),
        check_vma=False,
    )
    return jax.jit(mapped, donate_argnums=(0, 2))
