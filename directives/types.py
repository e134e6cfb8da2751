"""Directive values: small frozen records, validated when they are made."""

from __future__ import annotations

import dataclasses
import json
import math
from collections.abc import Mapping, Sequence
from typing import Any

from piper_jax.ir.dag import PASSES, RECOMPUTE_KEEPS
from piper_jax.ir.errors import DirectiveError

FilterValue = int | str
Filter = Mapping[str, FilterValue]


def check_filter(flt: Any, where: str) -> dict[str, FilterValue]:
    """A filter maps tags to an int, '*' (any index) or '-' (tag absent); PASS to a pass.
    The empty filter {} matches every region (the reference Piper's harness splits with it)."""
    if _is_pair_list(flt):
        written = {tag: value for tag, value in flt}
        raise DirectiveError(
            f"{where}: filter {flt!r} is a list of [tag, index] pairs, an old form the "
            f"reference Piper no longer reads; write the object {json.dumps(written)}"
        )
    if not isinstance(flt, Mapping):
        raise DirectiveError(
            f"{where}: filter must be a dict such as {{'PP': 0}} ({{}} for every region), "
            f"got {flt!r}"
        )
    out: dict[str, FilterValue] = {}
    for tag, value in flt.items():
        if not isinstance(tag, str):
            raise DirectiveError(f"{where}: filter key {tag!r} must be a tag name string")
        if tag == "PASS":
            if value not in PASSES:
                raise DirectiveError(f"{where}: PASS must be one of {PASSES}, got {value!r}")
        elif value not in ("*", "-") and (
            isinstance(value, bool) or not isinstance(value, int) or value < 0
        ):
            raise DirectiveError(
                f"{where}: filter value for {tag!r} must be an index >= 0, '*' or '-', "
                f"got {value!r}{_filter_value_hint(value)}"
            )
        out[tag] = value
    return out


def _is_pair_list(flt: Any) -> bool:
    return (
        isinstance(flt, list)
        and bool(flt)
        and all(isinstance(p, list | tuple) and len(p) == 2 and isinstance(p[0], str) for p in flt)
    )


def _filter_value_hint(value: Any) -> str:
    if value is None:
        return "; write '-' for regions without the tag, or '*' for any index"
    return _unquote_hint(value, int)


def _unquote_hint(value: Any, kind: type | tuple[type, ...] = (int, float)) -> str:
    """For a number written as a string ("4", which the reference Piper converts): say so."""
    if not isinstance(value, str):
        return ""
    try:
        number = json.loads(value.strip())
    except ValueError:
        return ""
    if isinstance(number, bool) or not isinstance(number, kind) or not math.isfinite(number):
        return ""
    return f"; write the number {number}, not the string {value!r}"


def check_devices(devices: Any, where: str) -> tuple[int, ...]:
    if isinstance(devices, int) and not isinstance(devices, bool):
        devices = [devices]
    if (
        not isinstance(devices, Sequence)
        or not devices
        or any(isinstance(d, bool) or not isinstance(d, int) or d < 0 for d in devices)
    ):
        raise DirectiveError(
            f"{where}: devices must be a non-empty list of device indices, got {devices!r}"
        )
    if len(set(devices)) != len(devices):
        raise DirectiveError(f"{where}: devices {list(devices)} name a device twice")
    return tuple(devices)


def check_bool(value: Any, field: str, where: str) -> bool:
    """A real bool: the reference Piper reads "false" (a string) as true, so refuse it."""
    if not isinstance(value, bool):
        raise DirectiveError(
            f"{where}: {field} must be true or false, got {value!r} "
            f"({type(value).__name__}); write false or true, without quotes"
        )
    return value


def check_stream(value: Any, field: str, where: str) -> str:
    if not isinstance(value, str) or not value:
        raise DirectiveError(f"{where}: {field} must be a stream name such as 'pp', got {value!r}")
    return value


def check_count(value: Any, field: str, where: str) -> int:
    """An int >= 1 (the reference Piper also takes "4" and 4.0: say what to write)."""
    if isinstance(value, bool) or not isinstance(value, int) or value < 1:
        hint = _unquote_hint(value, int)
        if isinstance(value, float) and value.is_integer() and value >= 1:
            hint = f"; write {int(value)}"
        raise DirectiveError(f"{where}: {field} must be an int >= 1, got {value!r}{hint}")
    return value


@dataclasses.dataclass(frozen=True)
class Split:
    """Cut the batch of matched regions into `num_microbatches` microbatches, tagged MB=i."""

    filter: dict
    num_microbatches: int
    dim_name: str = "MB"

    def __post_init__(self) -> None:
        object.__setattr__(self, "filter", check_filter(self.filter, "split"))
        check_count(self.num_microbatches, "num_microbatches", "split")
        if self.dim_name != "MB":
            raise DirectiveError(f"split: dim_name {self.dim_name!r} is not supported; use 'MB'")


@dataclasses.dataclass(frozen=True)
class Place:
    """Run matched regions on `devices`; `stream` names the logical stream of their work."""

    filter: dict
    devices: tuple[int, ...]
    stream: str = "default"

    def __post_init__(self) -> None:
        object.__setattr__(self, "filter", check_filter(self.filter, "place"))
        object.__setattr__(self, "devices", check_devices(self.devices, "place"))
        check_stream(self.stream, "stream", "place")


@dataclasses.dataclass(frozen=True)
class Replicate:
    """Data parallelism: each of `devices` runs matched regions on its slice of the batch.

    Attributes:
      shard_grads: reduce-scatter gradients and shard optimizer state (ZeRO-1/2).
      shard_params: also keep parameters sharded, gathered around each use (ZeRO-3).
      bucket_size: cut the gradient all-reduce into buckets of at most this many MB, so
        each can start once the regions it serves finished their backward (plain
        replicate; under ZeRO every backward reduce-scatters its own gradients).
      reduce_stream, gather_stream: logical streams of the gradient and parameter collectives.
    """

    filter: dict
    devices: tuple[int, ...]
    shard_grads: bool = False
    shard_params: bool = False
    bucket_size: float | None = None
    reduce_stream: str = "dp"
    gather_stream: str = "dp"

    def __post_init__(self) -> None:
        object.__setattr__(self, "filter", check_filter(self.filter, "replicate"))
        object.__setattr__(self, "devices", check_devices(self.devices, "replicate"))
        check_bool(self.shard_grads, "shard_grads", "replicate")
        check_bool(self.shard_params, "shard_params", "replicate")
        size = self.bucket_size
        if size is not None and (
            isinstance(size, bool)
            or not isinstance(size, int | float)
            or not math.isfinite(size)
            or size <= 0
        ):
            raise DirectiveError(
                f"replicate: bucket_size must be a finite number of MB > 0 (or null for one "
                f"all-reduce), got {size!r}{_unquote_hint(size)}"
            )
        check_stream(self.reduce_stream, "reduce_stream", "replicate")
        check_stream(self.gather_stream, "gather_stream", "replicate")


@dataclasses.dataclass(frozen=True)
class Shard:
    """Expert parallelism: all-to-all around matched F and BI nodes."""

    filter: dict
    devices: tuple[int, ...]
    stream: str = "ep"

    def __post_init__(self) -> None:
        object.__setattr__(self, "filter", check_filter(self.filter, "shard"))
        object.__setattr__(self, "devices", check_devices(self.devices, "shard"))
        check_stream(self.stream, "stream", "shard")


TENSOR_SPLITS = ("colwise", "rowwise")


@dataclasses.dataclass(frozen=True)
class ShardTensor:
    """Tensor parallelism inside the matched regions' device group: their parameters lie
    split over a `tp` axis of `len(devices)` devices and each region's programs run as
    SPMD over it (XLA inserts the collectives); the model code stays the unsharded model.

    Attributes:
      devices: one tensor-parallel group: the region's devices, or a run of consecutive
        devices of it (the rest of the group are data-parallel replicas of that run).
      params: module name (the trailing path components of a Linear-like module, e.g.
        "fc1" or "attn/qkv") -> "colwise" (kernel output features and the bias split,
        Megatron's column parallel) or "rowwise" (kernel input features split, the bias
        whole: row parallel).
      rules: parameter path pattern (a regular expression searched in the leaf name, e.g.
        r"embed") -> a partition of the leaf's dimensions: a list of "tp" or None per
        dimension; for what colwise/rowwise do not say.
      stream: the logical stream of its collectives.
    """

    filter: dict
    devices: tuple[int, ...]
    params: dict = dataclasses.field(default_factory=dict)
    rules: dict = dataclasses.field(default_factory=dict)
    stream: str = "tp"

    def __post_init__(self) -> None:
        where = "shard_tensor"
        object.__setattr__(self, "filter", check_filter(self.filter, where))
        object.__setattr__(self, "devices", check_devices(self.devices, where))
        check_stream(self.stream, "stream", where)
        if not isinstance(self.params, dict) or any(
            not isinstance(k, str) or v not in TENSOR_SPLITS for k, v in self.params.items()
        ):
            raise DirectiveError(
                f"{where}: params maps module names to 'colwise' or 'rowwise', e.g. "
                f"{{'fc1': 'colwise', 'fc2': 'rowwise'}}; got {self.params!r}"
            )
        rules = {}
        for pattern, spec in (self.rules or {}).items():
            if (
                not isinstance(pattern, str)
                or not isinstance(spec, (list, tuple))
                or any(axis not in ("tp", None) for axis in spec)
            ):
                raise DirectiveError(
                    f"{where}: rules maps a parameter path pattern to a list of 'tp' or None "
                    f"per dimension, e.g. {{'embed': ['tp', None]}}; got {pattern!r}: {spec!r}"
                )
            rules[pattern] = tuple(spec)
        if not self.params and not rules:
            raise DirectiveError(f"{where}: give params (colwise/rowwise by module) or rules")
        object.__setattr__(self, "params", dict(self.params))
        object.__setattr__(self, "rules", rules)


@dataclasses.dataclass(frozen=True)
class Order:
    """Run the nodes matched by each group of filters before those of the next group."""

    filters: tuple[tuple[dict, ...], ...]

    def __post_init__(self) -> None:
        if isinstance(self.filters, Mapping) or not isinstance(self.filters, Sequence):
            raise DirectiveError("order: filters must be a list of groups (lists) of filters")
        groups = []
        for i, group in enumerate(self.filters):
            if isinstance(group, Mapping):
                group = [group]
            if not isinstance(group, Sequence) or not group:
                raise DirectiveError(f"order: group {i} must be a non-empty list of filters")
            groups.append(tuple(check_filter(f, f"order group {i}") for f in group))
        object.__setattr__(self, "filters", tuple(groups))


@dataclasses.dataclass(frozen=True)
class Recompute:
    """Activation checkpointing: F keeps for B only its inputs ("inputs": B runs the
    forward again), or also every matrix product's output ("dots": B recomputes only
    the elementwise work between them), or every intermediate but cheap elementwise and
    layout work ("costly": products, divisions, transcendental functions, reductions,
    gathers)."""

    filter: dict
    keep: str = "inputs"

    def __post_init__(self) -> None:
        object.__setattr__(self, "filter", check_filter(self.filter, "recompute"))
        if self.keep not in RECOMPUTE_KEEPS:
            raise DirectiveError(
                f"recompute: keep must be one of {', '.join(map(repr, RECOMPUTE_KEEPS))}, "
                f"got {self.keep!r}"
            )


Directive = Split | Place | Replicate | Shard | ShardTensor | Order | Recompute
DIRECTIVE_TYPES = (Split, Place, Replicate, Shard, ShardTensor, Order, Recompute)
