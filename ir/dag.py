"""The global training DAG: every compute and communication node of one training step."""

from __future__ import annotations

import dataclasses
import enum
import json
from collections.abc import Iterable, Iterator

from piper_jax.ir.errors import DirectiveError

PASSES = ("F", "B", "BI", "BW")


class NodeKind(enum.StrEnum):
    COMPUTE = "COMPUTE"
    UPD = "UPD"
    SEND = "SEND"
    RECV = "RECV"
    ALL_REDUCE = "ALL_REDUCE"
    REDUCE_SCATTER = "REDUCE_SCATTER"
    ALL_GATHER = "ALL_GATHER"
    ALL_TO_ALL = "ALL_TO_ALL"


class EdgeKind(enum.StrEnum):
    DATA = "data"
    TEMPORAL = "temporal"


def group_str(devices: Iterable[int]) -> str:
    """A device group as written in plans: d0, d0,2."""
    return "d" + ",".join(str(d) for d in devices)


@dataclasses.dataclass(frozen=True)
class Node:
    """One node of the DAG.

    Attributes:
      uid: unique id, also the tie-breaking priority (lower runs first when free to).
      kind: what the node does.
      region: the region index of compute nodes and of the nodes serving them.
      region_tags: the region's annotation tags, e.g. (("PP", 1),).
      pass_: F, B, BI or BW for compute nodes.
      microbatch: the MB index once `split` ran.
      devices: the device group (indices into the step's devices); replicas when
        `replicated`.
      replicated: the node runs the same program on each device, on its own batch slice.
      stream: the logical stream named by the directive that placed it.
      params: parameter leaves an UPD node updates or a collective reduces.
      peer: the other side's device group of a SEND (destination) or RECV (source).
      carries: uid of the compute node whose output a SEND/RECV moves.
      recompute: the region's forward is run again inside its backward (`recompute`).
      zero: 0, or the ZeRO stage of a replicated group: 2 (`shard_grads`) or 3
        (`shard_params`); see Note [ZeRO in piper-jax].
      bucket_mb: `replicate(bucket_size=)`: gradient all-reduces of the region's group are
        cut into buckets of at most this many MB.
      overlap: nodes sharing an id were named in one order group: they run as one unit,
        back to back, once all of them have their inputs (see directives/order.py).
    """

    uid: int
    kind: NodeKind
    region: int | None = None
    region_tags: tuple[tuple[str, int], ...] = ()
    pass_: str | None = None
    microbatch: int | None = None
    devices: tuple[int, ...] = ()
    replicated: bool = False
    stream: str = "default"
    params: tuple[int, ...] = ()
    peer: tuple[int, ...] = ()
    carries: int | None = None
    recompute: bool = False
    overlap: int | None = None
    zero: int = 0
    bucket_mb: float | None = None

    @property
    def tags(self) -> dict[str, int | str]:
        """Region tags plus the system tags MB and PASS, as filters see them."""
        tags: dict[str, int | str] = dict(self.region_tags)
        if self.microbatch is not None:
            tags["MB"] = self.microbatch
        if self.pass_ is not None:
            tags["PASS"] = self.pass_
        elif self.kind is NodeKind.UPD:
            tags["PASS"] = "UPD"
        return tags

    def compute_label(self) -> str:
        mb = "" if self.microbatch is None else f".{self.microbatch}"
        return f"{self.pass_}{self.region}{mb}"

    def __str__(self) -> str:
        if self.kind is NodeKind.COMPUTE:
            return self.compute_label()
        if self.kind is NodeKind.UPD:
            return f"UPD{self.region}"
        if self.kind is NodeKind.SEND:
            return f"SEND #{self.carries} -> {group_str(self.peer)}"
        if self.kind is NodeKind.RECV:
            return f"RECV #{self.carries} <- {group_str(self.peer)}"
        return f"{self.kind.value} {group_str(self.devices)}"


@dataclasses.dataclass(frozen=True)
class Edge:
    src: int
    dst: int
    kind: EdgeKind = EdgeKind.DATA


class TrainingDAG:
    """Nodes by uid and the edges between them. Passes copy it; they never mutate input."""

    def __init__(self, nodes: Iterable[Node] = (), edges: Iterable[Edge] = ()):
        self.nodes: dict[int, Node] = {n.uid: n for n in nodes}
        self.edges: set[Edge] = set(edges)

    def copy(self) -> TrainingDAG:
        return TrainingDAG(self.nodes.values(), self.edges)

    def new_uid(self) -> int:
        return max(self.nodes, default=-1) + 1

    def add(self, node: Node) -> Node:
        assert node.uid not in self.nodes, node
        self.nodes[node.uid] = node
        return node

    def replace(self, node: Node) -> None:
        assert node.uid in self.nodes, node
        self.nodes[node.uid] = node

    def connect(self, src: int, dst: int, kind: EdgeKind = EdgeKind.DATA) -> None:
        assert src in self.nodes and dst in self.nodes, (src, dst)
        self.edges.add(Edge(src, dst, kind))

    def remove_node(self, uid: int) -> None:
        del self.nodes[uid]
        self.edges = {e for e in self.edges if uid not in (e.src, e.dst)}

    def of_kind(self, *kinds: NodeKind) -> Iterator[Node]:
        return (n for _, n in sorted(self.nodes.items()) if n.kind in kinds)

    def compute_nodes(self) -> Iterator[Node]:
        return self.of_kind(NodeKind.COMPUTE)

    def adjacency(
        self, kind: EdgeKind | None = None
    ) -> tuple[dict[int, list[int]], dict[int, list[int]]]:
        """(preds, succs) of every node in one pass over the edges, for passes that ask
        for many nodes (`preds`/`succs` scan every edge per call)."""
        preds: dict[int, list[int]] = {u: [] for u in self.nodes}
        succs: dict[int, list[int]] = {u: [] for u in self.nodes}
        for e in sorted(self.edges, key=lambda e: (e.src, e.dst)):
            if kind in (None, e.kind):
                preds[e.dst].append(e.src)
                succs[e.src].append(e.dst)
        return preds, succs

    def preds(self, uid: int, kind: EdgeKind | None = None) -> list[int]:
        return sorted(e.src for e in self.edges if e.dst == uid and kind in (None, e.kind))

    def succs(self, uid: int, kind: EdgeKind | None = None) -> list[int]:
        return sorted(e.dst for e in self.edges if e.src == uid and kind in (None, e.kind))

    def find_cycle(self) -> list[int] | None:
        """A list of uids forming a cycle, or None if the DAG is acyclic."""
        succ: dict[int, list[int]] = {u: [] for u in self.nodes}
        for e in self.edges:
            succ[e.src].append(e.dst)
        state: dict[int, int] = {}
        for root in sorted(self.nodes):
            if root in state:
                continue
            stack = [(root, iter(sorted(succ[root])))]
            path = [root]
            state[root] = 1
            while stack:
                uid, it = stack[-1]
                nxt = next(it, None)
                if nxt is None:
                    stack.pop()
                    path.pop()
                    state[uid] = 2
                elif state.get(nxt) == 1:
                    return path[path.index(nxt) :] + [nxt]
                elif nxt not in state:
                    state[nxt] = 1
                    path.append(nxt)
                    stack.append((nxt, iter(sorted(succ[nxt]))))
        return None

    def check_acyclic(self, culprit: str) -> None:
        cycle = self.find_cycle()
        if cycle:
            names = " -> ".join(str(self.nodes[u]) for u in cycle)
            raise DirectiveError(f"{culprit} makes a cycle in the training DAG: {names}")

    def to_text(self) -> str:
        lines = []
        for uid, n in sorted(self.nodes.items()):
            outs = ", ".join(
                f"{self.nodes[e.dst]}{'~' if e.kind is EdgeKind.TEMPORAL else ''}"
                for e in sorted(self.edges, key=lambda e: e.dst)
                if e.src == uid
            )
            lines.append(f"#{uid:<4} {str(n):<24} on {group_str(n.devices):<10} -> {outs}")
        return "\n".join(lines)

    def to_json(self) -> str:
        nodes = []
        for n in self.nodes.values():
            d = dataclasses.asdict(n)
            d["kind"] = n.kind.value
            nodes.append(d)
        edges = [dataclasses.asdict(e) | {"kind": e.kind.value} for e in self.edges]
        edges.sort(key=lambda e: (e["src"], e["dst"], e["kind"]))
        return json.dumps({"nodes": nodes, "edges": edges}, indent=1)
