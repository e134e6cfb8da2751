"""Schedule coverage: a schedule builder's orders must order all the work of its stages.

A hand-written `order` may name part of the work; the passes it leaves out run where
their data allows. A builder instead promises a whole schedule, so orders built for
fewer stages or microbatches than the DAG has (`one_f_one_b(1, 4)` on a 2-stage model,
`one_f_one_b(2, 2)` under a split of 4) would silently leave passes unordered: a slower
step and more activations held than the schedule's own. Builders record the orders they
return here (`mark_built`), and `check_schedule_coverage` refuses such a partial one.
"""

from __future__ import annotations

import dataclasses
import weakref
from collections.abc import Iterable, Sequence

from piper_jax.directives.filters import filter_str, matches
from piper_jax.directives.types import Order
from piper_jax.ir.dag import Node, TrainingDAG
from piper_jax.ir.errors import DirectiveError


@dataclasses.dataclass(frozen=True)
class BuiltSchedule:
    """One schedule builder call: as the user wrote it, and the tags its orders name."""

    call: str
    tag: str
    dim_name: str


# id(order) -> (a weak reference to it, the call that built it). Orders are unhashable
# (their filters are dicts), so a WeakSet cannot hold them; the entry goes with the order.
_BUILT: dict[int, tuple[weakref.ref, BuiltSchedule]] = {}


def mark_built(orders: list[Order], call: str, tag: str, dim_name: str) -> list[Order]:
    """Record that `orders` are the whole output of the builder call `call`."""
    built = BuiltSchedule(call, tag, dim_name)
    for order in orders:
        key = id(order)

        def forget(ref: weakref.ref, key: int = key) -> None:
            if _BUILT.get(key, (None,))[0] is ref:
                del _BUILT[key]

        _BUILT[key] = (weakref.ref(order, forget), built)
    return orders


def built_by(order: Order) -> BuiltSchedule | None:
    """The builder call that made `order`, or None for a hand-written (or loaded) one."""
    entry = _BUILT.get(id(order))
    return entry[1] if entry is not None and entry[0]() is order else None


def check_schedule_coverage(dag: TrainingDAG, directives: Sequence[object]) -> None:
    """Refuse a builder's schedule that leaves some pass of its tag's regions unordered.

    Every compute node carrying the builder's tag (each stage, microbatch and pass)
    must be named by some order directive (the builder's own, or a hand-written one
    that orders the rest).
    """
    orders = [d for d in directives if isinstance(d, Order)]
    filters = [f for order in orders for group in order.filters for f in group]
    compute = list(dag.compute_nodes())
    checked: set[BuiltSchedule] = set()
    for order in orders:
        built = built_by(order)
        if built is None or built in checked:
            continue
        checked.add(built)
        nodes = [n for n in compute if built.tag in n.tags]
        missed = _unordered(nodes, filters, built)
        if missed:
            mine = [f for o in orders if built_by(o) == built for g in o.filters for f in g]
            raise DirectiveError(
                f"schedule {built.call} orders {_extent(built, mine)}, but the "
                f"DAG has {_extent(built, (n.tags for n in nodes))}: {len(missed)} passes "
                f"would run in no set order ({_examples(missed, built)}). Build the schedule "
                "for the model's stages and the split's microbatches, or order the rest "
                "with piper.order"
            )


def _unordered(nodes: list[Node], filters: list[dict], built: BuiltSchedule) -> list[Node]:
    """The nodes no filter names; exact (tag, dim, PASS) filters are looked up in a set."""
    exact = {_key(f, built) for f in filters if _is_exact(f, built)}
    general = [f for f in filters if not _is_exact(f, built)]
    return [
        n
        for n in nodes
        if _key(n.tags, built) not in exact and not any(matches(f, n.tags) for f in general)
    ]


def _is_exact(flt: dict, built: BuiltSchedule) -> bool:
    """A filter naming one stage, one microbatch and one pass, and nothing else."""
    return set(flt) == {built.tag, built.dim_name, "PASS"} and all(
        isinstance(flt[k], int) for k in (built.tag, built.dim_name)
    )


def _key(tags: dict, built: BuiltSchedule) -> tuple:
    return tags.get(built.tag), tags.get(built.dim_name), tags.get("PASS")


def _extent(built: BuiltSchedule, tag_sets: Iterable[dict]) -> str:
    """'PP 0..1 for MB 0..3' over the int values of the tag and the microbatch dim."""
    stages: set[int] = set()
    mbs: set[int] = set()
    for tags in tag_sets:
        for values, name in ((stages, built.tag), (mbs, built.dim_name)):
            if isinstance(tags.get(name), int):
                values.add(tags[name])
    return f"{built.tag} {_indices(stages)} for {built.dim_name} {_indices(mbs)}"


def _indices(values: set[int]) -> str:
    ordered = sorted(values)
    if len(ordered) > 1 and ordered == list(range(ordered[0], ordered[-1] + 1)):
        return f"{ordered[0]}..{ordered[-1]}"
    return ", ".join(map(str, ordered)) or "none"


def _examples(nodes: list[Node], built: BuiltSchedule, limit: int = 4) -> str:
    shown = [
        filter_str({k: n.tags[k] for k in (built.tag, built.dim_name, "PASS") if k in n.tags})
        for n in nodes[:limit]
    ]
    return ", ".join(shown) + (", ..." if len(nodes) > limit else "")
