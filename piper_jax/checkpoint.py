"""`TrainStep.save` / `restore`: parameters, optimizer state and the count of steps run
(the random counter of Note [random keys of a step]) as one orbax checkpoint.

Both are stored in the layout single-device training would have (full parameters;
`optimizer.init` of the whole model, Note [portable optimizer state] in
mpmd_runtime/opt_layout.py), so a checkpoint written under one directive list restores
under any other: train with PP=2 x DP=2, resume on 4-way ZeRO-3. On several processes
every process calls save and restore (orbax writes the host values once and keeps the
processes in step); the directory must be one that all of them see. A JSON record of every
parameter and optimizer-state leaf (name, shape, dtype, CRC-32 of its bytes) travels with
the arrays, so a checkpoint of another model or optimizer is refused naming the first leaf
that differs, and so is one whose data was damaged on disk (orbax's compressed chunks
carry no checksum: damaged bytes can decode to other numbers). Every check runs before the
step's state is touched: a refused restore leaves the step as it was.
"""

from __future__ import annotations

import os
import re
import shutil
import threading
import time
import zlib
from collections.abc import Mapping
from typing import Any

import jax
import numpy as np
from jax.experimental import multihost_utils

from piper_jax.ir.errors import PiperError
from piper_jax.mpmd_runtime.executor import Executor

FORMAT = 2  # 2: every leaf record carries a checksum
_TMP_SUFFIX = ".orbax-checkpoint-tmp"  # orbax writes `<path><suffix>...`, then renames it
_ITEM_LEAF = re.compile(r"\b(params|opt_state)\.(\d+)\b")  # orbax's names of our leaves
_KINDS = {"params": "parameter", "opt_state": "optimizer state leaf"}
WRITER_WAIT_S = 30.0  # after a failed save, how long its writers may take to stop


def _checksum(value: Any) -> str:
    data = np.ascontiguousarray(value).reshape(-1).view(np.uint8)
    return f"crc32:{zlib.crc32(data):08x}"


def _describe(values: Mapping[str, np.ndarray]) -> list[list[Any]]:
    return [
        [key, list(np.shape(v)), np.asarray(v).dtype.name, _checksum(v)]
        for key, v in values.items()
    ]


def _describe_avals(avals: Mapping[str, tuple[tuple[int, ...], Any]]) -> list[list[Any]]:
    return [[key, list(shape), np.dtype(dtype).name] for key, (shape, dtype) in avals.items()]


def _barrier(name: str) -> None:
    """On several processes: wait until every process got here (all see the same files)."""
    if jax.process_count() > 1:
        multihost_utils.sync_global_devices(name)


def save(executor: Executor, param_names: list[str], path: str | os.PathLike) -> None:
    """Write the step's parameters and optimizer state to the new directory `path`; on a
    failed write (a full disk) remove what was written and say why."""
    path = os.path.abspath(os.fspath(path))
    exists = os.path.exists(path)
    _barrier(f"piper save {path}")  # every process looked before any writes
    if exists:
        raise PiperError(f"step.save: {path} already exists; save each checkpoint to a new path")
    import orbax.checkpoint as ocp  # here, so that importing piper_jax does not need orbax

    found = executor.gather_params()
    params = {name: found[name] for name in param_names}
    opt_state = dict(sorted(executor.optimizer_state().items()))
    meta = {
        "format": FORMAT,
        "params": _describe(params),
        "opt_state": _describe(opt_state),
        "steps": executor.steps_done,
    }
    arrays = {"params": list(params.values()), "opt_state": list(opt_state.values())}
    threads = set(threading.enumerate())
    try:
        ocp.Checkpointer(ocp.CompositeCheckpointHandler()).save(
            path,
            ocp.args.Composite(arrays=ocp.args.StandardSave(arrays), meta=ocp.args.JsonSave(meta)),
        )
    except (OSError, ValueError, RuntimeError) as err:
        _join_new_threads(threads, WRITER_WAIT_S)
        _remove_partial(path)
        raise PiperError(
            f"step.save: could not write the checkpoint {path}: {_reason(err)}; the partial "
            "checkpoint was removed: free space (or fix the cause) and save again"
        ) from err


def _join_new_threads(before: set[threading.Thread], timeout_s: float) -> None:
    """Wait for the writer threads a failed save started: orbax writes the items in the
    background and one failed write does not stop the others, which would otherwise
    re-create the temporary directory after it was removed."""
    deadline = time.monotonic() + timeout_s
    for thread in threading.enumerate():
        if thread not in before and thread is not threading.current_thread():
            thread.join(max(0.0, deadline - time.monotonic()))


def _remove_partial(path: str) -> None:
    """What a failed save left: orbax's temporary directories of `path`, and `path` itself
    (it did not exist before this save). Other checkpoints beside it stay."""
    parent, name = os.path.split(path)
    for entry in os.listdir(parent) if os.path.isdir(parent) else ():
        if entry.startswith(name + _TMP_SUFFIX):
            shutil.rmtree(os.path.join(parent, entry), ignore_errors=True)
    shutil.rmtree(path, ignore_errors=True)


def restore(executor: Executor, param_names: list[str], path: str | os.PathLike) -> None:
    """Load a checkpoint written by `save` (under any directive list) into the step, after
    checking that it is complete, of this model and optimizer, and undamaged."""
    path = os.path.abspath(os.fspath(path))
    if not os.path.isdir(path):
        raise PiperError(f"step.restore: no checkpoint directory at {path}")
    import orbax.checkpoint as ocp

    checkpointer = ocp.Checkpointer(ocp.CompositeCheckpointHandler())
    meta = _read(checkpointer, path, ocp.args.Composite(meta=ocp.args.JsonRestore()), None)
    _check_meta(meta, path)
    want_params = _describe_avals({n: executor.param_avals[n] for n in param_names})
    _check_same("parameter", meta["params"], want_params, path)
    want_state = _describe_avals(executor.optimizer_avals())
    _check_same("optimizer state leaf", meta["opt_state"], want_state, path)
    arrays = _read(checkpointer, path, ocp.args.Composite(arrays=ocp.args.StandardRestore()), meta)
    if not isinstance(arrays, dict):
        raise _incomplete(path, "its array data (arrays/) is not piper-jax's")
    loaded = {}
    for item, kind in _KINDS.items():
        _check_data(kind, meta[item], arrays.get(item), path)
        loaded[item] = {record[0]: value for record, value in zip(meta[item], arrays[item])}
    executor.load_state(loaded["params"], loaded["opt_state"])
    # the random counter goes on from where it stopped: a resumed run draws the dropout
    # masks the uninterrupted run would (checkpoints from before it was saved count from 0)
    executor.steps_done = int(meta.get("steps", 0))


def _incomplete(path: str, what: str) -> PiperError:
    return PiperError(
        f"step.restore: not a complete piper-jax checkpoint at {path}: {what}; restore from "
        "a checkpoint that step.save finished writing"
    )


def _read(checkpointer: Any, path: str, args: Any, meta: dict | None) -> Any:
    """The one item that `args` asks for (`meta`, or `arrays` once `meta` is read), or a
    PiperError saying it is missing or unreadable, naming the leaf where orbax's error does."""
    (item,) = args.keys()
    try:
        return checkpointer.restore(path, args)[item]
    except (OSError, KeyError, ValueError) as err:  # ValueError: also JSON and tensorstore
        if meta is None:
            what = "its metadata (meta/, the record of leaves)"
        else:
            what = "its array data (arrays/)"
            leaf = _ITEM_LEAF.search(str(err))
            if leaf and int(leaf[2]) < len(meta[leaf[1]]):
                what = f"the data of {_KINDS[leaf[1]]} {meta[leaf[1]][int(leaf[2])][0]}"
        raise _incomplete(path, f"{what} is missing or damaged ({_reason(err)})") from None


def _check_meta(meta: Any, path: str) -> None:
    if isinstance(meta, dict) and "format" in meta and meta["format"] != FORMAT:
        raise PiperError(
            f"step.restore: {path} has format {meta['format']!r}, not {FORMAT}: it was "
            "written by another piper-jax version"
        )
    if not (isinstance(meta, dict) and all(_leaf_records(meta.get(item)) for item in _KINDS)):
        raise _incomplete(path, "its metadata (meta/) is not a piper-jax record of leaves")


def _leaf_records(records: Any) -> bool:
    """[[key, shape, dtype, checksum], ...] as `_describe` writes them."""
    return isinstance(records, list) and all(
        isinstance(r, list)
        and len(r) == 4
        and isinstance(r[0], str)
        and isinstance(r[1], list)
        and isinstance(r[2], str)
        and isinstance(r[3], str)
        for r in records
    )


def _check_data(kind: str, records: list, values: Any, path: str) -> None:
    """Each restored leaf has its recorded shape, dtype and checksum."""
    if not isinstance(values, list) or len(values) != len(records):
        count = len(values) if isinstance(values, list) else 0
        raise _incomplete(
            path, f"its array data holds {count} {kind}s but its metadata lists {len(records)}"
        )
    for (key, shape, dtype, checksum), value in zip(records, values):
        value = np.asarray(value)
        if list(value.shape) != shape or value.dtype.name != dtype:
            raise _incomplete(
                path,
                f"the data of {kind} {key} is {value.dtype.name}{list(value.shape)}, but its "
                f"metadata says {dtype}{shape}",
            )
        found = _checksum(value)
        if found != checksum:
            raise PiperError(
                f"step.restore: {kind} {key} in {path} is damaged: its data has checksum "
                f"{found}, but {checksum} was saved with it; restore from an intact copy"
            )


def _reason(err: BaseException) -> str:
    """The gist of an orbax or tensorstore error, without its page-long spec."""
    text = str(err).split(" [tensorstore_spec=")[0].strip() or type(err).__name__
    return text if len(text) <= 300 else text[:297] + "..."


def _check_same(what: str, saved: list, expected: list, path: str) -> None:
    """Refuse a checkpoint whose leaves differ from this step's, naming the first one."""
    saved_by_key = {key: (shape, dtype) for key, shape, dtype, _ in saved}
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
