"""Directive lists in the reference Piper JSON format: a list of {"op": ..., ...} objects."""

from __future__ import annotations

import dataclasses
import json
import os
from collections.abc import Sequence
from typing import Any

from piper_jax.directives.types import Order, Place, Recompute, Replicate, Shard, Split
from piper_jax.ir.errors import DirectiveError

OPS = {
    "split": Split,
    "place": Place,
    "replicate": Replicate,
    "shard": Shard,
    "order": Order,
    "recompute": Recompute,
}
_NAMES = {cls: op for op, cls in OPS.items()}


def directive_from_dict(entry: Any, index: int) -> Any:
    if not isinstance(entry, dict) or "op" not in entry:
        raise DirectiveError(
            f"directive {index}: expected an object with an 'op' key, got {entry!r}"
        )
    op = entry["op"]
    if op not in OPS:
        raise DirectiveError(
            f"directive {index}: unknown op {op!r}; known ops are {', '.join(OPS)}"
        )
    cls = OPS[op]
    fields = {f.name for f in dataclasses.fields(cls)}
    args = {k: v for k, v in entry.items() if k != "op"}
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
    """Read a strategy file: a JSON list of directives, or {"directives": [...]}."""
    try:
        with open(source) as f:
            data = json.load(f)
    except json.JSONDecodeError as err:
        raise DirectiveError(f"{source}: not valid JSON: {err}") from None
    if isinstance(data, dict) and "directives" in data:
        data = data["directives"]
    if not isinstance(data, list):
        raise DirectiveError(f"{source}: expected a list of directives")
    return [directive_from_dict(entry, i) for i, entry in enumerate(data)]


def dump_directives(directives: Sequence[Any], path: str | os.PathLike) -> None:
    flat = [d for item in directives for d in (item if isinstance(item, list) else [item])]
    with open(path, "w") as f:
        json.dump([directive_to_dict(d) for d in flat], f, indent=1)
