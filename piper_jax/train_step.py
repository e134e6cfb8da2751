"""`compile` and `TrainStep`: from a model, loss and directive list to a runnable step."""

from __future__ import annotations

import collections
import gc
import math
import os
import statistics
import warnings
from collections.abc import Callable, Mapping, Sequence
from typing import Any

import jax
import numpy as np
import optax
from flax import nnx

from piper_jax import checkpoint
from piper_jax.batching import check_batch_size
from piper_jax.ir.errors import BatchError, DirectiveError, PiperError
from piper_jax.lowering import Lowered, lower
from piper_jax.mpmd_runtime import Executor
from piper_jax.mpmd_runtime.instructions import parse_step
from piper_jax.mpmd_runtime.simulator import COMPUTE_KINDS, Simulation, fused_key
from piper_jax.mpmd_runtime.timeline import write_timeline
from piper_jax.mpmd_runtime.transport import check_same_plans
from piper_jax.validation import check_batch_leaves, check_run_args

DEFAULT_STEP_TIMEOUT_S = 300.0


class NonFiniteError(PiperError):
    """A step's loss or gradients were not finite; its update was not applied."""


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


def compile(
    loss_fn: Callable[[nnx.Module, Any], jax.Array],
    model: nnx.Module,
    optimizer: optax.GradientTransformation,
    example_batch: Any,
    directives: Sequence[Any] = (),
    devices: Sequence[jax.Device] | None = None,
    timeout_s: float | None = None,
    *,
    nonfinite: str = "raise",
    fuse_collectives: bool = True,
    fuse_passes: bool | None = None,
) -> TrainStep:
    """Compile a training step of `model` under a directive list.

    Args:
      loss_fn: loss_fn(model, batch) -> scalar; a mean over the batch for the step to
        equal single-device training.
      model: a flax.nnx.Module whose code marks regions with `piper_jax.annotate`.
      optimizer: an optax transformation; it must treat parameters independently (or
        clip by their global norm).
      example_batch: a global batch (pytree of arrays with a leading batch axis).
      directives: split, place, replicate, order, recompute, schedule builders' outputs.
      devices: the devices directive indices refer to; default `jax.devices()`.
      timeout_s: how long a step may take before it fails naming the instruction and
        peer it waits on (a dead or stalled process); default $PIPER_STEP_TIMEOUT or 300.
      nonfinite: what a step whose gradients (or loss) are not finite does. "raise"
        (default): its update is skipped on every device group (parameters and optimizer
        state stay as before the step) and the step raises NonFiniteError naming it;
        "skip": the update is skipped, a warning is given and training goes on;
        "ignore": no check (and no global-norm collective unless the optimizer needs it).
      fuse_collectives: run each ZeRO collective inside the program of the pass it
        serves (default); False runs every collective as a program of its own.
      fuse_passes: run a region's backward in one program with its forward of the same
        microbatch where a group runs one right after the other; default: where the
        devices are GPUs or TPUs, not on XLA:CPU (where separate programs ran faster).

    Returns:
      A TrainStep; call it with a global batch to run one training step.
    """
    check_run_args(timeout_s)
    devices = _check_devices(jax.devices() if devices is None else devices)
    lowered = lower(
        loss_fn,
        model,
        optimizer,
        example_batch,
        directives,
        len(devices),
        nonfinite=nonfinite,
        fuse_collectives=fuse_collectives,
        fuse_passes=devices[0].platform != "cpu" if fuse_passes is None else fuse_passes,
    )
    shapes = repr([(np.shape(x), str(np.asarray(x).dtype)) for x in lowered.param_leaves])
    check_same_plans(lowered.plans.fingerprint(shapes + repr(lowered.batch.avals)), "plans")
    executor = Executor(
        lowered.plans,
        lowered.lifts,
        optimizer,
        devices,
        lowered.param_leaves,
        lowered.param_tree,
        lowered.batch.num_microbatches,
        lowered.carrier,
        random_leaf=len(lowered.batch.names) if lowered.batch.random else None,
    )
    if timeout_s is None:
        timeout_s = float(os.environ.get("PIPER_STEP_TIMEOUT", DEFAULT_STEP_TIMEOUT_S))
    return TrainStep(lowered, executor, timeout_s, nonfinite, devices)


class TrainStep:
    """A compiled training step: call it with a global batch; inspect dag, plans, explain()."""

    def __init__(
        self,
        lowered: Lowered,
        executor: Executor,
        timeout_s: float,
        nonfinite: str = "raise",
        devices: Sequence[jax.Device] | None = None,
    ):
        self.lowered, self.devices = lowered, devices or jax.devices()
        self._evaluator: Executor | None = None
        self.dag, self.plans, self.lifted = lowered.dag, lowered.plans, lowered.lifted
        self.timeout_s, self.nonfinite = timeout_s, nonfinite
        self.steps_run = 0
        self._executor = executor
        self._graphdef, self._param_treedef, self._random, self._rest = lowered.model_parts

    def __call__(self, batch: Any) -> dict[str, float]:
        metrics = self._executor.step(self._batch_leaves(batch), self.timeout_s)
        self.steps_run += 1
        if self.nonfinite != "ignore" and not all(math.isfinite(v) for v in metrics.values()):
            what = ", ".join(f"{k} {v}" for k, v in metrics.items())
            message = (
                f"step {self.steps_run} (counting from 1 since compile): {what} is not finite, "
                "so its update was skipped: parameters and optimizer state are those before "
                "this step. Look for NaN/inf in the batch or an exploding loss (lower the "
                "learning rate, clip gradients)"
            )
            if self.nonfinite == "raise":
                raise NonFiniteError(message + '; compile(..., nonfinite="skip") goes on instead')
            warnings.warn(message, RuntimeWarning, stacklevel=2)
            metrics["skipped"] = 1.0
        return metrics

    def evaluate(self, batch: Any) -> dict[str, float]:
        """The loss of the current parameters on `batch`, with the model in eval mode (no
        dropout), under the same placement: forward passes only (pipelined across stages
        where the directives place them so), nothing updated. Compiled on first use."""
        if self._evaluator is None:
            lowered = self.lowered.evaluation()
            self._evaluator = Executor(
                lowered.plans,
                lowered.lifts,
                optax.identity(),
                self.devices,
                lowered.param_leaves,
                lowered.param_tree,
                lowered.batch.num_microbatches,
                random_leaf=len(lowered.batch.names) if lowered.batch.random else None,
                state_of=self._executor,
            )
        return self._evaluator.step(self._batch_leaves(batch), self.timeout_s)

    def _batch_leaves(self, batch: Any) -> list[np.ndarray]:
        spec = self.lowered.batch
        check_batch_leaves(batch, "batch")
        leaves, treedef = jax.tree_util.tree_flatten(batch)
        if treedef != spec.treedef:
            raise BatchError(
                f"batch structure {treedef} differs from the example batch's {spec.treedef}"
            )
        leaves = [np.asarray(x) for x in leaves]
        for name, leaf, (shape, dtype) in zip(spec.names, leaves, spec.avals):
            if leaf.shape[1:] != tuple(shape[1:]) or leaf.dtype != dtype:
                raise BatchError(
                    f"batch leaf {name} is {leaf.dtype}{list(leaf.shape)}, but the step was "
                    f"compiled for {np.dtype(dtype)}{list(shape)}; keep every leaf's trailing "
                    "shape and dtype, or compile again"
                )
        size = check_batch_size(
            leaves, spec.names, spec.num_microbatches, "batch", "num_microbatches"
        )
        if size != spec.size:
            raise BatchError(
                f"batch size {size} differs from the compiled example batch's "
                f"{spec.size}; compile again for a new batch size"
            )
        return leaves

    def params(self) -> nnx.State:
        """The current parameters, gathered to the host, as an nnx.State."""
        found = self._executor.gather_params()
        leaves = [found[n] for n in self.lifted.param_names]
        return jax.tree_util.tree_unflatten(self._param_treedef, leaves)

    def model(self) -> nnx.Module:
        """An nnx model holding the current parameters."""
        return nnx.merge(self._graphdef, self.params(), self._random, self._rest)

    def save(self, path: str | os.PathLike) -> None:
        """Write parameters, optimizer state and the number of steps run (which random
        keys, e.g. dropout's, derive from) as an orbax checkpoint in the new directory
        `path`, in the single-device layout, so any directive list can restore it."""
        checkpoint.save(self._executor, self.lifted.param_names, path)

    def restore(self, path: str | os.PathLike) -> None:
        """Load a checkpoint written by `save` of this model and optimizer, under any
        directive list; the next step continues from it."""
        checkpoint.restore(self._executor, self.lifted.param_names, path)

    def simulate(
        self, costs: Mapping[str, float] | None = None, transfer_latency: float = 0.0
    ) -> Simulation:
        """Run the plans on a cost model (default unit costs F=1, B=2), with this step's
        devices in their processes (transfers between processes wait for both sides) and,
        where each process holds one CPU device, its host issuing the steps on the core
        that device computes on.

        Returns a Simulation with .step_time, .bubble_fraction, .peak_activations (per
        device group, in microbatch-activation units) and .timeline.
        """
        processes = {i: d.process_index for i, d in enumerate(self.devices)}
        per_process = collections.Counter(processes.values())
        one_core = self.devices[0].platform == "cpu" and set(per_process.values()) == {1}
        return self.lowered.simulate(costs, transfer_latency, processes, one_core)

    def measure_costs(self, batch: Any, repeats: int = 3) -> dict[str, float]:
        """Seconds per pass (and per op) for `simulate`, from `repeats` instrumented steps
        on `batch` (each trains a step): per kind, the median over all its steps, and per
        region for its passes and update ("F0", "B1", "UPD0"; regions of one model differ:
        the stage with the loss, an embedding); a step of several pieces under their kinds
        joined by "+" ("ALL_GATHER+F"), as it is only timed whole. Then, from one more
        real step, the host's: "DISPATCH", its time to issue a step (taken off each
        timed step, which paid it too), and "STEP", its time per step outside the plans.
        Call it after one ordinary step, so compilation is not measured."""
        times: dict[str, list[float]] = {}
        leaves = self._batch_leaves(batch)
        for _ in range(repeats):
            for e in self._without_gc(self._executor.run_recorded, leaves):
                step = parse_step(e.label)
                kind = fused_key(step) or e.kind  # a fused step only whole
                times.setdefault(kind, []).append(e.end - e.start)
                if kind in COMPUTE_KINDS and step.head.region is not None:
                    times.setdefault(f"{kind}{step.head.region}", []).append(e.end - e.start)
        dispatch, per_step = self._without_gc(self._executor.host_costs, leaves)
        costs = {k: max(0.0, statistics.median(v) - dispatch) for k, v in times.items()}
        return costs | {"DISPATCH": dispatch, "STEP": per_step}

    @staticmethod
    def _without_gc(run: Callable[[Any], Any], leaves: Any) -> Any:
        """`run(leaves)`, an instrumented step, with Python's garbage collector paused:
        a collection that the step's own allocations trigger lands on the same
        instruction in every step, and made that instruction's median cost (a DualPipeV
        update measured 14 ms against 1 ms)."""
        gc.collect()
        enabled = gc.isenabled()
        gc.disable()
        try:
            return run(leaves)
        finally:
            if enabled:
                gc.enable()

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
        """Regions, their placement and layouts, and each device group's plan."""
        return self.lowered.explain()
