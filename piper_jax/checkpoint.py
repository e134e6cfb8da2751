"""`TrainStep.save` / `restore`: parameters and optimizer state as one orbax checkpoint.

Both are stored in the layout single-device training would have (full parameters;
`optimizer.init` of the whole model, Note [portable optimizer state] in
mpmd_runtime/opt_layout.py), so a checkpoint written under one directive list restores
under any other: train with PP=2 x DP=2, resume on 4-way ZeRO-3. On several processes
every process calls save and restore (orbax writes the host values once and keeps the
processes in step); the directory must be one that all of them see. A JSON record of every
parameter and optimizer-state leaf (name, shape, dtype) travels with the arrays, so a
checkpoint of another model or optimizer is refused naming the first leaf that differs.
"""

from __future__ import annotations

import os
from collections.abc import Mapping
from typing import Any

import jax
import numpy as np
from jax.experimental import multihost_utils

from piper_jax.ir.errors import PiperError
from piper_jax.mpmd_runtime.executor import Executor

FORMAT = 1


def _describe(values: Mapping[str, np.ndarray]) -> list[list[Any]]:
    return _describe_avals({key: (np.shape(v), np.asarray(v).dtype) for key, v in values.items()})


def _describe_avals(avals: Mapping[str, tuple[tuple[int, ...], Any]]) -> list[list[Any]]:
    return [[key, list(shape), np.dtype(dtype).name] for key, (shape, dtype) in avals.items()]


def _barrier(name: str) -> None:
    """On several processes: wait until every process got here (all see the same files)."""
    if jax.process_count() > 1:
        multihost_utils.sync_global_devices(name)


def save(executor: Executor, param_names: list[str], path: str | os.PathLike) -> None:
    """Write the step's parameters and optimizer state to the new directory `path`."""
    path = os.path.abspath(os.fspath(path))
    exists = os.path.exists(path)
    _barrier(f"piper save {path}")  # every process looked before any writes
    if exists:
        raise PiperError(f"step.save: {path} already exists; save each checkpoint to a new path")
    import orbax.checkpoint as ocp  # here, so that importing piper_jax does not need orbax

    found = executor.gather_params()
    params = {name: found[name] for name in param_names}
    opt_state = dict(sorted(executor.optimizer_state().items()))
    meta = {"format": FORMAT, "params": _describe(params), "opt_state": _describe(opt_state)}
    arrays = {"params": list(params.values()), "opt_state": list(opt_state.values())}
    ocp.Checkpointer(ocp.CompositeCheckpointHandler()).save(
        path, ocp.args.Composite(arrays=ocp.args.StandardSave(arrays), meta=ocp.args.JsonSave(meta))
    )


def restore(executor: Executor, param_names: list[str], path: str | os.PathLike) -> None:
    """Load a checkpoint written by `save` (under any directive list) into the step."""
    path = os.path.abspath(os.fspath(path))
    if not os.path.isdir(path):
        raise PiperError(f"step.restore: no checkpoint directory at {path}")
    import orbax.checkpoint as ocp

    found = ocp.Checkpointer(ocp.CompositeCheckpointHandler()).restore(
        path, ocp.args.Composite(arrays=ocp.args.StandardRestore(), meta=ocp.args.JsonRestore())
    )
    meta, arrays = found.meta, found.arrays
    if meta.get("format") != FORMAT:
        raise PiperError(f"step.restore: {path} has format {meta.get('format')}, not {FORMAT}")
    want_params = _describe_avals({n: executor.param_avals[n] for n in param_names})
    _check_same("parameter", meta["params"], want_params, path)
    want_state = _describe_avals(executor.optimizer_avals())
    _check_same("optimizer state leaf", meta["opt_state"], want_state, path)
    params = dict(zip(param_names, arrays["params"]))
    opt_state = {key: value for (key, _, _), value in zip(meta["opt_state"], arrays["opt_state"])}
    executor.load_state(params, opt_state)


def _check_same(what: str, saved: list, expected: list, path: str) -> None:
    """Refuse a checkpoint whose leaves differ from this step's, naming the first one."""
    saved_by_key = {key: (shape, dtype) for key, shape, dtype in saved}
    for key, shape, dtype in expected:
        if key not in saved_by_key:
            raise PiperError(
                f"step.restore: {path} has no {what} {key}; was it saved from another "
                "model or optimizer?"
            )
        if saved_by_key[key] != (shape, dtype):
            s_shape, s_dtype = saved_by_key[key]
            raise PiperError(
                f"step.restore: {what} {key} is {s_dtype}{s_shape} in {path} but "
                f"{dtype}{shape} in this step"
            )
    extra = sorted(set(saved_by_key) - {key for key, _, _ in expected})
    if extra:
        raise PiperError(
            f"step.restore: {path} holds {what} {extra[0]}, which this step does not have"
        )
