"""Backward split: B -> BI + BW for every (region, microbatch) an order names BI or BW for.

BI takes B's inputs and produces the input cotangents; BW takes the residuals and what
BI computed (see Note [why BW runs after BI, and reuses it]) and produces the weight
gradients, so it feeds the gradient collectives and the update. The split is per
(region, microbatch), as in the reference Piper: a stage may run a fused B for some
microbatches and BI + BW for others (DualPipeV does).
"""

from __future__ import annotations

import dataclasses
from collections.abc import Sequence

from piper_jax.directives.filters import NodeIndex
from piper_jax.directives.types import Order
from piper_jax.ir.dag import EdgeKind, Node, TrainingDAG
from piper_jax.ir.errors import DirectiveError


def backwards_to_split(dag: TrainingDAG, orders: Sequence[Order]) -> list[Node]:
    """The B nodes (one per region and microbatch) an order filter names as BI or BW."""
    named = [
        {k: v for k, v in f.items() if k != "PASS"}
        for order in orders
        for group in order.filters
        for f in group
        if f.get("PASS") in ("BI", "BW")
    ]
    if not named:
        return []
    index = NodeIndex(n for n in dag.compute_nodes() if n.pass_ == "B")
    found = {n.uid: n for f in named for n in index.select(f)}
    return [found[uid] for uid in sorted(found)]


def split_backward_nodes(dag: TrainingDAG, backwards: Sequence[Node]) -> TrainingDAG:
    """Each of `backwards` becomes BI (keeping its uid and inputs) and a new BW node that
    takes over its edges to the optimizer side and also reads the forward's residuals."""
    out = dag.copy()
    for b in backwards:
        if b.recompute:
            raise DirectiveError(
                f"region {dict(b.region_tags)} is both recomputed and split into BI/BW "
                f"({b}); drop one of the two directives for it"
            )
        bi = dataclasses.replace(b, pass_="BI")
        bw = out.add(dataclasses.replace(b, uid=out.new_uid(), pass_="BW"))
        out.replace(bi)
        out.connect(bi.uid, bw.uid)
        for e in dag.out_edges(b.uid):
            if dag.nodes[e.dst].kind.value != "COMPUTE":
                out.disconnect(e)
                out.connect(bw.uid, e.dst, e.kind)
        for e in dag.in_edges(b.uid):
            src = dag.nodes[e.src]
            if e.kind is EdgeKind.DATA and src.pass_ == "F" and src.region == b.region:
                out.connect(e.src, bw.uid)  # BW reads the residuals too
    return out
