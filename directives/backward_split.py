"""Backward split: B -> BI + BW for every region an order names BI or BW for.

BI takes B's inputs and produces the input cotangents; BW takes the residuals and what
BI computed (see Note [why BW runs after BI, and reuses it]) and produces the weight
gradients, so it feeds the gradient collectives and the update.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Sequence

from piper_jax.directives.filters import matches
from piper_jax.directives.types import Order
from piper_jax.ir.dag import EdgeKind, NodeKind, TrainingDAG
from piper_jax.ir.errors import DirectiveError


def regions_to_split(dag: TrainingDAG, orders: Sequence[Order]) -> set[int]:
    """Regions whose backward an order filter names as BI or BW."""
    named = [
        {k: v for k, v in f.items() if k != "PASS"}
        for order in orders
        for group in order.filters
        for f in group
        if f.get("PASS") in ("BI", "BW")
    ]
    return {
        n.region
        for n in dag.compute_nodes()
        if n.pass_ == "B" and any(matches(f, n.tags) for f in named)
    }


def split_backward_nodes(dag: TrainingDAG, regions: set[int]) -> TrainingDAG:
    out = dag.copy()
    for b in list(dag.compute_nodes()):
        if b.pass_ != "B" or b.region not in regions:
            continue
        if b.recompute:
            raise DirectiveError(
                f"region {dict(b.region_tags)} is both recomputed and split into BI/BW; "
                "drop one of the two directives for it"
            )
        bi = dataclasses.replace(b, pass_="BI")
        bw = out.add(dataclasses.replace(b, uid=out.new_uid(), pass_="BW"))
        out.replace(bi)
        out.connect(bi.uid, bw.uid)
        for e in dag.edges:
            if e.src == b.uid and dag.nodes[e.dst].kind in (NodeKind.UPD, NodeKind.ALL_REDUCE):
                out.edges.discard(e)
                out.connect(bw.uid, e.dst, e.kind)
            if (
                e.dst == b.uid
                and e.kind is EdgeKind.DATA
                and dag.nodes[e.src].pass_ == "F"
                and dag.nodes[e.src].region == b.region
            ):
                out.connect(e.src, bw.uid)  # BW reads the residuals too
    return out
