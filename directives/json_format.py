"""Directive lists in the reference Piper JSON format: a list of {"op": ..., ...} objects."""

from __future__ import annotations

import dataclasses
import json
import os
from collections.abc import Sequence
from typing import Any

from piper_jax.directives.types import (
    Order,
    Place,
    Recompute,
    Replicate,
    Shard,
    ShardTensor,
    Split,
)
from piper_jax.ir.errors import DirectiveError

OPS = {
    "split": Split,
    "place": Place,
    "replicate": Replicate,
    "shard": Shard,
    "shard_tensor": ShardTensor,
    "order": Order,
    "recompute": Recompute,
}
_NAMES = {cls: op for op, cls in OPS.items()}


# Fields the reference Piper refuses on an op, and what to write instead.
_MISPLACED = {
    ("replicate", "stream"): "write 'reduce_stream' and/or 'gather_stream' (the streams of "
    "its gradient and parameter collectives)",
    **{
        (op, field): "write 'stream'"
        for op in ("place", "shard", "shard_tensor")
        for field in ("reduce_stream", "gather_stream")
    },
    **{
        (op, "filters"): "write 'filter' (one filter object)"
        for op in ("split", "place", "replicate", "shard", "shard_tensor", "recompute")
    },
    ("order", "filter"): "write 'filters' (a list of groups of filter objects)",
}
# `device` for `devices`, read by the reference Piper on these ops.
_DEVICE_ALIAS_OPS = ("place", "replicate", "shard", "shard_tensor")


def directive_from_dict(entry: Any, index: int) -> Any:
    if not isinstance(entry, dict) or "op" not in entry:
        raise DirectiveError(
            f"directive {index}: expected an object with an 'op' key, got {entry!r}"
        )
    op = entry["op"]
    if not isinstance(op, str) or op not in OPS:
        raise DirectiveError(
            f"directive {index}: unknown op {op!r}; 'op' is one of the strings {', '.join(OPS)}"
        )
    cls = OPS[op]
    args = {k: v for k, v in entry.items() if k != "op"}
    if op in _DEVICE_ALIAS_OPS and "device" in args:
        if "devices" in args:
            raise DirectiveError(
                f"directive {index} ({op}): gives both 'devices' and its alias 'device'; "
                "keep 'devices' only"
            )
        args["devices"] = args.pop("device")
    for field in args:
        if (op, field) in _MISPLACED:
            raise DirectiveError(
                f"directive {index} ({op}): {op} takes no {field!r}; {_MISPLACED[op, field]}"
            )
    fields = {f.name for f in dataclasses.fields(cls)}
    unknown = sorted(set(args) - fields)
    if unknown:
        raise DirectiveError(
            f"directive {index} ({op}): unknown field(s) {unknown}; {op} takes {sorted(fields)}"
        )
    try:
        return cls(**args)
    except TypeError as err:
        raise DirectiveError(f"directive {index} ({op}): {err}") from None
    except DirectiveError as err:
        raise DirectiveError(f"directive {index}: {err}") from None


def directive_to_dict(directive: Any) -> dict:
    out: dict[str, Any] = {"op": _NAMES[type(directive)]}
    for f in dataclasses.fields(directive):
        value = getattr(directive, f.name)
        if isinstance(value, tuple):
            value = [list(v) if isinstance(v, tuple) else v for v in value]
        out[f.name] = value
    return out


def load_directives(source: str | os.PathLike) -> list:
    """Read a strategy file: a JSON list of directives, or {"directives": [...]}, in the
    reference Piper format (`device` is read as `devices`, as the reference does)."""
    try:
        with open(source, encoding="utf-8") as f:
            data = json.load(f)
    except json.JSONDecodeError as err:
        raise DirectiveError(f"{source}: not valid JSON: {err}") from None
    except UnicodeDecodeError as err:
        raise DirectiveError(
            f"{source}: not UTF-8 text (byte {err.start} is {err.object[err.start : err.end]!r}); "
            "save the strategy file as UTF-8 JSON"
        ) from None
    except OSError as err:
        raise DirectiveError(f"cannot read strategy file {source}: {err.strerror}") from None
    if isinstance(data, dict) and "directives" in data:
        data = data["directives"]
    if not isinstance(data, list):
        raise DirectiveError(f"{source}: expected a list of directives")
    return [directive_from_dict(entry, i) for i, entry in enumerate(data)]


def dump_directives(directives: Sequence[Any], path: str | os.PathLike) -> None:
    flat = [d for item in directives for d in (item if isinstance(item, list) else [item])]
    with open(path, "w") as f:
        json.dump([directive_to_dict(d) for d in flat], f, indent=1)
