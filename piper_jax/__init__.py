"""piper-jax: a programmable distributed training compiler for JAX."""

from collections.abc import Sequence
from typing import Any

from piper_jax import distributed, schedules
from piper_jax.annotate import annotate, annotate_module
from piper_jax.directives import dump_directives, load_directives
from piper_jax.directives.types import (
    Order,
    Place,
    Recompute,
    Replicate,
    Shard,
    ShardTensor,
    Split,
)
from piper_jax.ir.errors import (
    AnnotationError,
    BatchError,
    DirectiveError,
    DistributedError,
    PiperError,
    PlanError,
)
from piper_jax.lowering import Lowered, lower
from piper_jax.search import SearchResult, search
from piper_jax.train_step import NonFiniteError, TrainStep, compile


def split(filter: dict, dim_name: str = "MB", *, num_microbatches: int) -> Split:
    """Cut the global batch into `num_microbatches` microbatches (tag MB=i)."""
    return Split(filter, num_microbatches, dim_name)


def place(filter: dict, devices: Sequence[int], stream: str = "default") -> Place:
    """Run the regions matched by `filter` on `devices` (indices into the step's devices)."""
    return Place(filter, devices, stream)


def replicate(
    filter: dict,
    devices: Sequence[int],
    shard_grads: bool = False,
    shard_params: bool = False,
    bucket_size: float | None = None,
    reduce_stream: str = "dp",
    gather_stream: str = "dp",
) -> Replicate:
    """Data parallelism over `devices`; gradients are all-reduced."""
    return Replicate(
        filter, devices, shard_grads, shard_params, bucket_size, reduce_stream, gather_stream
    )


def shard(filter: dict, devices: Sequence[int], stream: str = "ep") -> Shard:
    """Expert parallelism (not supported by the compiler yet: refused at compile)."""
    return Shard(filter, devices, stream)


def shard_tensor(
    filter: dict,
    devices: Sequence[int],
    params: dict | None = None,
    rules: dict | None = None,
    stream: str = "tp",
) -> ShardTensor:
    """Tensor parallelism: the matched regions' parameters split over `devices` (a `tp`
    axis), by module name (`params={"fc1": "colwise", "fc2": "rowwise"}`, Megatron
    style) or by parameter path pattern (`rules={"embed": ["tp", None]}`)."""
    return ShardTensor(filter, devices, params or {}, rules or {}, stream)


def order(filters: Sequence[Any]) -> Order:
    """Run nodes matched by each group of filters before those of the next group."""
    return Order(filters)


def recompute(filter: dict, keep: str = "inputs") -> Recompute:
    """Activation checkpointing: matched regions keep only their inputs and run their
    forward again inside the backward (keep="inputs"), or also keep every matrix
    product's output and recompute only the elementwise work (keep="dots")."""
    return Recompute(filter, keep)


__all__ = [
    "AnnotationError",
    "BatchError",
    "DirectiveError",
    "DistributedError",
    "Lowered",
    "NonFiniteError",
    "PiperError",
    "PlanError",
    "ShardTensor",
    "TrainStep",
    "annotate",
    "annotate_module",
    "compile",
    "distributed",
    "dump_directives",
    "load_directives",
    "lower",
    "order",
    "place",
    "recompute",
    "replicate",
    "schedules",
    "search",
    "SearchResult",
    "shard",
    "shard_tensor",
    "split",
]
