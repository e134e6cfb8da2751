"""What one region's passes cost and keep, measured once, and a strategy's memory per device
estimated from them without devices: the inputs of `piper_jax.search` and `piper simulate`.

Note [timing a region's passes]
Each region's passes run on one device the way the runtime runs them: F keeps the VJP
residuals (less the parameters and what the backward computes again, Note [residuals
from parameters alone] in ir/residuals.py), B applies them to a cotangent for each float
output. They run at the per-replica microbatch size a strategy gives them, on the real
parameters and on activations that the earlier regions computed from the example batch.
Regions whose traced programs are the same (the middle blocks of a transformer) are
compiled and timed once. Each time is the fastest of a few runs after a warm-up run.
"""

from __future__ import annotations

import dataclasses
import functools
import time
from collections.abc import Callable, Mapping, Sequence
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
import optax
from flax import nnx

from piper_jax.ir.dag import NodeKind, TrainingDAG
from piper_jax.ir.jax_compat import drop_noop_rounding
from piper_jax.ir.lift import LiftedLoss, Region
from piper_jax.ir.residuals import linearize_split, nbytes
from piper_jax.mpmd_runtime.programs import linearize_region, pull_back, swaps_products
from piper_jax.mpmd_runtime.simulator import TimelineEvent, peak_activations
from piper_jax.rng import COUNTER_AVAL

Group = tuple[int, ...]
REPEATS = 5


@dataclasses.dataclass(frozen=True)
class RegionCost:
    """One region at one per-replica microbatch size.

    Attributes:
      forward, backward: seconds of its F and B (0 when not timed).
      residual_bytes: what one F keeps for its B.
      input_bytes: what one F keeps under `recompute` (its batch and activation inputs).
    """

    forward: float
    backward: float
    residual_bytes: int
    input_bytes: int


def _float_parts(region: Region, lifted: LiftedLoss) -> tuple[list[bool], list[bool]]:
    """Which activation inputs and which outputs of `region` are differentiated."""
    regions = lifted.regions
    float_in = [regions[a.region].out_is_float(a.position) for a in region.act_inputs]
    float_out = [region.out_is_float(i) for i in range(len(region.out_shapes))]
    return float_in, float_out


def _linearize(region: Region, lifted: LiftedLoss, keep: str = "") -> Callable:
    """(params, batch, acts) -> (outputs, the VJP of the float outputs), the VJP keeping
    what `keep` says (programs.with_recompute_policy)."""
    float_in, float_out = _float_parts(region, lifted)
    return functools.partial(linearize_region, region, float_in, float_out, keep)


def residual_bytes(region: Region, lifted: LiftedLoss, keep: str = "") -> int:
    """Bytes one F of `region` (at the shapes it was lifted at) keeps for its B (under
    `recompute` keeping "dots" when `keep` says so)."""
    shapes = [jax.ShapeDtypeStruct(s, d) for s, d in region.in_shapes]
    n_p, n_b = len(region.param_ids), len(region.batch_ids)
    kept: list[Any] = []
    rewrite = drop_noop_rounding if keep else None  # as the runtime's forward runs

    def probe(params: list, batch: list, acts: list) -> list:
        linearize = _linearize(region, lifted, keep)
        outs, _, split = linearize_split(linearize, params, batch, acts, rewrite)
        kept.extend(split.kept_avals)
        return outs

    jax.eval_shape(probe, shapes[:n_p], shapes[n_p : n_p + n_b], shapes[n_p + n_b :])
    return nbytes(kept)


def _passes(region: Region, lifted: LiftedLoss, swap: bool) -> tuple[Callable, Callable]:
    """`region`'s F and B as jitted functions, passing what the runtime's do: F returns
    its outputs and the residuals it keeps, B takes the parameters, those residuals and a
    cotangent per float output (its weight gradients as direct products if `swap`)."""
    splits = []

    def forward(params: list, batch: list, acts: list) -> tuple[Any, list]:
        outs, leaves, split = linearize_split(_linearize(region, lifted), params, batch, acts)
        splits.append(split)
        return outs, split.kept(leaves, batch)

    def backward(params: list, kept: list, cots: list) -> Any:
        split = splits[0]  # traced by the forward's first call
        vjp = jax.tree.unflatten(split.treedef, split.leaves(params, kept))
        return pull_back(vjp, cots, swap)

    return jax.jit(forward), jax.jit(backward)


def input_bytes(region: Region) -> int:
    """Bytes of a region's batch and activation inputs (what `recompute` keeps)."""
    inputs = region.in_shapes[len(region.param_ids) :]
    return nbytes([jax.ShapeDtypeStruct(s, d) for s, d in inputs])


def seconds_of(fn: Callable, *args: Any) -> tuple[float, Any]:
    """(the fastest of REPEATS runs of `fn(*args)` after a warm-up run, its result): the
    fastest is the run least disturbed by other work on the machine."""
    out = jax.block_until_ready(fn(*args))  # compiles
    best = float("inf")
    for _ in range(REPEATS):
        start = time.perf_counter()
        jax.block_until_ready(fn(*args))
        best = min(best, time.perf_counter() - start)
    return best, out


def measure_regions(
    lifted: LiftedLoss, param_leaves: Sequence[Any], batch_leaves: Sequence[Any], timed: bool
) -> dict[int, RegionCost]:
    """Every region's RegionCost at the batch size `lifted` was traced at (Note [timing a
    region's passes]); `batch_leaves` holds that many rows (and the random counter when
    the model draws). Untimed: sizes only, nothing compiled."""
    out: dict[int, RegionCost] = {}
    outputs: dict[int, list] = {}
    programs: dict[str, tuple[Callable, Callable, float, float]] = {}
    device = jax.devices()[0]
    for region in lifted.regions:
        sizes = (residual_bytes(region, lifted), input_bytes(region))
        if not timed:
            out[region.index] = RegionCost(0.0, 0.0, *sizes)
            continue
        params = [jax.device_put(param_leaves[i], device) for i in region.param_ids]
        batch = [jax.device_put(batch_leaves[i], device) for i in region.batch_ids]
        acts = [outputs[a.region][a.position] for a in region.act_inputs]
        key = str(jax.make_jaxpr(region.fn)(params, batch, acts))
        if key not in programs:
            forward, backward = _passes(region, lifted, swaps_products(device))
            f_time, (outs, kept) = seconds_of(forward, params, batch, acts)
            floats = [o for i, o in enumerate(outs) if region.out_is_float(i)]
            b_time, _ = seconds_of(backward, params, kept, [jnp.ones_like(o) for o in floats])
            programs[key] = (forward, backward, f_time, b_time)
        forward, _, f_time, b_time = programs[key]
        outputs[region.index] = forward(params, batch, acts)[0]
        out[region.index] = RegionCost(f_time, b_time, *sizes)
    return out


def measure_parallelism(
    lifted: LiftedLoss, param_leaves: Sequence[Any], batch_leaves: Sequence[Any], devices: int
) -> float:
    """How many devices' worth of work the first `devices` devices do at once: the first
    region's F on one device, against the same F on each of `devices` devices at once (one
    SPMD program over them). Real accelerators give about `devices`; virtual CPU devices
    that share a few cores give less (Note [how search predicts a strategy])."""
    region = lifted.regions[0]  # it reads parameters and the batch only
    every = jax.devices()[:devices]
    if len(every) < 2:
        return 1.0
    params = [param_leaves[i] for i in region.param_ids]
    batch = [np.asarray(batch_leaves[i]) for i in region.batch_ids]
    linearize = _linearize(region, lifted)
    alone, _ = seconds_of(jax.jit(lambda p, b: linearize(p, b, [])[0]), params, batch)
    mesh = jax.sharding.Mesh(np.array(every), ("dp",))
    rows, whole = jax.sharding.PartitionSpec("dp"), jax.sharding.PartitionSpec()
    spmd = jax.jit(
        jax.shard_map(
            lambda p, b: [o[None] for o in linearize(p, [x[0] for x in b], [])[0]],
            mesh=mesh,
            in_specs=(whole, rows),
            out_specs=rows,
            check_vma=False,
        )
    )
    stacked = [np.broadcast_to(x, (len(every), *x.shape)).copy() for x in batch]
    together, _ = seconds_of(spmd, params, stacked)
    return float(np.clip(len(every) * alone / together, 1.0, len(every)))


def batch_rows(batch_leaves: Sequence[Any], rows: int, random: bool) -> list[Any]:
    """The first `rows` rows of each batch leaf, plus the random counter when the model
    draws (Note [random keys of a step])."""
    leaves = [np.asarray(x)[:rows] for x in batch_leaves]
    if random:
        leaves.append(np.zeros(*COUNTER_AVAL))
    return leaves


def optimizer_costs(
    optimizer: optax.GradientTransformation, params: Any, timed: bool
) -> tuple[float, float]:
    """(seconds of one optimizer step over all of `params`, optimizer state bytes per
    parameter byte)."""
    state = jax.eval_shape(optimizer.init, params)
    ratio = nbytes(jax.tree.leaves(state)) / max(1, nbytes(jax.tree.leaves(params)))
    if not timed:
        return 0.0, ratio

    @jax.jit
    def update(params: Any, state: Any) -> Any:
        updates, state = optimizer.update(params, state, params)
        return optax.apply_updates(params, updates), state

    seconds, _ = seconds_of(update, params, optimizer.init(params))
    return seconds, ratio


def estimate_memory(
    dag: TrainingDAG,
    lifted: LiftedLoss,
    param_bytes: Sequence[int],
    state_ratio: float,
    timeline: list[TimelineEvent],
    kept_bytes: Mapping[int, int],
) -> dict[int, dict[str, int]]:
    """Estimated bytes per device of parameters, gradient accumulators, optimizer state
    and peak activations (the keys of `TrainStep.memory()`), without devices.

    Each group holds the parameters its regions read (ZeRO-3: 1/dp of them), gradient
    accumulators for them (ZeRO-2/3: 1/dp) and optimizer state of `state_ratio` bytes per
    parameter byte (ZeRO: 1/dp); its activations peak as the timeline's live (region,
    microbatch) sets, each weighing `kept_bytes[region]`. ZeRO-3's gathered parameters,
    programs' scratch space and the batch are not counted.
    """
    regions: dict[Group, set[int]] = {}
    layouts = {}
    for n in dag.compute_nodes():
        regions.setdefault(n.devices, set()).add(n.region)
        layouts[n.devices] = (n.mesh.size, n.param_layout.zero_level)
    peaks = peak_activations(timeline, sorted(regions), kept_bytes)
    table: dict[int, dict[str, int]] = {}
    for g, held in regions.items():
        width, level = layouts[g]
        params = {p for r in held for p in lifted.regions[r].param_ids}
        total = sum(param_bytes[p] for p in params)
        row = {
            "params": total // (width if level >= 3 else 1),
            "grads": total // (width if level >= 2 else 1),
            "opt_state": int(total * state_ratio) // (width if level >= 1 else 1),
            "activations": int(peaks[g]),
        }
        for d in g:
            table[d] = row
    return table


def update_share(dag: TrainingDAG, param_bytes: Sequence[int]) -> dict[int, float]:
    """Per UPD node (by region), the share of all parameter bytes it updates on each
    replica (ZeRO: 1/dp of its group's)."""
    total = max(1, sum(param_bytes))
    out = {}
    for n in dag.of_kind(NodeKind.UPD):
        width = n.mesh.size if n.param_layout.zero_level else 1
        out[n.region] = sum(param_bytes[p] for p in n.params) / total / width
    return out


def lowered_memory(
    lowered: Any, model: Any, optimizer: optax.GradientTransformation, timeline: list
) -> dict[int, dict[str, int]]:
    """`estimate_memory` of a `piper_jax.lower` result, each region sized at its device
    group's per-replica microbatch shape."""
    _, ratio = optimizer_costs(optimizer, nnx.state(model, nnx.Param), timed=False)
    kept = {}
    for n in lowered.dag.compute_nodes():
        if n.region in kept:
            continue
        lifted = lowered.lifts[n.devices]
        region = lifted.regions[n.region]
        if n.recompute == "inputs":
            kept[n.region] = input_bytes(region)
        else:
            kept[n.region] = residual_bytes(region, lifted, n.recompute)
    param_bytes = [int(np.asarray(x).nbytes) for x in lowered.param_leaves]
    return estimate_memory(lowered.dag, lowered.lifted, param_bytes, ratio, timeline, kept)
