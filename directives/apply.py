"""Apply a directive list to the training DAG, always in the fixed order:
split -> recompute -> backward split (where an order names BI/BW) -> place -> replicate
-> shard (expert, tensor) -> (placement check) -> gradients and ZeRO collectives ->
transfers -> order -> all-to-alls (experts)."""

from __future__ import annotations

from collections.abc import Sequence

from piper_jax.directives import zero
from piper_jax.directives.backward_split import backwards_to_split, split_backward_nodes
from piper_jax.directives.coverage import check_schedule_coverage
from piper_jax.directives.experts import apply_shards, insert_all_to_alls
from piper_jax.directives.gradients import insert_updates
from piper_jax.directives.order import apply_orders
from piper_jax.directives.place import apply_places, check_placement
from piper_jax.directives.recompute import apply_recompute
from piper_jax.directives.replicate import apply_replicates
from piper_jax.directives.split import apply_split, split_all
from piper_jax.directives.tensor import apply_shard_tensors
from piper_jax.directives.transfers import insert_transfers
from piper_jax.directives.types import (
    DIRECTIVE_TYPES,
    Order,
    Place,
    Recompute,
    Replicate,
    Shard,
    ShardTensor,
    Split,
)
from piper_jax.ir.dag import TrainingDAG
from piper_jax.ir.errors import DirectiveError
from piper_jax.ir.lift import LiftedLoss


def check_directives(directives: Sequence[object]) -> list:
    """Refuse anything that is not a directive, and directives not supported yet."""
    if not isinstance(directives, (list, tuple)):
        raise DirectiveError(f"directives must be a list, got {type(directives).__name__}")
    out = []
    for i, d in enumerate(directives):
        if isinstance(d, (list, tuple)) and all(isinstance(x, Order) for x in d):
            out.extend(d)  # a schedule builder's list of orders, nested by the user
            continue
        if not isinstance(d, DIRECTIVE_TYPES):
            raise DirectiveError(
                f"directive {i} is {d!r}, not a directive: build it with piper_jax.split, "
                "place, replicate, shard, order, recompute or a schedule builder"
            )
        out.append(d)
    splits = [d for d in out if isinstance(d, Split)]
    if len(splits) > 1:
        raise DirectiveError(f"{len(splits)} split directives given; use one split")
    return out


def num_microbatches(directives: Sequence[object]) -> int:
    return next((d.num_microbatches for d in directives if isinstance(d, Split)), 1)


def apply_directives(
    dag: TrainingDAG,
    lifted: LiftedLoss,
    directives: Sequence[object],
    num_devices: int,
    global_norm: bool = False,
    forward_only: bool = False,
) -> TrainingDAG:
    """The DAG after every directive; the DAG is checked after each step.

    Args:
      global_norm: add the `gnorm` ALL_REDUCE (clip by global norm, non-finite guard).
      forward_only: `dag` has forward passes only (evaluation): no backward split, no
        optimizer side, and orders keep their forward passes.
    """
    directives = check_directives(directives)
    if forward_only:
        directives = [forward_part(d) if isinstance(d, Order) else d for d in directives]
        directives = [d for d in directives if d is not None]
    splits = [d for d in directives if isinstance(d, Split)]
    dag = apply_split(dag, splits[0]) if splits else split_all(dag, 1)
    for i, d in enumerate(directives):
        if isinstance(d, Recompute):
            dag = apply_recompute(dag, d, i)
    orders = [d for d in directives if isinstance(d, Order)]
    dag = split_backward_nodes(dag, backwards_to_split(dag, orders))
    dag = apply_places(dag, [d for d in directives if isinstance(d, Place)], num_devices)
    dag = apply_replicates(dag, [d for d in directives if isinstance(d, Replicate)], num_devices)
    tensors = [d for d in directives if isinstance(d, ShardTensor)]
    dag = apply_shard_tensors(dag, lifted, tensors, num_devices)
    dag = apply_shards(dag, lifted, [d for d in directives if isinstance(d, Shard)], num_devices)
    dag = check_placement(
        dag, any(isinstance(d, (Place, Replicate, ShardTensor, Shard)) for d in directives)
    )
    if forward_only:
        zero.insert_gathers(dag, lifted)
    else:
        dag = insert_updates(dag, lifted, global_norm)
    dag = insert_transfers(dag)
    dag = apply_orders(dag, [(i, d) for i, d in enumerate(directives) if isinstance(d, Order)])
    dag = insert_all_to_alls(dag)
    if not forward_only:
        check_schedule_coverage(dag, directives)
    dag.check_acyclic("the directives")
    return dag


def forward_part(order: Order) -> Order | None:
    """`order` with its backward passes left out (None if nothing is left)."""
    groups = [[f for f in group if f.get("PASS", "F") == "F"] for group in order.filters]
    groups = [g for g in groups if g]
    return Order(groups) if groups else None
