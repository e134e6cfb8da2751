"""ZeRO layouts: a parameter, its gradient and its optimizer state as flat shards.

Note [ZeRO in piper-jax]
A group replicated with `shard_grads` (ZeRO level 2) or `shard_params` (level 3) keeps,
per parameter, the flattened value padded to a multiple of R (the group's replica count)
and cut into R equal shards; replica i owns shard i (layout flat(dp), Note [device groups
as named meshes]). Every backward is followed by a REDUCE_SCATTER of its gradients
(`psum_scatter` over dp), so a replica only ever accumulates its shard: gradient memory
is 1/R. The optimizer updates the owned shard with shard-shaped state (1/R), then level
2 all-gathers the updated shards into replicated parameters (ALL_GATHER param[UPD0]);
level 3 keeps only the shards and all-gathers the parameters before every pass
(ALL_GATHER param[F0.3]). The DAG pass that inserts these nodes is directives/zero.py;
the plan compiler fuses each into the program of the pass it serves, so a gathered
parameter lives only as long as that program (and, by Note [residuals hold activations
only], no residual keeps one). Flat shards make the update elementwise-exact only for
optimizers that treat every element alike (sgd, adam, adamw, schedules ...), which
`piper_jax.optimizer_check.plan_optimizer` verifies.

Note [one collective for many parameters]
A program that gathers or reduce-scatters many parameters either runs one collective per
parameter or one per dtype over their concatenation (as FSDP's flat parameters do). Each
collective costs a fixed latency (a rendezvous of every device thread on CPU, a launch and
a ring set-up under NCCL); the concatenation costs a copy in and a copy out per parameter,
and each of those copies is an XLA kernel of its own (its offset is part of its code), so
XLA:CPU compiles a kernel per parameter and program that per-parameter collectives do not
need. Which is cheaper depends on the mean parameter size, so a program's parameters
share one collective when they average under OWN_COLLECTIVE_MEAN elements. Measured on a
GPT of 52 parameters under ZeRO-3 on 4 CPU devices (2 cores), both steps in one process,
per-parameter against concatenated (medians of 8 rounds, each built first once): d_model
32 (1,136 elements a parameter on average) 1.14-1.15x the step time; d_model 64 (4,162)
0.99x; d_model 128 (15,886) 0.92-0.99x, with 2.3-2.9 s of XLA compile against 4.3 s;
d_model 256 (62,020) 0.94x. A group whose devices lie in more than one process
always shares one collective per dtype: there each collective is a round trip between
processes (gloo on CPU), and at d_model 128 over 2 processes of 2 devices a collective
per parameter made the step 2.0x slower. XLA:GPU combines per-parameter all-gathers and
reduce-scatters into one collective by itself; XLA:CPU combines only all-reduces, which
is why the gradient all-reduce of a replicated group is always one `psum` per parameter
(`collectives.sum_replicas`).
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
from piper_jax.ir.layout import DP

AXIS = DP
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


OWN_COLLECTIVE_MEAN = 2048


def own_collectives(shapes: Sequence[Shape], devices: Sequence[jax.Device]) -> bool:
    """Whether parameters of these shapes, gathered and reduce-scattered over `devices`,
    each get a collective of their own (Note [one collective for many parameters])."""
    one_process = len({d.process_index for d in devices}) == 1
    return one_process and sum(math.prod(s) for s in shapes) >= OWN_COLLECTIVE_MEAN * len(shapes)


def gather_all(
    shard_rows: Sequence[jax.Array], shapes: Sequence[Shape], own: bool
) -> list[jax.Array]:
    """Inside shard_map: each replica's (1, k) shards -> the full parameters, one
    all-gather per parameter (`own`) or per dtype (Note [one collective for many
    parameters])."""
    if own:
        return [from_shards(jax.lax.all_gather(r[0], AXIS), s) for r, s in zip(shard_rows, shapes)]
    out: list[Any] = [None] * len(shard_rows)
    for idx in dtype_groups(shard_rows):
        flat = jnp.concatenate([shard_rows[i][0] for i in idx])
        rows = jax.lax.all_gather(flat, AXIS)  # (R, sum of k)
        widths = [shard_rows[i].shape[-1] for i in idx]
        for i, part in zip(idx, split_columns(rows, widths)):
            out[i] = from_shards(part, shapes[i])
    return out


def scatter_all(grads: Sequence[jax.Array], replicas: int, own: bool) -> list[jax.Array]:
    """Inside shard_map: this replica's full gradients -> its (1, k) shards of their sums
    over the replicas, one reduce-scatter per parameter (`own`) or per dtype."""

    def scatter(rows: jax.Array) -> jax.Array:  # (R, k) -> this replica's (1, k) sum
        return jax.lax.psum_scatter(rows, AXIS, scatter_dimension=0, tiled=True)

    if own:
        return [scatter(to_shards(g, replicas)) for g in grads]
    out: list[Any] = [None] * len(grads)
    for idx in dtype_groups(grads):
        parts = [to_shards(grads[i], replicas) for i in idx]
        mine = scatter(jnp.concatenate(parts, axis=1))  # (1, sum of k)
        for i, part in zip(idx, split_columns(mine, [p.shape[1] for p in parts])):
            out[i] = part
    return out


def own_shard(full: jax.Array, replicas: int) -> jax.Array:
    """Inside shard_map: this replica's row of a replicated parameter's flat shards."""
    rows = to_shards(full, replicas)
    return jax.lax.dynamic_index_in_dim(rows, jax.lax.axis_index(AXIS), keepdims=True)
