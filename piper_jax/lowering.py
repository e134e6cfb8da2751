"""`lower`: from a model, loss and directive list to the training DAG and the per-group
plans, without building any XLA program; `compile` starts from here.

Note [lifting at each group's batch shape]
Shapes are baked into a traced jaxpr, so every region is lifted at the batch size one
replica sees: the global batch / (microbatches x the data-parallel width of the region's
device group). Groups of different widths (stage 0 over two devices, stage 1 on one)
see different sizes, so the loss is traced once per distinct width; the region
structure must not depend on the batch size (it is checked).
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable, Mapping, Sequence
from typing import Any

import flax
import jax
import numpy as np
import optax
from flax import nnx

from piper_jax.annotate import reset_annotation_counters
from piper_jax.batching import check_batch_size
from piper_jax.directives import apply_directives, check_directives, num_microbatches
from piper_jax.directives.gradients import insert_updates
from piper_jax.directives.order import check_overlap_units
from piper_jax.directives.types import Replicate
from piper_jax.ir import build_dag, lift
from piper_jax.ir.dag import NodeKind, TrainingDAG
from piper_jax.ir.errors import AnnotationError, BatchError, DirectiveError, PiperError, PlanError
from piper_jax.ir.layout import DP, group_str
from piper_jax.ir.lift import LiftedLoss
from piper_jax.mpmd_runtime.buffers import value_avals
from piper_jax.mpmd_runtime.instructions import SEND
from piper_jax.mpmd_runtime.plans import Plans, compile_plans
from piper_jax.mpmd_runtime.simulator import Simulation, simulate
from piper_jax.mpmd_runtime.timeline import write_timeline
from piper_jax.optimizer_check import plan_optimizer
from piper_jax.param_tree import ParamTree, leaf_name
from piper_jax.rng import COUNTER_AVAL, COUNTER_NAME, RandomState
from piper_jax.validation import check_model_args

Group = tuple[int, ...]
NONFINITE = ("raise", "skip", "ignore")


def _leaves(tree: Any) -> tuple[list[str], list[Any], Any]:
    leaves, treedef = jax.tree_util.tree_flatten_with_path(tree)
    return [leaf_name(path) for path, _ in leaves], [leaf for _, leaf in leaves], treedef


@dataclasses.dataclass(frozen=True)
class BatchSpec:
    """The global batch a step was compiled for (`random`: the model draws random
    numbers, so the lifted loss takes one more batch leaf, the counter of Note [random
    keys of a step])."""

    treedef: Any
    names: list[str]
    avals: list[tuple[tuple[int, ...], Any]]
    size: int
    num_microbatches: int
    random: bool = False


@dataclasses.dataclass(frozen=True)
class Lowered:
    """A strategy lowered to its DAG and plans (no XLA programs): inspect, simulate.

    Attributes:
      dag: the training DAG after every directive.
      plans: the per-device-group plans.
      lifted: the regions of the loss (traced at the first group's batch shape).
      lifts: the regions traced at each group's per-replica batch shape.
      carrier: the updates need the global-norm carrier (clip by global norm).
      evaluation: lowers the same strategy with forward passes only and the model in
        eval mode (`model.eval()`: no dropout), for `TrainStep.evaluate`.
    """

    dag: TrainingDAG
    plans: Plans
    lifted: LiftedLoss
    lifts: dict[Group, LiftedLoss]
    carrier: bool
    batch: BatchSpec
    model_parts: tuple
    param_tree: ParamTree
    param_leaves: list[Any]
    evaluation: Callable[[], Lowered]

    def simulate(
        self,
        costs: Mapping[str, float] | None = None,
        transfer_latency: float = 0.0,
        processes: Mapping[int, int] | None = None,
        host_shares_core: bool = False,
    ) -> Simulation:
        """Run the plans on a cost model (default unit costs F=1, B=2); `processes` (the
        process of each device index, default all in one) makes transfers between
        processes wait for both sides, as they run; `host_shares_core`: each process's
        host issues its steps on its devices' cores (CPU devices; see simulator.simulate).

        Returns a Simulation with .step_time, .bubble_fraction, .peak_activations (per
        device group, in microbatch-activation units) and .timeline.
        """
        costs = costs or {"F": 1, "B": 2}
        return simulate(self.plans, costs, transfer_latency, processes, host_shares_core)

    def timeline(self, path: str, costs: Mapping[str, float] | None = None) -> None:
        """Write the simulated plans as a PNG Gantt chart, or a Chrome/Perfetto trace if
        `path` ends in .json."""
        write_timeline(self.simulate(costs).timeline, path, title="simulated", time_unit_us=1000.0)

    def explain(self) -> str:
        """Regions, their placement and layouts, and each device group's plan."""
        meshes = {n.region: n.mesh for n in self.dag.compute_nodes()}
        layouts = {n.region: n.param_layout for n in self.dag.compute_nodes()}
        lines = ["regions:"]
        for r in self.lifted.regions:
            line = (
                f"  region {r.index} {r}: {len(r.param_ids)} params, on {meshes[r.index]}; "
                f"{layouts[r.index]}"
            )
            if layouts[r.index].holds_experts:
                line += (
                    "; its tokens come (dispatch) and go (combine) by all-to-all over ep "
                    "(the ALL_TO_ALL steps of its plan)"
                )
            keep = self.plans.recompute.get(r.index)
            if keep:
                what = "its inputs" if keep == "inputs" else "its inputs and matmul outputs"
                line += f"; recomputed: F keeps {what} for B"
            lines.append(line)
        lines.append("plan grid (rows: replay rounds, columns: device groups; a + b: one program):")
        lines.append(self.plans.grid())
        for g, steps in sorted(self.plans.steps.items()):
            lines.append(f"plan {group_str(g)}: " + "; ".join(str(s) for s in steps))
        return "\n".join(lines)


def lower(
    loss_fn: Callable[[nnx.Module, Any], jax.Array],
    model: nnx.Module,
    optimizer: optax.GradientTransformation,
    example_batch: Any,
    directives: Sequence[Any] = (),
    num_devices: int | None = None,
    *,
    nonfinite: str = "raise",
    fuse_collectives: bool = True,
    fuse_passes: bool | None = None,
    forward_only: bool = False,
) -> Lowered:
    """The DAG and per-device-group plans of a strategy, without devices or programs.

    Args:
      loss_fn, model, optimizer, example_batch, directives: as for `piper_jax.compile`.
      num_devices: how many devices directive indices may name; default the local count.
      nonfinite: "raise" or "skip" add the non-finite gradient guard (see `compile`);
        "ignore" leaves it out.
      fuse_collectives: run each ZeRO collective inside the program of the pass it serves
        (one step `ALL_GATHER param[F0.3] + F0.3`); False keeps them as steps of their own.
      fuse_passes: run a region's backward in one program with its forward of the same
        microbatch where a group runs one right after the other (one step `F0.3 + B0.3`);
        default: on GPUs and TPUs (`jax.default_backend()`), not on XLA:CPU, where the
        separate programs ran faster.
      forward_only: lower the forward passes only (evaluation: no backward, no update).

    Returns:
      A Lowered: .dag, .plans, .explain(), .simulate(costs), .timeline(path).
    """
    if nonfinite not in NONFINITE:
        raise PiperError(f"nonfinite={nonfinite!r}: use one of {', '.join(NONFINITE)}")
    check_model_args(loss_fn, model, optimizer, example_batch)
    num_devices = jax.device_count() if num_devices is None else num_devices
    directives = check_directives(directives)
    m = num_microbatches(directives)
    graphdef, params, random_state, rest = nnx.split(model, nnx.Param, nnx.RngState, ...)
    random = RandomState(random_state)
    param_names, param_leaves, param_treedef = _leaves(params)
    batch_names, batch_leaves, batch_treedef = _leaves(example_batch)
    size = check_batch_size(batch_leaves, batch_names, m, "example_batch", "num_microbatches")
    batch = BatchSpec(
        batch_treedef,
        batch_names,
        [(np.shape(x), np.asarray(x).dtype) for x in batch_leaves],
        size,
        m,
        bool(random),
    )

    def flat_loss(p_leaves: list, b_leaves: list) -> jax.Array:
        """The loss of flat parameter and batch leaves; with random state, the batch ends
        with its counter (Note [random keys of a step])."""
        p = jax.tree_util.tree_unflatten(param_treedef, p_leaves)
        rngs = random.state(b_leaves.pop()) if random else random_state
        b = jax.tree_util.tree_unflatten(batch_treedef, b_leaves)
        return loss_fn(nnx.merge(graphdef, p, rngs, rest), b)

    @_cached_by_width
    def lift_at(width: int) -> LiftedLoss:
        return _lift(flat_loss, param_leaves, param_names, batch, width)

    first_width = next((len(d.devices) for d in directives if isinstance(d, Replicate)), 1)
    if size % (m * first_width):
        first_width = 1
    lifted = lift_at(first_width)
    guard = nonfinite != "ignore" and not forward_only
    dag = apply_directives(
        build_dag(lifted, forward_only),
        lifted,
        directives,
        num_devices,
        global_norm=guard,
        forward_only=forward_only,
    )
    tree = ParamTree(params)
    upds = list(dag.of_kind(NodeKind.UPD))
    carrier = plan_optimizer(
        optimizer,
        tree,
        dict(zip(param_names, param_leaves)),
        [[param_names[p] for p in n.params] for n in upds],
        any(n.param_layout.zero_level for n in upds),
    )
    if carrier and not guard and not forward_only:
        dag = insert_updates(dag, lifted, global_norm=True)
    try:
        if fuse_passes is None:
            fuse_passes = jax.default_backend() != "cpu"
        plans = compile_plans(dag, lifted, fuse_collectives, fuse_passes)
    except PlanError:
        check_overlap_units(dag)  # explains the usual cause as a DirectiveError
        raise
    lifts = {g: lift_at(_width(plans, g, size, m)) for g in plans.steps}
    _check_transfers(plans, lifts)

    def evaluation() -> Lowered:
        evaluated = nnx.merge(graphdef, params, random_state, rest)
        evaluated.eval()
        return lower(
            loss_fn,
            evaluated,
            optimizer,
            example_batch,
            directives,
            num_devices,
            fuse_collectives=fuse_collectives,
            forward_only=True,
        )

    return Lowered(
        dag,
        plans,
        lifted,
        lifts,
        carrier,
        batch,
        (graphdef, param_treedef, random_state, rest),
        tree,
        param_leaves,
        evaluation,
    )


def _cached_by_width(fn: Callable[[int], LiftedLoss]) -> Callable[[int], LiftedLoss]:
    cache: dict[int, LiftedLoss] = {}

    def cached(width: int) -> LiftedLoss:
        if width not in cache:
            cache[width] = fn(width)
            first = next(iter(cache.values()))
            _check_same_regions(first, cache[width])
        return cache[width]

    return cached


def _lift(
    flat_loss: Callable, param_leaves: list, param_names: list[str], batch: BatchSpec, width: int
) -> LiftedLoss:
    local = batch.size // (batch.num_microbatches * width)
    avals = [((local,) + tuple(s[1:]), d) for s, d in batch.avals]
    names = list(batch.names)
    if batch.random:
        avals.append(COUNTER_AVAL)
        names.append(COUNTER_NAME)
    reset_annotation_counters()
    try:
        return lift(
            flat_loss,
            [jax.ShapeDtypeStruct(np.shape(x), np.asarray(x).dtype) for x in param_leaves],
            [jax.ShapeDtypeStruct(s, d) for s, d in avals],
            param_names,
            names,
        )
    except flax.errors.TraceContextError as err:
        raise AnnotationError(
            "the model changes state other than its nnx.Param and random streams while "
            "computing the loss (BatchNorm statistics, counters it keeps itself, ...): not "
            "supported yet; keep such state out of the training step, e.g. use "
            f"LayerNorm instead of BatchNorm ({err.__class__.__name__})"
        ) from err


def _check_same_regions(a: LiftedLoss, b: LiftedLoss) -> None:
    """Lifts at two batch sizes must cut the model alike (Note [lifting at each group's
    batch shape])."""
    same = len(a.regions) == len(b.regions) and all(
        (x.key, x.param_ids, x.batch_ids, x.act_inputs)
        == (y.key, y.param_ids, y.batch_ids, y.act_inputs)
        for x, y in zip(a.regions, b.regions)
    )
    if not same:
        raise AnnotationError(
            "the model's regions differ between batch sizes (traced for device groups of "
            "different data-parallel widths); make the annotated code independent of the "
            "batch size, or replicate every stage over the same number of devices"
        )


def _width(plans: Plans, g: Group, size: int, m: int) -> int:
    width = plans.meshes[g].axis_size(DP)
    if size % (m * width):
        raise BatchError(
            f"batch size {size} is not divisible by num_microbatches x the replicas of "
            f"device group {group_str(g)} = {m} x {width}; use a batch size that is a "
            f"multiple of {m * width}"
        )
    return width


def _check_transfers(plans: Plans, lifts: Mapping[Group, LiftedLoss]) -> None:
    """Between groups of different widths a value can only move if it is split along
    the batch (its leading axis scales with the per-replica batch)."""
    for g, plan in plans.plans.items():
        for ins in plan:
            if ins.op != SEND:
                continue
            peer = tuple(ins.peer)
            wa, wb = plans.meshes[g].axis_size(DP), plans.meshes[peer].axis_size(DP)
            if wa == wb:
                continue
            a = [s for s, _ in value_avals(lifts[g], ins.value)]
            b = [s for s, _ in value_avals(lifts[peer], ins.value)]
            for k, (sa, sb) in enumerate(zip(a, b)):
                if not sa or not sb or sa[0] * wa != sb[0] * wb or sa[1:] != sb[1:]:
                    raise DirectiveError(
                        f"{ins.value} (output {k}, per-replica shape {list(sa)}) moves from "
                        f"{group_str(g)} ({wa} replicas) to {group_str(peer)} ({wb} replicas), "
                        "but it has no batch axis to split between them; place the two "
                        "regions on groups of the same width, or move this value inside one "
                        "region"
                    )
