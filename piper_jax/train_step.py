"""`compile` and `TrainStep`: from a model, loss and directive list to a runnable step."""

from __future__ import annotations

import os
import statistics
from collections.abc import Callable, Mapping, Sequence
from typing import Any

import flax
import jax
import numpy as np
import optax
from flax import nnx

from piper_jax import checkpoint
from piper_jax.annotate import reset_annotation_counters
from piper_jax.batching import check_batch_size
from piper_jax.directives import apply_directives, check_directives, num_microbatches
from piper_jax.directives.types import Replicate
from piper_jax.ir import attach_updates, build_dag, lift
from piper_jax.ir.dag import NodeKind, TrainingDAG, group_str
from piper_jax.ir.errors import AnnotationError, BatchError, DirectiveError
from piper_jax.ir.lift import LiftedLoss
from piper_jax.mpmd_runtime import Executor, Plans, compile_plans
from piper_jax.mpmd_runtime.simulator import Simulation, simulate
from piper_jax.mpmd_runtime.timeline import write_timeline
from piper_jax.mpmd_runtime.transport import check_same_plans
from piper_jax.optimizer_check import plan_optimizer
from piper_jax.validation import check_batch_leaves, check_compile_args

DEFAULT_STEP_TIMEOUT_S = 300.0


def _leaf_names(tree: Any) -> tuple[list[str], list[Any], Any]:
    leaves, treedef = jax.tree_util.tree_flatten_with_path(tree)
    names = [jax.tree_util.keystr(path).removesuffix(".value") for path, _ in leaves]
    return names, [leaf for _, leaf in leaves], treedef


def _check_devices(devices: Sequence[Any]) -> list[jax.Device]:
    devices = list(devices)
    bad = [d for d in devices if not isinstance(d, jax.Device)]
    if not devices or bad:
        raise DirectiveError(
            f"compile(devices=...) takes jax.Device objects (e.g. jax.devices()[:4]), got "
            f"{bad[:3] if bad else devices!r}"
        )
    if len(set(devices)) != len(devices):
        raise DirectiveError(f"compile(devices=...) names a device twice: {devices}")
    return devices


def _replica_count(directives: Sequence[Any]) -> int:
    widths = sorted({len(d.devices) for d in directives if isinstance(d, Replicate)})
    if len(widths) > 1:
        raise DirectiveError(
            f"replicate directives use {widths} devices: every region must be replicated "
            "the same number of times"
        )
    return widths[0] if widths else 1


def _check_batch(leaves: Sequence[Any], names: Sequence[str], parts: int, what: str) -> int:
    return check_batch_size(leaves, names, parts, what, "num_microbatches x replicas")


def compile(
    loss_fn: Callable[[nnx.Module, Any], jax.Array],
    model: nnx.Module,
    optimizer: optax.GradientTransformation,
    example_batch: Any,
    directives: Sequence[Any] = (),
    devices: Sequence[jax.Device] | None = None,
    timeout_s: float | None = None,
) -> TrainStep:
    """Compile a training step of `model` under a directive list.

    Args:
      loss_fn: loss_fn(model, batch) -> scalar; a mean over the batch for the step to
        equal single-device training.
      model: a flax.nnx.Module whose code marks regions with `piper_jax.annotate`.
      optimizer: an optax transformation; it must treat parameters independently.
      example_batch: a global batch (pytree of arrays with a leading batch axis).
      directives: split, place, replicate, order, schedule builders' outputs.
      devices: the devices directive indices refer to; default `jax.devices()`.
      timeout_s: how long a step may take before it fails naming the instruction and
        peer it waits on (a dead or stalled process); default $PIPER_STEP_TIMEOUT or 300.

    Returns:
      A TrainStep; call it with a global batch to run one training step.
    """
    check_compile_args(loss_fn, model, optimizer, example_batch, timeout_s)
    devices = _check_devices(jax.devices() if devices is None else devices)
    directives = check_directives(directives)
    m = num_microbatches(directives)
    replicas = _replica_count(directives)
    graphdef, params, rest = nnx.split(model, nnx.Param, ...)
    param_names, param_leaves, param_treedef = _leaf_names(params)
    batch_names, batch_leaves, batch_treedef = _leaf_names(example_batch)
    size = _check_batch(batch_leaves, batch_names, m * replicas, "example_batch")
    local = size // (m * replicas)

    def flat_loss(p_leaves: list, b_leaves: list) -> jax.Array:
        p = jax.tree_util.tree_unflatten(param_treedef, p_leaves)
        b = jax.tree_util.tree_unflatten(batch_treedef, b_leaves)
        return loss_fn(nnx.merge(graphdef, p, rest), b)

    reset_annotation_counters()
    try:
        lifted = lift(
            flat_loss,
            [jax.ShapeDtypeStruct(np.shape(x), x.dtype) for x in param_leaves],
            [
                jax.ShapeDtypeStruct((local,) + np.shape(x)[1:], np.asarray(x).dtype)
                for x in batch_leaves
            ],
            param_names,
            batch_names,
        )
    except flax.errors.TraceContextError as err:
        raise AnnotationError(
            "the model changes state other than its nnx.Param while computing the loss "
            "(dropout RNG counters, BatchNorm statistics, ...): not supported yet; make the "
            f"model deterministic for training with piper-jax ({err.__class__.__name__})"
        ) from err
    dag = apply_directives(build_dag(lifted), lifted, directives, len(devices))
    upds = list(dag.of_kind(NodeKind.UPD))
    global_norm = plan_optimizer(
        optimizer, param_leaves, [n.params for n in upds], any(n.zero for n in upds)
    )
    if global_norm:
        dag = attach_updates(dag, lifted, global_norm=True)
    plans = compile_plans(dag, {r.index for r in lifted.regions if r.batch_ids})
    check_same_plans(plans.fingerprint(), "plans")
    executor = Executor(dag, plans, lifted, optimizer, devices, param_leaves, m, global_norm)
    if timeout_s is None:
        timeout_s = float(os.environ.get("PIPER_STEP_TIMEOUT", DEFAULT_STEP_TIMEOUT_S))
    return TrainStep(
        dag,
        plans,
        lifted,
        executor,
        (graphdef, param_treedef, rest),
        (
            batch_treedef,
            batch_names,
            size,
            m * replicas,
            [(np.shape(x), np.asarray(x).dtype) for x in batch_leaves],
        ),
        timeout_s,
    )


class TrainStep:
    """A compiled training step: call it with a global batch; inspect dag, plans, explain()."""

    def __init__(
        self,
        dag: TrainingDAG,
        plans: Plans,
        lifted: LiftedLoss,
        executor: Executor,
        model_parts: tuple,
        batch_spec: tuple,
        timeout_s: float = 300.0,
    ):
        self.dag, self.plans, self.lifted = dag, plans, lifted
        self.timeout_s = timeout_s
        self._executor = executor
        self._graphdef, self._param_treedef, self._rest = model_parts
        (
            self._batch_treedef,
            self._batch_names,
            self._batch_size,
            self._parts,
            self._batch_avals,
        ) = batch_spec

    def __call__(self, batch: Any) -> dict[str, float]:
        return {"loss": self._executor.step(self._batch_leaves(batch), self.timeout_s)}

    def _batch_leaves(self, batch: Any) -> list[np.ndarray]:
        check_batch_leaves(batch, "batch")
        leaves, treedef = jax.tree_util.tree_flatten(batch)
        if treedef != self._batch_treedef:
            raise BatchError(
                f"batch structure {treedef} differs from the example batch's {self._batch_treedef}"
            )
        leaves = [np.asarray(x) for x in leaves]
        for name, leaf, (shape, dtype) in zip(self._batch_names, leaves, self._batch_avals):
            if leaf.shape[1:] != shape[1:] or leaf.dtype != dtype:
                raise BatchError(
                    f"batch leaf {name} is {leaf.dtype}{list(leaf.shape)}, but the step was "
                    f"compiled for {np.dtype(dtype)}{list(shape)}; keep every leaf's trailing "
                    "shape and dtype, or compile again"
                )
        size = _check_batch(leaves, self._batch_names, self._parts, "batch")
        if size != self._batch_size:
            raise BatchError(
                f"batch size {size} differs from the compiled example batch's "
                f"{self._batch_size}; compile again for a new batch size"
            )
        return leaves

    def params(self) -> nnx.State:
        """The current parameters, gathered to the host, as an nnx.State."""
        found = self._executor.gather_params()
        leaves = [found[n] for n in self.lifted.param_names]
        return jax.tree_util.tree_unflatten(self._param_treedef, leaves)

    def model(self) -> nnx.Module:
        """An nnx model holding the current parameters."""
        return nnx.merge(self._graphdef, self.params(), self._rest)

    def save(self, path: str | os.PathLike) -> None:
        """Write parameters and optimizer state as an orbax checkpoint in the new directory
        `path`, in the single-device layout, so any directive list can restore it."""
        checkpoint.save(self._executor, self.lifted.param_names, path)

    def restore(self, path: str | os.PathLike) -> None:
        """Load a checkpoint written by `save` of this model and optimizer, under any
        directive list; the next step continues from it."""
        checkpoint.restore(self._executor, self.lifted.param_names, path)

    def simulate(
        self, costs: Mapping[str, float] | None = None, transfer_latency: float = 0.0
    ) -> Simulation:
        """Run the plans on a cost model (default unit costs F=1, B=2).

        Returns a Simulation with .step_time, .bubble_fraction, .peak_activations (per
        device group, in microbatch-activation units) and .timeline.
        """
        return simulate(self.dag, self.plans, costs or {"F": 1, "B": 2}, transfer_latency)

    def measure_costs(self, batch: Any, repeats: int = 3) -> dict[str, float]:
        """Seconds per pass (and per op) for `simulate`, from `repeats` instrumented steps
        on `batch` (each trains a step): per kind, the median over all its instructions.
        Call it after one ordinary step, so compilation is not measured."""
        times: dict[str, list[float]] = {}
        for _ in range(repeats):
            for e in self._executor.run_recorded(self._batch_leaves(batch)):
                times.setdefault(e.kind, []).append(e.end - e.start)
        return {k: statistics.median(v) for k, v in times.items() if k != "RECV"}

    def timeline(
        self, path: str | os.PathLike, batch: Any = None, costs: Mapping[str, float] | None = None
    ) -> None:
        """Write the plans as a PNG Gantt chart, or a Chrome/Perfetto trace if `path` ends
        in .json: simulated with `costs`, or, given a `batch`, the real times of one
        instrumented step on it (which trains one step)."""
        if batch is None:
            events, unit, title = self.simulate(costs).timeline, 1000.0, "simulated"
        else:
            events = self._executor.run_recorded(self._batch_leaves(batch))
            unit, title = 1e6, "measured (instrumented, devices serialised)"
        write_timeline(events, path, title=title, time_unit_us=unit)

    def memory(self) -> dict[int, dict[str, int]]:
        """Bytes per device (index into the step's devices) of this process: parameters,
        gradient accumulators and optimizer state as held between steps, and an estimate of
        peak activations: the plans' peak live (region, microbatch) residual sets (a
        unit-cost simulation) times the bytes of the largest such set on that device."""
        table = self._executor.memory()
        peaks = self.simulate().peak_activations
        for g, peak in peaks.items():
            per_set = self._executor.residual_bytes(g)
            for d in g:
                if d in table:
                    table[d]["activations"] = peak * per_set
        return table

    def explain(self) -> str:
        """Regions, their placement, and each device group's instruction list."""
        groups = {n.region: n.devices for n in self.dag.compute_nodes()}
        lines = ["regions:"]
        for r in self.lifted.regions:
            lines.append(
                f"  region {r.index} {r}: {len(r.param_ids)} params, "
                f"on {group_str(groups[r.index])}"
            )
        lines.append("plan grid (rows: lockstep steps, columns: device groups):")
        lines.append(self.plans.grid())
        for g, plan in sorted(self.plans.plans.items()):
            lines.append(f"plan {group_str(g)}: " + "; ".join(str(i) for i in plan))
        if self._executor.fused:
            lines.append("overlap units fused into one program each:")
            lines += [f"  {unit}" for unit in self._executor.fused]
        return "\n".join(lines)
