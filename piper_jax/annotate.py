"""`annotate`: mark a region of model code (see Note [how regions survive tracing])."""

from __future__ import annotations

import contextlib
import threading
from collections.abc import Iterator

import jax

from piper_jax.ir.errors import AnnotationError
from piper_jax.ir.regions import check_tag, scope_name

_state = threading.local()


def _next_indices() -> dict[str, int]:
    if not hasattr(_state, "next"):
        _state.next = {}
    return _state.next


def reset_annotation_counters() -> None:
    """Restart automatic indices; the lifter calls this before each trace."""
    _state.next = {}


@contextlib.contextmanager
def annotate(tag: str, index: int | None = None) -> Iterator[None]:
    """Mark the code inside the block as one region of the training DAG.

    Args:
      tag: the region's tag, e.g. "PP" for a pipeline stage or "EP" for an expert layer.
      index: explicit index; by default each entry of `tag` while tracing takes the next
        index (0, 1, 2, ...). Nested annotations combine: {"PP": 1, "EP": 0}.
    """
    check_tag(tag)
    table = _next_indices()
    if index is None:
        index = table.get(tag, 0)
    elif isinstance(index, bool) or not isinstance(index, int) or index < 0:
        raise AnnotationError(f"annotate({tag!r}, {index!r}): index must be a non-negative int")
    table[tag] = max(table.get(tag, 0), index + 1)
    with jax.named_scope(scope_name(tag, index)):
        yield
