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
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
import optax
from jax.sharding import Mesh, NamedSharding
from jax.sharding import PartitionSpec as P
from piper_jax.ir.backward_split import split_backward
from piper_jax.ir.lift import LiftedLoss, Region
from piper_jax.mpmd_runtime import zero
from piper_jax.mpmd_runtime.global_norm import CARRIER, square_norm, with_carrier

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


def cotangent_sources(lifted: LiftedLoss, region: Region) -> list[list[tuple[int, int]]]:
    """For each output of `region`: the (consumer region, index into that consumer's
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


def _shard(fn: Callable, mesh: Mesh, in_specs: tuple, out_specs: Any) -> Callable:
    return jax.shard_map(fn, mesh=mesh, in_specs=in_specs, out_specs=out_specs, check_vma=False)


def _accumulate(acc: list, grads: Sequence[Any]) -> list:
    return [a + jnp.expand_dims(g.astype(a.dtype), 0) for a, g in zip(acc, grads)]


class RegionPrograms:
    """The jitted programs of one region on one device group.

    Modes: "plain" (F keeps the VJP residuals, B applies them), "recompute" (F keeps
    nothing; B runs the forward again from the region's inputs), "split" (B is cut into
    BI and BW, see Note [why BW runs after BI, and reuses it]). `zero` is 0, 2 or 3:
    see Note [ZeRO in piper-jax] for how gradients and parameters are sharded; with
    zero=3 the backward takes the parameter shards as an extra first argument.
    """

    def __init__(
        self,
        region: Region,
        lifted: LiftedLoss,
        mesh: Mesh,
        loss_seed: float,
        mode: str = "plain",
        zero: int = 0,
    ):
        self.region, self.lifted, self.mesh, self.mode = region, lifted, mesh, mode
        self.loss_seed, self.zero = loss_seed, zero
        self.param_shapes = [s for s, _ in region.in_shapes[: len(region.param_ids)]]
        self._residual_layout: tuple[Any, dict[int, int], int] | None = None
        self.float_in = [
            lifted.regions[a.region].out_is_float(a.position) for a in region.act_inputs
        ]
        self.float_out = [region.out_is_float(i) for i in range(len(region.out_shapes))]
        self.sources = cotangent_sources(lifted, region)
        stacked3 = (P(AXIS), P(AXIS), P(AXIS))
        plain_params = (P(AXIS),) if zero == 3 else (P(),)
        # pass -> (shard_mapped per-replica function, index of its donated accumulators)
        self.mapped: dict[str, tuple[Callable, int | None]] = {}
        if mode == "recompute":
            self.mapped["F"] = (
                _shard(self._forward_only, mesh, plain_params + (P(AXIS), P(AXIS)), P(AXIS)),
                None,
            )
            self.mapped["B"] = (
                _shard(
                    self._recompute_backward,
                    mesh,
                    plain_params + stacked3 + (P(AXIS),),
                    (P(AXIS), P(AXIS)),
                ),
                4,
            )
        elif zero == 3:
            self.mapped["F"] = (_shard(self._forward, mesh, stacked3, P(AXIS)), None)
            self.mapped["B"] = (
                _shard(self._backward_gathered, mesh, stacked3 + (P(AXIS),), (P(AXIS), P(AXIS))),
                3,
            )
        else:
            self.mapped["F"] = (
                _shard(self._forward, mesh, plain_params + (P(AXIS), P(AXIS)), P(AXIS)),
                None,
            )
            self.mapped["B"] = (_shard(self._backward, mesh, stacked3, (P(AXIS), P(AXIS))), 2)
        if mode == "split":  # under ZeRO-3, BI and BW take the parameter shards first
            self._bi, self._bw = self._split_backward()
            extra = (P(AXIS),) if zero == 3 else ()
            self.mapped["BI"] = (
                _shard(self._backward_input, mesh, extra + (P(AXIS), P(AXIS)), (P(AXIS), P(AXIS))),
                None,
            )
            self.mapped["BW"] = (
                _shard(self._backward_weight, mesh, extra + stacked3, P(AXIS)),
                len(extra) + 2,
            )
        self._jitted = {
            name: jax.jit(fn, donate_argnums=() if donate is None else (donate,))
            for name, (fn, donate) in self.mapped.items()
        }
        self.forward, self.backward = self._jitted["F"], self._jitted["B"]

    def jitted(self, name: str) -> Callable:
        """The program of pass `name` (F, B, BI, BW) on its own."""
        return self._jitted[name]

    # ---- per-replica functions (inside shard_map every value has a leading axis 1) ----

    def _linearize(self, params: list, batch: list, acts: list) -> tuple[list, Any]:
        def differentiable(p: list, fa: list) -> tuple[list, list]:
            it = iter(fa)
            full = [next(it) if f else a for a, f in zip(acts, self.float_in)]
            outs = self.region.fn(p, batch, full)
            return (
                [o for o, f in zip(outs, self.float_out) if f],
                [o for o, f in zip(outs, self.float_out) if not f],
            )

        float_acts = [a for a, f in zip(acts, self.float_in) if f]
        f_outs, vjp, i_outs = jax.vjp(differentiable, params, float_acts, has_aux=True)
        fi, ii = iter(f_outs), iter(i_outs)
        return [next(fi) if f else next(ii) for f in self.float_out], vjp

    def _seeds(self, cots: dict) -> list:
        """The cotangent of each float output: consumers' contributions plus the loss seed."""
        seeds = []
        for i, is_float in enumerate(self.float_out):
            if not is_float:
                continue
            shape, dtype = self.region.out_shapes[i]
            total = jnp.zeros(shape, dtype)
            if i == self.region.loss_position:
                total = total + jnp.asarray(self.loss_seed, dtype)
            for c, j in self.sources[i]:
                total = total + cots[c][j]
            seeds.append(total)
        return seeds

    def _forward(self, params: list, batch: list, acts: list) -> tuple:
        if self.zero != 3:
            outs, vjp = self._linearize(params, _unstack(batch), _unstack(acts))
            return _stack(outs), _stack(vjp)
        full = self._full_params(params)
        outs, vjp = self._linearize(full, _unstack(batch), _unstack(acts))
        leaves, treedef = jax.tree.flatten(vjp)
        slots = {j: i for j, leaf in enumerate(leaves) for i, f in enumerate(full) if leaf is f}
        self._residual_layout = (treedef, slots, len(leaves))
        kept = [leaf for j, leaf in enumerate(leaves) if j not in slots]
        return _stack(outs), _stack(kept)

    def _regathered(self, params: list, kept: list) -> list:
        """ZeRO-3: the VJP residual leaves of F, with the parameters it dropped gathered
        again from their shards."""
        assert self._residual_layout is not None, "F runs (and is traced) before B"
        _, slots, n = self._residual_layout
        full = self._full_params(params)
        rest = iter(_unstack(kept))
        return [full[slots[j]] if j in slots else next(rest) for j in range(n)]

    def _backward_gathered(self, params: list, kept: list, cots: dict, acc: list) -> tuple:
        """ZeRO-3 backward: regather the parameters F dropped from its residuals."""
        treedef = self._residual_layout[0]
        vjp = jax.tree.unflatten(treedef, self._regathered(params, kept))
        g_params, g_acts = vjp(self._seeds(_unstack(cots)))
        return _stack(list(g_acts)), self._accumulate(acc, g_params)

    def _accumulate(self, acc: list, grads: Sequence[Any]) -> list:
        if self.zero:
            shards = zero.scatter_all(
                [g.astype(a.dtype) for a, g in zip(acc, grads)], self.mesh.size
            )
            return [a + s for a, s in zip(acc, shards)]
        return _accumulate(acc, grads)

    def _full_params(self, params: list) -> list:
        """The region's full parameters: all-gathered from the shards under ZeRO-3."""
        return zero.gather_all(params, self.param_shapes) if self.zero == 3 else params

    def _forward_only(self, params: list, batch: list, acts: list) -> list:
        full = self._full_params(params)
        return _stack(self.region.fn(full, _unstack(batch), _unstack(acts)))

    def _backward(self, vjp: Any, cots: dict, acc: list) -> tuple:
        g_params, g_acts = _unstack(vjp)(self._seeds(_unstack(cots)))
        return _stack(list(g_acts)), self._accumulate(acc, g_params)

    def _recompute_backward(
        self, params: list, batch: list, acts: list, cots: dict, acc: list
    ) -> tuple:
        _, vjp = self._linearize(self._full_params(params), _unstack(batch), _unstack(acts))
        g_params, g_acts = vjp(self._seeds(_unstack(cots)))
        return _stack(list(g_acts)), self._accumulate(acc, g_params)

    def _split_backward(self) -> tuple[Callable, Callable]:
        shapes = [jax.ShapeDtypeStruct(s, d) for s, d in self.region.in_shapes]
        n_p, n_b = len(self.region.param_ids), len(self.region.batch_ids)
        _, vjp = jax.eval_shape(
            self._linearize, shapes[:n_p], shapes[n_p : n_p + n_b], shapes[n_p + n_b :]
        )
        seeds = [
            jax.ShapeDtypeStruct(*self.region.out_shapes[i])
            for i, f in enumerate(self.float_out)
            if f
        ]
        closed = jax.make_jaxpr(lambda v, s: jax.tree.leaves(v(s)))(vjp, seeds)
        bi, bw, self.num_cross = split_backward(closed, n_p, len(jax.tree.leaves(vjp)))
        return bi, bw

    def _residual_leaves(self, kept: tuple) -> list:
        """F's residual leaves from what BI/BW take first: (vjp,), or under ZeRO-3
        (parameter shards, residuals without the parameters)."""
        if self.zero == 3:
            return self._regathered(*kept)
        (vjp,) = kept
        return jax.tree.leaves(_unstack(vjp))

    def _backward_input(self, *args: Any) -> tuple:
        """(vjp, cots), or (params, kept, cots) under ZeRO-3 -> (input grads, cross)."""
        *kept, cots = args
        outs = self._bi(*self._residual_leaves(kept), *self._seeds(_unstack(cots)))
        n_acts = len(outs) - self.num_cross
        return _stack(outs[:n_acts]), _stack(outs[n_acts:])

    def _backward_weight(self, *args: Any) -> list:
        """(vjp, cross, acc), or (params, kept, cross, acc) under ZeRO-3 -> accumulators."""
        *kept, cross, acc = args
        g_params = self._bw(*self._residual_leaves(kept), *_unstack(cross))
        return self._accumulate(acc, g_params)


def all_reduce_program(mesh: Mesh, groups: int | None = None) -> Callable:
    """Sum per-device gradients stacked over `mesh`'s devices, as one collective per dtype
    over the concatenated gradients (Note [one collective for many parameters]).

    With `groups` None every device's value is summed and the result is replicated; with
    `groups` = G the devices are G equal groups of ZeRO shards, summed over groups row by
    row, and device i of every group keeps row i.
    """
    keep_rows = groups is not None  # ZeRO: every device keeps its row, even of width 1
    if groups is None:
        groups, out_sharding = mesh.size, replicated(mesh)
    else:
        grid = Mesh(mesh.devices.reshape(groups, mesh.size // groups), ("g", AXIS))
        out_sharding = NamedSharding(grid, P(AXIS))
    width = mesh.size // groups

    def reduce(xs: list) -> list:
        out: list[Any] = [None] * len(xs)
        for idx in zero.dtype_groups(xs):
            rows = [xs[i].reshape(groups, width, -1) for i in idx]
            total = jnp.concatenate(rows, axis=2).sum(0)  # (width, sum of sizes)
            for i, part in zip(idx, zero.split_columns(total, [r.shape[2] for r in rows], 1)):
                shape = ((width,) if keep_rows else ()) + xs[i].shape[1:]
                out[i] = part.reshape(shape)
        return out

    return jax.jit(reduce, out_shardings=out_sharding)


def update_program(
    optimizer: optax.GradientTransformation, mesh: Mesh, carrier: bool = False
) -> Callable:
    """(params, grads, opt_state[, total squared norm]) -> (params, opt_state, zero
    accumulators)."""

    def update(params: dict, grads: dict, state: Any, total_sq: Any = None) -> tuple:
        grads = {k: g[0] if g.ndim == params[k].ndim + 1 else g for k, g in grads.items()}
        grads = {k: g.astype(params[k].dtype) for k, g in grads.items()}
        if carrier:
            params, grads = with_carrier(params, grads, total_sq)
        updates, state = optimizer.update(grads, state, params)
        params = optax.apply_updates(params, updates)
        params.pop(CARRIER, None)
        return params, state, _zeros_like_stacked(params, mesh.size)

    return jax.jit(
        update,
        donate_argnums=(0, 2),
        out_shardings=(replicated(mesh), replicated(mesh), stacked(mesh)),
    )


def init_program(
    optimizer: optax.GradientTransformation, mesh: Mesh, carrier: bool = False
) -> Callable:
    def init(params: dict) -> Any:
        if carrier:
            params = {**params, CARRIER: jnp.zeros((), jnp.float32)}
        return optimizer.init(params)

    return jax.jit(init, out_shardings=replicated(mesh))


def square_norm_program(mesh: Mesh) -> Callable:
    """A group's summed squared gradients, spread evenly over its devices (R,) so that a
    sum over the devices of several groups gives the global squared norm."""

    def partial_sums(grads: list) -> jax.Array:
        return jnp.full((mesh.size,), square_norm(grads) / mesh.size)

    return jax.jit(partial_sums, out_shardings=stacked(mesh))


def _zeros_like_stacked(params: dict, num_replicas: int) -> dict:
    return {k: jnp.zeros((num_replicas,) + p.shape, p.dtype) for k, p in params.items()}
