"""Region keys and the scope names that carry them through tracing.

Note [how regions survive tracing]
`piper_jax.annotate` enters a `jax.named_scope` whose name encodes one tag and index,
``piper[PP=1]``. Nested annotations nest scopes, so every equation of a traced jaxpr
carries its full region in ``eqn.source_info.name_stack`` (checked on jax 0.10.2 for
NNX modules and custom_jvp calls). A marker primitive would need transpose and batching
rules; a scope needs nothing and is invisible to XLA.
"""

from __future__ import annotations

import re
from collections.abc import Iterable

from piper_jax.ir.errors import AnnotationError

# A region is the tuple of (tag, index) pairs, outermost annotation first.
RegionKey = tuple[tuple[str, int], ...]

SYSTEM_TAGS = ("MB", "PASS")
_TAG_RE = re.compile(r"^[A-Za-z_][A-Za-z0-9_]*$")
_SCOPE_RE = re.compile(r"^piper\[([A-Za-z_][A-Za-z0-9_]*)=(\d+)\]$")


def check_tag(tag: str) -> None:
    """Refuse tags that could not round-trip through a scope name or collide with system tags."""
    if not isinstance(tag, str) or not _TAG_RE.match(tag):
        raise AnnotationError(
            f"annotation tag {tag!r} is not a valid tag: use an identifier such as 'PP' or 'EP'"
        )
    if tag in SYSTEM_TAGS:
        raise AnnotationError(
            f"annotation tag {tag!r} is reserved for the system (MB, PASS); pick another name"
        )


def scope_name(tag: str, index: int) -> str:
    return f"piper[{tag}={index}]"


def region_from_name_stack(name_stack: str) -> RegionKey:
    """The region an equation belongs to, read from its name stack ('' if unannotated)."""
    key = []
    for part in str(name_stack).split("/"):
        m = _SCOPE_RE.match(part)
        if m:
            key.append((m.group(1), int(m.group(2))))
    return tuple(key)


def region_str(key: RegionKey | Iterable[tuple[str, int]]) -> str:
    """Short form of a region, as a user writes it in a filter: {PP:1,EP:0}."""
    return "{" + ",".join(f"{t}:{i}" for t, i in key) + "}"
