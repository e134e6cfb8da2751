"""`annotate` and `annotate_module`: mark regions of model code (see Note [how regions
survive tracing])."""

from __future__ import annotations

import dataclasses
import functools
import threading
from typing import Any

import jax
from flax import nnx

from piper_jax.ir import jax_compat
from piper_jax.ir.errors import AnnotationError
from piper_jax.ir.regions import check_tag, scope_name

_state = threading.local()


def _next_indices() -> dict[str, int]:
    if not hasattr(_state, "next"):
        _state.next = {}
    return _state.next


def _open_annotations() -> list[_Open]:
    if not hasattr(_state, "open"):
        _state.open = []
    return _state.open


def reset_annotation_counters() -> None:
    """Restart automatic indices and forget unclosed annotations; the lifter calls this
    before each trace."""
    _state.next = {}
    _state.open = []


def _check_index(tag: str, index: object) -> None:
    if isinstance(index, bool) or not isinstance(index, int) or index < 0:
        raise AnnotationError(f"annotate({tag!r}, {index!r}): index must be a non-negative int")


def annotate(tag: str, index: int | None = None) -> _Annotation:
    """Mark the code inside a `with annotate(...)` block as one region of the training DAG.

    Args:
      tag: the region's tag, e.g. "PP" for a pipeline stage or "EP" for an expert layer.
      index: explicit index; by default each entry of `tag` while tracing takes the next
        index (0, 1, 2, ...). Nested annotations combine: {"PP": 1, "EP": 0}; a tag may
        not be nested in itself.
    """
    check_tag(tag)
    if index is not None:
        _check_index(tag, index)
    return _Annotation(tag, index)


@dataclasses.dataclass(eq=False)
class _Open:
    """One entered, not yet exited annotation (compared by identity)."""

    tag: str
    index: int
    scope: Any


class _Annotation:
    """The context manager of `annotate`. A class, not a generator: an annotation never
    exited must not restore JAX's name stack later, whenever it is garbage collected."""

    def __init__(self, tag: str, index: int | None):
        self.tag, self.index = tag, index
        self._entered: list[_Open] = []

    def __enter__(self) -> None:
        tag, table, opened = self.tag, _next_indices(), _open_annotations()
        index = table.get(tag, 0) if self.index is None else self.index
        outer = next((a for a in opened if a.tag == tag), None)
        if outer is not None:
            raise AnnotationError(
                f"annotate({tag!r}, {index}) at {jax_compat.caller_location()} is entered "
                f"while annotate({tag!r}, {outer.index}) is still open: a region cannot carry "
                f"tag {tag!r} twice ({{{tag}:{outer.index},{tag}:{index}}}); close the first "
                "one before (use `with` blocks), or give the nested region another tag"
            )
        table[tag] = max(table.get(tag, 0), index + 1)
        entry = _Open(tag, index, jax.named_scope(scope_name(tag, index)))
        entry.scope.__enter__()
        opened.append(entry)
        self._entered.append(entry)

    def __exit__(self, *exc: object) -> None:
        entry, opened = self._entered.pop(), _open_annotations()
        if entry not in opened:  # forgotten by reset_annotation_counters
            return
        inner = opened[opened.index(entry) + 1 :]
        opened.remove(entry)
        entry.scope.__exit__(*exc)
        if inner and exc[0] is None:
            raise AnnotationError(
                f"annotate({entry.tag!r}, {entry.index}) is exited at "
                f"{jax_compat.caller_location()} while annotate({inner[0].tag!r}, "
                f"{inner[0].index}), entered inside it, is still open: exit annotations in "
                "the reverse order of entry (use `with` blocks)"
            )


def annotate_module(module: nnx.Module, tag: str, index: int | None = None) -> nnx.Module:
    """Tag a module instance from outside, for models you do not own: every call of this
    instance runs inside `annotate(tag, index)`.

    Only this instance changes (its class becomes a subclass whose `__call__` enters the
    annotation); other instances of its class, its parameters and their paths stay as
    they are, and nnx.split/merge keep the tag. Other methods than `__call__` are not
    annotated.

    Args:
      module: an nnx.Module instance inside the model, e.g. `model.layers[3]`.
      tag, index: as for `annotate`; index None takes the next index at each call.

    Returns:
      The same module, for chaining.
    """
    if not isinstance(module, nnx.Module):
        raise AnnotationError(
            f"annotate_module takes an nnx.Module instance (e.g. model.layers[3]), got {module!r}"
        )
    check_tag(tag)
    if index is not None:
        _check_index(tag, index)
    cls = type(module)
    for c in cls.__mro__:
        have = c.__dict__.get("_piper_annotation")
        if have is not None and have[0] == tag:
            raise AnnotationError(
                f"annotate_module({cls.__name__}, {tag!r}, {index}): this instance is "
                f"already annotated with {tag!r} (index {have[1]}); annotate it once per tag"
            )
    call = cls.__call__

    @functools.wraps(call)
    def __call__(self, *args, **kwargs):
        with annotate(tag, index):
            return call(self, *args, **kwargs)

    namespace = {
        "__call__": __call__,
        "_piper_annotation": (tag, index),
        "__module__": cls.__module__,
        "__qualname__": cls.__qualname__,
    }
    module.__class__ = type(cls)(cls.__name__, (cls,), namespace)
    return module
