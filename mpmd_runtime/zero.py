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
parameter itself are dropped by F and regathered by B). Flat shards make the update
elementwise-exact only for optimizers that treat every element alike (sgd, adam, adamw,
schedules ...), which `check_optimizer_separable` verifies.
"""

from __future__ import annotations

import math
from collections.abc import Callable
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


def gather_local(shard_row: jax.Array, shape: Shape) -> jax.Array:
    """Inside shard_map: this replica's (1, k) shard -> the full parameter."""
    return from_shards(jax.lax.all_gather(shard_row[0], AXIS, tiled=True), shape)


def scatter_local(grad: jax.Array, replicas: int) -> jax.Array:
    """Inside shard_map: this replica's full gradient -> its (1, k) shard of the sum."""
    flat = to_shards(grad, replicas).reshape(-1)
    return jax.lax.psum_scatter(flat, AXIS, scatter_dimension=0, tiled=True)[None]


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
            new_params = {
                n: from_shards(jax.lax.all_gather(s, AXIS, tiled=True), shapes[n])
                for n, s in shards.items()
            }
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
