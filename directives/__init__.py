"""Directives: pure DAG -> DAG passes that say how a model is parallelised."""

from piper_jax.directives.apply import apply_directives, check_directives, num_microbatches
from piper_jax.directives.json_format import dump_directives, load_directives
from piper_jax.directives.types import Order, Place, Recompute, Replicate, Shard, Split

__all__ = [
    "Order",
    "Place",
    "Recompute",
    "Replicate",
    "Shard",
    "Split",
    "apply_directives",
    "check_directives",
    "dump_directives",
    "load_directives",
    "num_microbatches",
]
