"""split: copy every compute node once per microbatch (UPD is not copied: that is
gradient accumulation)."""

from __future__ import annotations

import dataclasses

from piper_jax.directives.filters import filter_str, select
from piper_jax.directives.types import Split
from piper_jax.ir.dag import NodeKind, TrainingDAG
from piper_jax.ir.errors import DirectiveError
from piper_jax.ir.regions import region_str


def apply_split(dag: TrainingDAG, directive: Split) -> TrainingDAG:
    compute = list(dag.compute_nodes())
    matched = select(compute, directive.filter)
    where = f"split {filter_str(directive.filter)}"
    regions = list(dict.fromkeys(region_str(n.region_tags) for n in compute))
    if not matched:
        hint = (
            "the model has no annotated region: mark regions with piper.annotate or "
            "piper.annotate_module in the code the loss runs"
            if regions == ["{}"]
            else "check the tag's spelling (tags are case-sensitive)"
        )
        raise DirectiveError(
            f"{where}: filter matches no region; the regions are {', '.join(regions)}: {hint}"
        )
    missed = [r for r in regions if r not in {region_str(n.region_tags) for n in matched}]
    if missed:
        raise DirectiveError(
            f"{where} leaves regions {', '.join(missed)} whole: every region must be split "
            "the same way (use {'PP': '*'} or a filter covering all)"
        )
    return split_all(dag, directive.num_microbatches)


def split_all(dag: TrainingDAG, m: int) -> TrainingDAG:
    """Every compute node copied m times, MB=0..m-1 (m=1 when no split is given)."""
    out = TrainingDAG()
    copies: dict[int, list[int]] = {}
    for uid, node in sorted(dag.nodes.items()):
        if node.kind is NodeKind.COMPUTE:
            copies[uid] = []
            for mb in range(m):
                copy = dataclasses.replace(node, uid=out.new_uid(), microbatch=mb)
                copies[uid].append(out.add(copy).uid)
        else:
            copies[uid] = [out.add(dataclasses.replace(node, uid=out.new_uid())).uid]
    for e in dag.edges:
        src, dst = copies[e.src], copies[e.dst]
        if len(src) == len(dst):
            for a, b in zip(src, dst):
                out.connect(a, b, e.kind)
        else:
            for a in src:
                for b in dst:
                    out.connect(a, b, e.kind)
    return out
