"""The jitted XLA programs a plan runs: one per (region, pass, device group).

Note [replicas as a leading axis]
A device group of R devices runs a region's program once, as SPMD over a 1-D mesh with
axis "r" (`shard_map`). Per-replica values (activations, residuals, gradient
accumulators, the batch) are stacked on a leading axis of size R sharded over "r";
parameters and optimizer state are replicated. So one dispatch serves all replicas,
a SEND between groups of equal width is one `device_put`, and a group of one device is
the same code with R = 1.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from functools import partial
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
import optax
from jax.sharding import Mesh, NamedSharding
from jax.sharding import PartitionSpec as P
from piper_jax.ir.lift import LiftedLoss, Region

AXIS = "r"


def group_mesh(devices: Sequence[jax.Device]) -> Mesh:
    return Mesh(np.array(list(devices)), (AXIS,))


def stacked(mesh: Mesh) -> NamedSharding:
    return NamedSharding(mesh, P(AXIS))


def replicated(mesh: Mesh) -> NamedSharding:
    return NamedSharding(mesh, P())


def _unstack(tree: Any) -> Any:
    return jax.tree.map(lambda x: x[0], tree)


def _stack(tree: Any) -> Any:
    return jax.tree.map(lambda x: jnp.expand_dims(x, 0), tree)


def forward_program(region: Region, lifted: LiftedLoss, mesh: Mesh) -> Callable:
    """(params, batch, acts) -> (outputs, residuals), keeping the VJP for the backward."""
    float_in = [lifted.regions[a.region].out_is_float(a.position) for a in region.act_inputs]
    float_out = [region.out_is_float(i) for i in range(len(region.out_shapes))]

    def local(params: list, batch: list, acts: list) -> tuple:
        batch, acts = _unstack(batch), _unstack(acts)

        def differentiable(p: list, fa: list) -> tuple[list, list]:
            it = iter(fa)
            full = [next(it) if f else a for a, f in zip(acts, float_in)]
            outs = region.fn(p, batch, full)
            return (
                [o for o, f in zip(outs, float_out) if f],
                [o for o, f in zip(outs, float_out) if not f],
            )

        float_acts = [a for a, f in zip(acts, float_in) if f]
        f_outs, vjp, i_outs = jax.vjp(differentiable, params, float_acts, has_aux=True)
        fi, ii = iter(f_outs), iter(i_outs)
        outs = [next(fi) if f else next(ii) for f in float_out]
        return _stack(outs), _stack(vjp)

    mapped = jax.shard_map(
        local, mesh=mesh, in_specs=(P(), P(AXIS), P(AXIS)), out_specs=P(AXIS), check_vma=False
    )
    return jax.jit(mapped)


def cotangent_sources(lifted: LiftedLoss, region: Region) -> list[list[tuple[int, int]]]:
    """For each float output of `region`: the (consumer region, index into that consumer's
    input cotangents) pairs whose cotangents add up to it."""
    sources: list[list[tuple[int, int]]] = [[] for _ in region.out_shapes]
    for consumer in lifted.regions:
        floats = [
            a for a in consumer.act_inputs if lifted.regions[a.region].out_is_float(a.position)
        ]
        for j, ref in enumerate(floats):
            if ref.region == region.index:
                sources[ref.position].append((consumer.index, j))
    return sources


def backward_program(region: Region, lifted: LiftedLoss, mesh: Mesh, loss_seed: float) -> Callable:
    """(residuals, consumer cotangents, grad accumulators) -> (input cotangents, accumulators).

    The loss output is seeded with `loss_seed` = 1 / (microbatches * replicas), so summing
    the accumulated gradients over replicas gives the gradient of the mean loss.
    """
    sources = cotangent_sources(lifted, region)
    float_out = [i for i in range(len(region.out_shapes)) if region.out_is_float(i)]

    def local(vjp: Any, cots: dict, acc: list) -> tuple:
        vjp, cots = _unstack(vjp), _unstack(cots)
        seeds = []
        for i in float_out:
            shape, dtype = region.out_shapes[i]
            total = jnp.zeros(shape, dtype)
            if i == region.loss_position:
                total = total + jnp.asarray(loss_seed, dtype)
            for c, j in sources[i]:
                total = total + cots[c][j]
            seeds.append(total)
        g_params, g_acts = vjp(seeds)
        acc = [a + jnp.expand_dims(g.astype(a.dtype), 0) for a, g in zip(acc, g_params)]
        return _stack(list(g_acts)), acc

    mapped = jax.shard_map(
        local,
        mesh=mesh,
        in_specs=(P(AXIS), P(AXIS), P(AXIS)),
        out_specs=(P(AXIS), P(AXIS)),
        check_vma=False,
    )
    return jax.jit(mapped, donate_argnums=(2,))


def all_reduce_program(mesh: Mesh) -> Callable:
    """Sum per-device gradients over the mesh; the result is replicated on every member."""
    return jax.jit(lambda xs: [x.sum(0) for x in xs], out_shardings=replicated(mesh))


def update_program(optimizer: optax.GradientTransformation, mesh: Mesh) -> Callable:
    """(params, grads, opt_state) -> (params, opt_state, fresh zero accumulators)."""

    def update(params: dict, grads: dict, state: Any) -> tuple:
        grads = {k: g[0] if g.ndim == params[k].ndim + 1 else g for k, g in grads.items()}
        grads = {k: g.astype(params[k].dtype) for k, g in grads.items()}
        updates, state = optimizer.update(grads, state, params)
        params = optax.apply_updates(params, updates)
        return params, state, _zeros_like_stacked(params, mesh.size)

    return jax.jit(
        update,
        donate_argnums=(0, 2),
        out_shardings=(replicated(mesh), replicated(mesh), stacked(mesh)),
    )


def zeros_program(mesh: Mesh) -> Callable:
    return jax.jit(
        partial(_zeros_like_stacked, num_replicas=mesh.size), out_shardings=stacked(mesh)
    )


def _zeros_like_stacked(params: dict, num_replicas: int) -> dict:
    return {k: jnp.zeros((num_replicas,) + p.shape, p.dtype) for k, p in params.items()}
