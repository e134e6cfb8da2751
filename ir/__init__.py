"""The IR: regions lifted from a traced loss, and the training DAG built from them."""

from piper_jax.ir.build import attach_updates, build_dag
from piper_jax.ir.dag import Edge, EdgeKind, Node, NodeKind, TrainingDAG, group_str
from piper_jax.ir.errors import (
    AnnotationError,
    BatchError,
    DirectiveError,
    PiperError,
    PlanError,
)
from piper_jax.ir.lift import ActRef, LiftedLoss, Region, lift

__all__ = [
    "ActRef",
    "AnnotationError",
    "BatchError",
    "DirectiveError",
    "Edge",
    "EdgeKind",
    "LiftedLoss",
    "Node",
    "NodeKind",
    "PiperError",
    "PlanError",
    "Region",
    "TrainingDAG",
    "attach_updates",
    "build_dag",
    "group_str",
    "lift",
]
