"""Filters: which DAG nodes a directive talks about, by their tags."""

from __future__ import annotations

from collections.abc import Iterable, Mapping

from piper_jax.ir.dag import Node


def matches(flt: Mapping[str, int | str], tags: Mapping[str, int | str]) -> bool:
    """True when every entry of `flt` agrees with `tags` ('*': present, '-': absent)."""
    for tag, want in flt.items():
        have = tags.get(tag)
        if want == "-":
            if have is not None:
                return False
        elif have is None or (want != "*" and have != want):
            return False
    return True


def select(nodes: Iterable[Node], flt: Mapping[str, int | str]) -> list[Node]:
    return [n for n in nodes if matches(flt, n.tags)]


def filter_str(flt: Mapping[str, int | str]) -> str:
    return "{" + ",".join(f"{k}:{v}" for k, v in flt.items()) + "}"
