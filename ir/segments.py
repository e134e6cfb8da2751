"""Which region each equation of a traced loss belongs to (the rule in ir/lift.py's docstring).

Why every data dependency points forward (a region reads only regions of smaller index,
so regions run in index order): annotated equations form contiguous segments in trace
order; an equation placed by its consumers joins the smallest region among them, so it runs
no later than any reader; one placed by its producers joins the largest region among them,
so it runs no earlier than any writer; an equation placed by consumers never reads one
placed by producers (that one would then feed annotated code too).
"""

from __future__ import annotations

import dataclasses
import os
from typing import Any

from piper_jax.ir import jax_compat as jc
from piper_jax.ir.errors import AnnotationError
from piper_jax.ir.regions import RegionKey, region_from_name_stack, region_str


@dataclasses.dataclass(frozen=True)
class Assignment:
    """The region of every equation, the key of every region, and per region the short
    descriptions ("add at model.py:31") of the unannotated code it absorbed."""

    region_of_eqn: list[int]
    keys: list[RegionKey]
    absorbed: list[tuple[str, ...]]


def assign_regions(eqns: list[Any]) -> Assignment:
    """Cut `eqns` into regions: one per contiguous run of equally annotated equations,
    with every unannotated equation placed by the rule of ir/lift.py's docstring."""
    _check_annotations_visible(eqns)
    tags = [region_from_name_stack(jc.eqn_name_stack(e)) for e in eqns]
    region: list[int | None] = [None] * len(eqns)
    keys: list[RegionKey] = []
    for i, key in enumerate(tags):
        if key:
            if not keys or keys[-1] != key:
                keys.append(key)
            region[i] = len(keys) - 1
    if not keys:
        return Assignment([0] * len(eqns), [()], [()])

    producer: dict[Any, int] = {}
    consumers: dict[Any, list[int]] = {}
    for i, eqn in enumerate(eqns):
        for v in eqn.invars:
            if jc.is_var(v):
                consumers.setdefault(v, []).append(i)
        for v in eqn.outvars:
            producer[v] = i
    free = [i for i, key in enumerate(tags) if not key]

    def by_consumers(i: int) -> list[int]:
        found = (region[c] for v in eqns[i].outvars for c in consumers.get(v, []))
        return [r for r in found if r is not None]

    def by_producers(i: int) -> list[int]:
        found = (region[producer[v]] for v in eqns[i].invars if jc.is_var(v) and v in producer)
        return [r for r in found if r is not None]

    for i in reversed(free):  # feeds annotated code: the earliest region using it
        region[i] = min(by_consumers(i), default=None)
    for i in free:  # feeds only the loss: the latest region it reads
        if region[i] is None:
            region[i] = max(by_producers(i), default=None)
    for i in reversed(free):  # reads no region: the earliest region using it, else the last
        if region[i] is None:
            region[i] = min(by_consumers(i), default=len(keys) - 1)

    absorbed: list[dict[str, None]] = [{} for _ in keys]
    for i in free:
        where = jc.eqn_location(eqns[i])
        file, _, line = where.rpartition(":")
        absorbed[region[i]][f"{eqns[i].primitive} at {os.path.basename(file)}:{line}"] = None
    return Assignment(region, keys, [tuple(a) for a in absorbed])


def _check_annotations_visible(eqns: list[Any]) -> None:
    """Refuse annotations inside a nested jaxpr: the lifter cuts only the outer one, so
    those regions would silently vanish."""
    for eqn in eqns:
        for inner in jc.nested_eqns(eqn):
            key = region_from_name_stack(jc.eqn_name_stack(inner))
            if key:
                raise AnnotationError(
                    f"annotation {region_str(key)} at {jc.eqn_location(inner)} is inside a "
                    f"'{eqn.primitive}' call (jax.jit, jax.checkpoint, scan, ...) made at "
                    f"{jc.eqn_location(eqn)}: the lifter sees only the outer call, so that "
                    "region would be lost; call the function without the transform inside "
                    "the loss (compile jits every region itself, and piper.recompute does "
                    "checkpointing), or annotate around the call"
                )
