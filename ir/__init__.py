"""The IR: regions lifted from a traced loss, and the training DAG built from them."""

from piper_jax.ir.build import build_dag, region_meshes
from piper_jax.ir.dag import Edge, EdgeKind, Node, NodeKind, TrainingDAG
from piper_jax.ir.errors import (
    AnnotationError,
    BatchError,
    DirectiveError,
    PiperError,
    PlanError,
)
from piper_jax.ir.layout import DeviceMesh, Layout, ParamLayout, group_str
from piper_jax.ir.lift import ActRef, LiftedLoss, Region, lift

__all__ = [
    "ActRef",
    "AnnotationError",
    "BatchError",
    "DeviceMesh",
    "DirectiveError",
    "Edge",
    "EdgeKind",
    "Layout",
    "LiftedLoss",
    "Node",
    "NodeKind",
    "ParamLayout",
    "PiperError",
    "PlanError",
    "Region",
    "TrainingDAG",
    "build_dag",
    "group_str",
    "lift",
    "region_meshes",
]
