"""Gradient collectives: within one device group (a function fused into the group's
programs) and across several groups (programs on each group and on their union).

Within a group, gradients are stacked per replica (partial(dp)) and summed into
replicated totals, one collective per dtype for all of them (Note [one collective for
many parameters] in zero.py).

Across groups (a weight tied between stages, the global gradient norm), each group may
hold its gradients in its own layout: replicated totals, per-replica partial sums or
ZeRO shards, and of its own width. Every group first turns its contribution into
per-device partial rows of one flat vector (`contribution`), one program on the union of
the groups sums them, and each group takes its result back in its own layout (`result`).
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
from jax.sharding import Mesh, NamedSharding
from jax.sharding import PartitionSpec as P
from piper_jax.ir.layout import Placement
from piper_jax.mpmd_runtime import zero
from piper_jax.mpmd_runtime.programs import (
    AXIS,
    group_mesh,
    replicas,
    replicated,
    spmd,
    stacked,
)

Shape = tuple[int, ...]


def sum_replicas(xs: Sequence[jax.Array], mesh: Mesh) -> list[jax.Array]:
    """Per-replica partial sums (stacked over dp) -> replicated totals, as one `psum` of
    all of them (written per replica in a shard_map, which XLA compiles much faster than
    the same sum partitioned from global arrays). XLA combines its per-parameter
    all-reduces into one collective (on CPU too: a GPT's 52 become 2), so no concatenation
    and split are needed (Note [one collective for many parameters] in zero.py): those
    cost a GPT's gradient all-reduce 0.4 s of XLA:CPU compile of 0.5."""

    def per_replica(rows: list) -> list:
        return jax.lax.psum([r[0] for r in rows], AXIS)

    return spmd(per_replica, mesh, (P(AXIS),), P())(list(xs))


def contribution(
    xs: Sequence[jax.Array], shapes: Sequence[Shape], layouts: Sequence[Placement], mesh: Mesh
) -> jax.Array:
    """A group's gradients (of the given full shapes) -> (dp, N) float32 rows whose sum
    over the rows is the group's total, flattened and concatenated (N: total elements)."""
    width = replicas(mesh)
    rows = []
    for x, shape, layout in zip(xs, shapes, layouts):
        n = int(np.prod(shape))
        if layout is Placement.REPLICATED:  # every device holds the total: count it once
            flat = x.reshape(1, n).astype(jnp.float32) / width
            rows.append(jnp.broadcast_to(flat, (width, n)))
        elif layout is Placement.PARTIAL:
            rows.append(x.reshape(width, n).astype(jnp.float32))
        else:  # FLAT: replica i holds shard i of the total, at its place in the vector
            placed = jnp.eye(width, dtype=jnp.float32)[:, :, None] * x.astype(jnp.float32)[None]
            rows.append(placed.reshape(width, -1)[:, :n])
    out = jnp.concatenate(rows, axis=1) if rows else jnp.zeros((width, 0), jnp.float32)
    return device_rows(out, mesh)


def device_rows(rows: jax.Array, mesh: Mesh) -> jax.Array:
    """Per-replica rows (dp, N) -> one row per device (dp x tp or ep, N), same sum:
    the union program sums one row per device of every group it spans."""
    inner = mesh.size // replicas(mesh)
    if inner > 1:
        rows = jnp.repeat(rows / inner, inner, axis=0)
        return jax.lax.with_sharding_constraint(
            rows, NamedSharding(mesh, P(tuple(mesh.axis_names)))
        )
    return jax.lax.with_sharding_constraint(rows, stacked(mesh))


def result(
    total: jax.Array,
    shapes: Sequence[Shape],
    dtypes: Sequence[Any],
    layouts: Sequence[Placement],
    mesh: Mesh,
) -> list[jax.Array]:
    """The union's total flat vector -> the group's gradients: replicated totals, or its
    ZeRO shards (FLAT)."""
    out, offset = [], 0
    for shape, dtype, layout in zip(shapes, dtypes, layouts):
        n = int(np.prod(shape))
        part = total[offset : offset + n].astype(dtype)
        offset += n
        if layout is Placement.FLAT:
            out.append(
                jax.lax.with_sharding_constraint(
                    zero.to_shards(part, replicas(mesh)), stacked(mesh)
                )
            )
        else:
            out.append(jax.lax.with_sharding_constraint(part.reshape(shape), replicated(mesh)))
    return out


def flat_length(shapes: Sequence[Shape]) -> int:
    """N of `contribution` for gradients of these full shapes."""
    return sum(int(np.prod(s)) for s in shapes)


def union_sum_program(devices: Sequence[jax.Device]) -> tuple[Any, NamedSharding]:
    """The sum over the rows of (U, N) rows stacked over the union's devices, replicated
    on them; and the stacked input sharding."""
    mesh = group_mesh(devices)
    program = jax.jit(lambda rows: rows.sum(0), out_shardings=replicated(mesh))
    return program, NamedSharding(mesh, P(AXIS))
