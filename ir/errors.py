"""Errors a user can cause. They live in the IR, the bottom layer, so every layer can raise them."""

from __future__ import annotations


class PiperError(ValueError):
    """Base of every error a user can cause: bad annotation, directive, batch, plan or peer."""


class AnnotationError(PiperError):
    """A region annotation is malformed or the traced model cannot be cut into regions."""


class DirectiveError(PiperError):
    """A directive is malformed or does not fit the training DAG."""


class BatchError(PiperError):
    """A batch does not have the structure or the sizes the compiled step expects."""


class PlanError(PiperError):
    """The per-device plans cannot run to completion (deadlock or mismatched communication)."""


class DistributedError(PiperError):
    """The processes of a run cannot be joined (bad launcher environment, wrong call order)."""
