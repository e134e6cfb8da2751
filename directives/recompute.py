"""recompute: matched regions keep only their inputs (or also their matrix products'
outputs) and run the forward (or its elementwise rest) again in B."""

from __future__ import annotations

import dataclasses

from piper_jax.directives.filters import filter_str, select
from piper_jax.directives.types import Recompute
from piper_jax.ir.dag import TrainingDAG
from piper_jax.ir.errors import DirectiveError


def apply_recompute(dag: TrainingDAG, directive: Recompute, index: int) -> TrainingDAG:
    dag = dag.copy()
    nodes = select(dag.compute_nodes(), directive.filter)
    if not nodes:
        raise DirectiveError(
            f"directive {index} (recompute {filter_str(directive.filter)}): filter matches "
            "no region"
        )
    regions = {n.region for n in nodes}
    for n in list(dag.compute_nodes()):
        if n.region in regions:
            dag.replace(dataclasses.replace(n, recompute=directive.keep))
    return dag
