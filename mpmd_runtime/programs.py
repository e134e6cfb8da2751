"""The passes of a region as SPMD functions over its device group's mesh.

Note [replicas as a leading axis]
A device group's replicas run a region's pass once, as SPMD over the group's mesh
(`shard_map` over its `dp` axis). Per-replica values (activations, residuals, gradient
accumulators, the batch) are stacked on a leading axis of size dp sharded over `dp`;
parameters are replicated. So one dispatch serves all replicas, and a group of one
device is the same code with dp = 1.

Note [experts over ep]
In a `dp x ep` group every device of a replica's `ep` run takes its own rows of the
replica's batch, and the expert regions hold their experts split over `ep` too. Values
leave a region split by batch row, except an expert region's tokens (values laid out
(batch, experts, ...)), which leave split by expert. Tokens change layout only at the
DAG's ALL_TO_ALL nodes (directives/experts.py): a dispatch lays the tokens an expert pass
reads out by expert, a combine lays an expert pass's output out by row again (and their
mirror images carry the cotangents). Each is a sharding constraint at the start of its
reader's program, which XLA compiles into an all-to-all; so the tokens entering a region
are left as they come, and a fused overlap unit runs one microbatch's all-to-all beside
another's compute.

Note [residuals hold activations only]
F keeps for its backward what `jax.vjp` needs, except the region's parameters: a residual
leaf that *is* a parameter is dropped, and every backward pass takes the parameters as an
input and puts them back. So a pipeline holds activations only between F and B, never a
copy of the stage's weights per microbatch (which can be most of the memory), and a
ZeRO-3 backward can take freshly gathered parameters. Leaves computed from parameters and
constants alone (a weight cast to bf16, a mask, zeros) the backward computes itself (Note
[residuals from parameters alone] in ir/residuals.py).
"""

from __future__ import annotations

import functools
from collections.abc import Callable, Sequence
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
from jax.sharding import Mesh, NamedSharding
from jax.sharding import PartitionSpec as P
from piper_jax.ir.backward_split import split_backward
from piper_jax.ir.errors import PlanError
from piper_jax.ir.jax_compat import drop_noop_rounding, inline_checkpoints
from piper_jax.ir.layout import DP, EP, INNER_AXES, TP
from piper_jax.ir.lift import LiftedLoss, Region
from piper_jax.ir.residuals import CHEAP_PRIMITIVES, ResidualSplit, linearize_split
from piper_jax.ir.weight_products import swap_transposed_products, with_swapped_products

AXIS = DP


def group_mesh(
    devices: Sequence[jax.Device], axes: Sequence[tuple[str, int]] | None = None
) -> Mesh:
    """A jax Mesh of `devices` laid out over named `axes` (default: one `dp` axis)."""
    axes = list(axes or [(AXIS, len(devices))])
    shape = tuple(size for _, size in axes)
    return Mesh(np.array(list(devices)).reshape(shape), tuple(name for name, _ in axes))


def replicas(mesh: Mesh) -> int:
    """The data-parallel replicas of a group: the length of stacked per-replica values."""
    return mesh.shape[AXIS]


def inner_axis(mesh: Mesh) -> str | None:
    """The axis XLA partitions inside each replica (`tp` or `ep`), if the mesh has one."""
    return next((a for a in INNER_AXES if a in mesh.axis_names), None)


def stacked(mesh: Mesh) -> NamedSharding:
    return NamedSharding(mesh, P(AXIS))


def replicated(mesh: Mesh) -> NamedSharding:
    return NamedSharding(mesh, P())


def unstack(tree: Any) -> Any:
    return jax.tree.map(lambda x: x[0], tree)


def stack(tree: Any) -> Any:
    return jax.tree.map(lambda x: jnp.expand_dims(x, 0), tree)


def spmd(fn: Callable, mesh: Mesh, in_specs: tuple, out_specs: Any) -> Callable:
    """`fn` run once per replica of `mesh` (Note [replicas as a leading axis]); inside a
    replica, the other axes of the mesh (`tp`) stay for XLA to partition."""
    return jax.shard_map(
        fn,
        mesh=mesh,
        in_specs=in_specs,
        out_specs=out_specs,
        axis_names=frozenset({AXIS}),
        check_vma=False,
    )


def is_tokens(x: jax.Array, experts: int | None, lead: int = 0) -> bool:
    """Whether `x` holds tokens dispatched to experts: laid out (batch, experts, ...)
    after `lead` leading axes."""
    return bool(experts) and x.ndim >= lead + 2 and x.shape[lead + 1] == experts


def leaving(
    tree: Any,
    mesh: Mesh,
    experts: int | None = None,
    holds_experts: bool = False,
    entering: bool = False,
) -> Any:
    """Inside a replica: the layout of values leaving (or entering) a region.

    Over `tp` they are whole on every device (what another group receives or a cotangent
    it adds up), not split as XLA chose. Over `ep` they are split by batch row, each device
    working on its own tokens, except tokens leaving an expert region (`holds_experts`),
    which are split by expert; tokens entering are left as their ALL_TO_ALL laid them out
    (Note [experts over ep])."""
    axis = inner_axis(mesh)
    if axis is None:
        return tree
    width = mesh.shape[axis]

    def laid_out(x: jax.Array) -> jax.Array:
        if axis == TP:
            return jax.lax.with_sharding_constraint(x, P())
        if is_tokens(x, experts):
            if entering:
                return x
            if holds_experts:
                return jax.lax.with_sharding_constraint(x, P(None, EP))
        rows = x.ndim and x.shape[0] % width == 0
        return jax.lax.with_sharding_constraint(x, P(EP) if rows else P())

    return jax.tree.map(laid_out, tree)


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


def swaps_products(device: jax.Device) -> bool:
    """Whether backward passes on `device` write their weight gradients as direct
    products (Note [weight gradients as direct products]): on CPU devices."""
    return device.platform == "cpu"


def fences_residuals(device: jax.Device) -> bool:
    """Whether a forward and backward in one program pass the residuals through an
    optimization barrier (Note [a forward and its backward in one program] in
    scheduler.py): on CPU devices."""
    return device.platform == "cpu"


def pull_back(vjp: Callable, cotangents: Any, swap_products: bool) -> Any:
    """`vjp(cotangents)`, with its weight gradients as direct products if asked."""
    return with_swapped_products(vjp)(cotangents) if swap_products else vjp(cotangents)


# Note [keeping only what costs work]
# `jax.vjp` keeps every intermediate value its linear part reads: for a tanh-approximated
# GELU the pre-activation, its square and cube, the tanh and more, each as wide as the
# hidden layer. Within one jit XLA fuses those into the backward's kernels; between
# separate programs F writes each one and B reads it back, and a pipeline holds them for
# every microbatch in flight. `recompute(keep="costly")` keeps what costs work to compute
# (matrix products, divisions, transcendental functions, reductions, gathers, random
# bits) and has the backward recompute the cheap elementwise and layout work from those
# inside its own kernels (`jax.checkpoint` with a policy; no CSE barrier, as F and B are
# separate programs). The example GPT (d_model 128, 4 layers, 8 sequences of 128 per
# replica) then keeps 90 arrays of 45.2 MiB per microbatch instead of 157 of 100.8 MiB,
# with the same losses (85 and 133 since the backward computes what reads no activation,
# Note [residuals from parameters alone] in ir/residuals.py). Against a pjit step in the
# same runs its data-parallel step took 0.89x against 0.94x keeping everything, its
# ZeRO-3 step 1.02-1.04x against 1.01-1.03x (two runs).
# Recomputing divisions too (the softmax's) kept 37.2 MiB but made those steps 0.92x and
# 1.05x. Not the default: ZeRO-3 still pays a little, and it rests on few runs.
# Two things make a checkpointed region run as fast as it can: the backward's
# recomputation arrives as a `jax.checkpoint` equation, which `jax_compat.
# inline_checkpoints` opens so that the weight-gradient rewrite and the BI/BW cut see its
# products; and `jax.checkpoint` rounds every residual it saves to its own precision
# (`reduce_precision`, against excess precision in narrower types), which XLA:CPU ran as
# kernels of its own for float32 (5% of a ZeRO-3 step): the forward drops those
# (`jax_compat.drop_noop_rounding`).
def keeps_costly(prim: Any, *_: Any, **__: Any) -> bool:
    """A checkpoint policy: keep the output of every primitive but cheap elementwise and
    layout work (Note [keeping only what costs work])."""
    return prim.name not in CHEAP_PRIMITIVES


def with_recompute_policy(fn: Callable, keep: str) -> Callable:
    """`fn`, whose VJP keeps only its inputs and every matrix product's output when
    `keep` is "dots", everything but cheap elementwise and layout work when "costly";
    `fn` itself otherwise (under "inputs" the backward runs the whole forward again)."""
    if keep == "dots":
        return jax.checkpoint(fn, policy=jax.checkpoint_policies.dots_saveable)
    if keep == "costly":
        return jax.checkpoint(fn, policy=keeps_costly, prevent_cse=False)
    return fn


def linearize_region(
    region: Region,
    float_in: Sequence[bool],
    float_out: Sequence[bool],
    keep: str,
    params: list,
    batch: list,
    acts: list,
) -> tuple[list, Any]:
    """`region`'s outputs and the VJP of its float outputs (`float_out`) with respect to
    its parameters and float activation inputs (`float_in`), keeping what `keep` says
    (`with_recompute_policy`)."""

    def differentiable(p: list, fa: list) -> tuple[list, list]:
        it = iter(fa)
        outs = region.fn(p, batch, [next(it) if f else a for a, f in zip(acts, float_in)])
        return (
            [o for o, f in zip(outs, float_out) if f],
            [o for o, f in zip(outs, float_out) if not f],
        )

    float_acts = [a for a, f in zip(acts, float_in) if f]
    differentiable = with_recompute_policy(differentiable, keep)
    f_outs, vjp, i_outs = jax.vjp(differentiable, params, float_acts, has_aux=True)
    fi, ii = iter(f_outs), iter(i_outs)
    return [next(fi) if f else next(ii) for f in float_out], vjp


class RegionPrograms:
    """The passes of one region on one device group, as functions of global arrays.

    Each pass is a `shard_map` over the group's mesh; parameters come in replicated and
    whole (a ZeRO-3 group gathers them first), everything else stacked per replica. A
    weight-gradient pass adds its gradients to the accumulators it is given, or, given
    none (ZeRO), returns them for the reduce-scatter.

      forward(params, batch, acts)                  -> (outputs, residuals)
      forward_backward(params, batch, acts, cots[, acc]) -> (outputs, input cotangents,
                                                            acc or grads)
      evaluate(params, batch, acts)                 -> outputs
      backward(params, residuals, cots[, acc])      -> (input cotangents, acc or grads)
      backward_input(params, residuals, cots)       -> (input cotangents, cross values)
      backward_weight(params, residuals, cross[, acc]) -> acc or grads

    Under `recompute` ("inputs") the residuals are the region's inputs and the backward
    runs the forward again; keeping "dots", they are the inputs and every matrix
    product's output, and the backward recomputes the elementwise work between them.
    See Note [residuals hold activations only] and, for `ep` groups, Note [experts over
    ep].
    """

    def __init__(
        self,
        region: Region,
        lifted: LiftedLoss,
        mesh: Mesh,
        loss_seed: float,
        keep: str,
        experts: int | None = None,
        holds_experts: bool = False,
    ):
        self.region, self.lifted, self.mesh, self.experts = region, lifted, mesh, experts
        self.holds_experts = holds_experts
        self.loss_seed, self.keep = loss_seed, keep  # "", or a recompute directive's keep
        self.recompute = keep == "inputs"  # the backward runs the whole forward again
        self.swap_products = swaps_products(mesh.devices.flat[0])
        self.fence_residuals = fences_residuals(mesh.devices.flat[0])
        self.float_in = [
            lifted.regions[a.region].out_is_float(a.position) for a in region.act_inputs
        ]
        self.float_out = [region.out_is_float(i) for i in range(len(region.out_shapes))]
        self.sources = cotangent_sources(lifted, region)
        self.consumers = sorted({c for src in self.sources for c, _ in src})
        self._shapes = [jax.ShapeDtypeStruct(s, d) for s, d in region.in_shapes]
        self._structure: ResidualSplit | None = None  # _residual_structure
        rep, per = P(), P(AXIS)
        self.forward = spmd(self._forward, mesh, (rep, per, per), (per, per))
        self.evaluate = spmd(self._evaluate, mesh, (rep, per, per), per)
        self.backward = {
            acc: spmd(self._backward, mesh, (rep, per, per) + ((per,) if acc else ()), (per, per))
            for acc in (True, False)
        }
        self.forward_backward = {
            acc: spmd(
                self._forward_backward,
                mesh,
                (rep, per, per, per) + ((per,) if acc else ()),
                (per, per, per),
            )
            for acc in (True, False)
        }
        self.backward_input = spmd(self._backward_input, mesh, (rep, per, per), (per, per))
        self.backward_weight = {
            acc: spmd(self._backward_weight, mesh, (rep, per, per) + ((per,) if acc else ()), per)
            for acc in (True, False)
        }

    # ---- residual structure, found once while tracing the forward ---------------------

    def _residual_structure(self) -> ResidualSplit:
        """How the VJP's leaves reach the backward (Note [residuals hold activations
        only], Note [residuals from parameters alone]). The forward's trace records it
        (tracing the region's VJP is a good part of a program's build: 0.28 s of a small
        GPT's 3.4 s to its first step); a backward or a BI/BW split
        traced before it traces the forward abstractly for it, as the forward's program:
        which residuals a VJP holds can depend on where it is traced (a `jax.checkpoint`
        traced bare kept a scalar as a constant that it kept as a residual inside
        `shard_map`)."""
        if self._structure is None:
            n_p, n_b = len(self.region.param_ids), len(self.region.batch_ids)
            width = replicas(self.mesh)
            s = self._shapes
            per = [jax.ShapeDtypeStruct((width, *x.shape), x.dtype) for x in s[n_p:]]
            jax.eval_shape(self.forward, s[:n_p], per[:n_b], per[n_b:])
        assert self._structure is not None
        return self._structure

    def _linearize_recorded(self, params: list, batch: list, acts: list) -> tuple[list, list]:
        """`_linearize`'s outputs and the residuals F keeps, recording the residual
        structure on first use and checking it on every later one (a backward built for
        another structure would read the wrong residuals)."""
        # a checkpoint policy's rounding (Note [keeping only what costs work])
        rewrite = drop_noop_rounding if self.keep else None
        outs, leaves, split = linearize_split(self._linearize, params, batch, acts, rewrite)
        if self._structure is None:
            self._structure = split
        elif split.avals != self._structure.avals:
            raise PlanError(
                f"region {self.region.index}: its forward keeps {len(split.avals)} residual "
                f"arrays where its backward was built for {len(self._structure.avals)}; please "
                "report this model (piper-jax traced the forward's VJP two different ways)"
            )
        return outs, self._structure.kept(leaves, batch)

    def _leaves(self, params: list, kept: list) -> list:
        return self._residual_structure().leaves(params, kept)

    # ---- per-replica functions (inside shard_map every stacked value has leading axis 1)

    def _linearize(self, params: list, batch: list, acts: list) -> tuple[list, Any]:
        return linearize_region(
            self.region, self.float_in, self.float_out, self.keep, params, batch, acts
        )

    def _seeds(self, cots: list) -> list:
        """The cotangent of each float output: consumers' contributions plus the loss seed.
        `cots` holds one list per consumer region, in `self.consumers` order."""
        by_consumer = dict(zip(self.consumers, cots))
        seeds = []
        for i, is_float in enumerate(self.float_out):
            if not is_float:
                continue
            shape, dtype = self.region.out_shapes[i]
            total = jnp.zeros(shape, dtype)
            if i == self.region.loss_position:
                total = total + jnp.asarray(self.loss_seed, dtype)
            for c, j in self.sources[i]:
                total = total + by_consumer[c][j]
            seeds.append(total)
        return seeds

    def _laid_out(self, tree: Any) -> Any:
        return leaving(tree, self.mesh, self.experts, self.holds_experts)

    def _entering(self, batch: list, acts: list) -> tuple[list, list]:
        return leaving(unstack(batch), self.mesh), leaving(
            unstack(acts), self.mesh, self.experts, entering=True
        )

    def _forward(self, params: list, batch: list, acts: list) -> tuple:
        batch, acts = self._entering(batch, acts)
        if self.recompute:
            outs = self.region.fn(params, batch, acts)
            return stack(self._laid_out(outs)), stack((batch, acts))
        outs, kept = self._linearize_recorded(params, batch, acts)
        return stack(self._laid_out(outs)), stack(kept)

    def _evaluate(self, params: list, batch: list, acts: list) -> list:
        batch, acts = self._entering(batch, acts)
        return stack(self._laid_out(self.region.fn(params, batch, acts)))

    def _vjp(self, params: list, res: Any) -> Any:
        if self.recompute:
            batch, acts = unstack(res)
            return self._linearize(params, batch, acts)[1]
        return jax.tree.unflatten(
            self._residual_structure().treedef, self._leaves(params, unstack(res))
        )

    def _backward(self, params: list, res: Any, cots: list, *acc: list) -> tuple:
        vjp = self._vjp(params, res)
        g_params, g_acts = pull_back(vjp, self._seeds(unstack(cots)), self.swap_products)
        return stack(self._laid_out(list(g_acts))), self._gradients(g_params, acc)

    def _forward_backward(
        self, params: list, batch: list, acts: list, cots: list, *acc: list
    ) -> tuple:
        batch, acts = self._entering(batch, acts)
        outs, vjp = self._linearize(params, batch, acts)
        if self.fence_residuals:
            vjp = jax.lax.optimization_barrier(vjp)
        g_params, g_acts = pull_back(vjp, self._seeds(unstack(cots)), self.swap_products)
        return (
            stack(self._laid_out(outs)),
            stack(self._laid_out(list(g_acts))),
            self._gradients(g_params, acc),
        )

    def _gradients(self, g_params: Sequence[Any], acc: tuple) -> list:
        if not acc:
            return stack(list(g_params))
        return [a + jnp.expand_dims(g.astype(a.dtype), 0) for a, g in zip(acc[0], g_params)]

    @functools.cached_property
    def _split(self) -> tuple[Callable, Callable, int]:
        """(BI, BW, number of cross values), cut from the backward jaxpr on first use."""
        assert not self.recompute, "recompute and the BI/BW split exclude each other"
        structure = self._residual_structure()
        treedef, avals = structure.treedef, list(structure.avals)
        seeds = [
            jax.ShapeDtypeStruct(*self.region.out_shapes[i])
            for i, f in enumerate(self.float_out)
            if f
        ]
        closed = jax.make_jaxpr(
            lambda leaves, s: jax.tree.leaves(jax.tree.unflatten(treedef, leaves)(s))
        )(avals, seeds)
        closed = inline_checkpoints(closed)  # its weight gradients apart from the rest
        if self.swap_products:
            closed = swap_transposed_products(closed)
        return split_backward(closed, len(self.region.param_ids), len(avals))

    def _backward_input(self, params: list, res: list, cots: list) -> tuple:
        bi, _, num_cross = self._split
        outs = bi(*self._leaves(params, unstack(res)), *self._seeds(unstack(cots)))
        n_acts = len(outs) - num_cross
        return stack(self._laid_out(outs[:n_acts])), stack(outs[n_acts:])

    def _backward_weight(self, params: list, res: list, cross: list, *acc: list) -> list:
        g_params = self._split[1](*self._leaves(params, unstack(res)), *unstack(cross))
        return self._gradients(g_params, acc)
