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


class NodeIndex:
    """Nodes by (tag, value), so that a filter naming concrete values selects its nodes
    by intersecting a few sets instead of testing every node: schedules hold one filter
    per (stage, microbatch, pass), and a scan per filter made orders quadratic."""

    def __init__(self, nodes: Iterable[Node]):
        self.nodes = list(nodes)
        self._by: dict[tuple[str, int | str], set[int]] = {}
        for i, n in enumerate(self.nodes):
            for tag, value in n.tags.items():
                self._by.setdefault((tag, value), set()).add(i)
                self._by.setdefault((tag, "*"), set()).add(i)

    def select(self, flt: Mapping[str, int | str]) -> list[Node]:
        """The nodes `flt` matches, in index order (as `select` would return them)."""
        wanted = [self._by.get((tag, value), set()) for tag, value in flt.items() if value != "-"]
        if not wanted:
            return select(self.nodes, flt)
        hits = set.intersection(*sorted(wanted, key=len))
        return [self.nodes[i] for i in sorted(hits) if matches(flt, self.nodes[i].tags)]
