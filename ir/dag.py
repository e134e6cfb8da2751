"""The global training DAG: every compute and communication node of one training step."""

from __future__ import annotations

import dataclasses
import enum
import json
from collections.abc import Iterable, Iterator

from piper_jax.ir.errors import DirectiveError
from piper_jax.ir.layout import DeviceMesh, ParamLayout, group_str

PASSES = ("F", "B", "BI", "BW")
WEIGHT_GRAD_PASSES = ("B", "BW")
# what a recomputed region's forward keeps for its backward (directives/types.Recompute)
RECOMPUTE_KEEPS = ("inputs", "dots", "costly")


class NodeKind(enum.StrEnum):
    COMPUTE = "COMPUTE"
    UPD = "UPD"
    SEND = "SEND"
    RECV = "RECV"
    ALL_REDUCE = "ALL_REDUCE"
    REDUCE_SCATTER = "REDUCE_SCATTER"
    ALL_GATHER = "ALL_GATHER"
    ALL_TO_ALL = "ALL_TO_ALL"


COLLECTIVES = (
    NodeKind.ALL_REDUCE,
    NodeKind.REDUCE_SCATTER,
    NodeKind.ALL_GATHER,
    NodeKind.ALL_TO_ALL,
)


class EdgeKind(enum.StrEnum):
    DATA = "data"
    TEMPORAL = "temporal"


@dataclasses.dataclass(frozen=True)
class Node:
    """One node of the DAG.

    Attributes:
      uid: unique id, also the tie-breaking priority (lower runs first when free to).
      kind: what the node does.
      region: the region index of compute and update nodes and of the nodes serving them.
      region_tags: the region's annotation tags, e.g. (("PP", 1),).
      pass_: F, B, BI or BW for compute nodes.
      microbatch: the MB index once `split` ran.
      mesh: the device group it runs on, as a named mesh (Note [device groups as named
        meshes]); a collective's mesh spans every device taking part.
      stream: the logical stream named by the directive that placed it.
      params: parameter leaves an UPD node updates or a collective moves.
      peer: the other side's device group of a SEND (destination) or RECV (source).
      carries: uid of the compute node whose output a SEND/RECV moves, or whose
        parameters (ALL_GATHER) or gradients (REDUCE_SCATTER) a ZeRO collective serves.
      value: what a communication node carries, as plans name it: F1.3, grad[0,2],
        grad[B0.3], param[F0.3], gnorm.
      recompute: what the region's forward keeps for its backward under `recompute`
        ("inputs" or "dots", see directives/types.Recompute); "" keeps every residual.
      param_layout: how the group holds parameters, gradients and optimizer state
        (ZeRO level, gradient buckets).
      overlap: nodes sharing an id were named in one order group: they run as one unit,
        once all of them have their inputs (see directives/order.py).
    """

    uid: int
    kind: NodeKind
    region: int | None = None
    region_tags: tuple[tuple[str, int], ...] = ()
    pass_: str | None = None
    microbatch: int | None = None
    mesh: DeviceMesh | None = None
    stream: str = "default"
    params: tuple[int, ...] = ()
    peer: tuple[int, ...] = ()
    carries: int | None = None
    value: str = ""
    recompute: str = ""
    param_layout: ParamLayout = ParamLayout()
    overlap: int | None = None

    @property
    def devices(self) -> tuple[int, ...]:
        return self.mesh.devices if self.mesh is not None else ()

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
            return f"SEND {self.value} -> {group_str(self.peer)}"
        if self.kind is NodeKind.RECV:
            return f"RECV {self.value} <- {group_str(self.peer)}"
        return f"{self.kind.value} {self.value} {group_str(self.devices)}".replace("  ", " ")


@dataclasses.dataclass(frozen=True)
class Edge:
    src: int
    dst: int
    kind: EdgeKind = EdgeKind.DATA


class TrainingDAG:
    """Nodes by uid and the edges between them, indexed by endpoint.

    Passes copy it and never mutate their input. Edges are reached through `edges`,
    `in_edges` and `out_edges`; every change goes through `connect`, `disconnect` and
    `remove_node`, which keep the endpoint index in step, so that a pass touching every
    node costs time linear in the size of the DAG.
    """

    def __init__(self, nodes: Iterable[Node] = (), edges: Iterable[Edge] = ()):
        # kept in uid order (nodes are only ever added with growing uids), which the
        # passes rely on to visit nodes deterministically without sorting
        self.nodes: dict[int, Node] = {n.uid: n for n in sorted(nodes, key=lambda n: n.uid)}
        self._out: dict[int, dict[Edge, None]] = {u: {} for u in self.nodes}
        self._in: dict[int, dict[Edge, None]] = {u: {} for u in self.nodes}
        self._next_uid = max(self.nodes, default=-1) + 1
        for e in edges:
            self._out[e.src][e] = None
            self._in[e.dst][e] = None

    def copy(self) -> TrainingDAG:
        out = TrainingDAG.__new__(TrainingDAG)
        out.nodes = dict(self.nodes)
        out._out = {u: dict(es) for u, es in self._out.items()}
        out._in = {u: dict(es) for u, es in self._in.items()}
        out._next_uid = self._next_uid
        return out

    @property
    def edges(self) -> list[Edge]:
        """Every edge, sorted by (src, dst, kind)."""
        return sorted(
            (e for es in self._out.values() for e in es),
            key=lambda e: (e.src, e.dst, e.kind.value),
        )

    def out_edges(self, uid: int) -> list[Edge]:
        return list(self._out[uid])

    def in_edges(self, uid: int) -> list[Edge]:
        return list(self._in[uid])

    def new_uid(self) -> int:
        return self._next_uid

    def add(self, node: Node) -> Node:
        assert node.uid >= self._next_uid, (node, self._next_uid)
        self.nodes[node.uid] = node
        self._out[node.uid] = {}
        self._in[node.uid] = {}
        self._next_uid = max(self._next_uid, node.uid + 1)
        return node

    def replace(self, node: Node) -> None:
        assert node.uid in self.nodes, node
        self.nodes[node.uid] = node

    def connect(self, src: int, dst: int, kind: EdgeKind = EdgeKind.DATA) -> None:
        assert src in self.nodes and dst in self.nodes, (src, dst)
        e = Edge(src, dst, kind)
        self._out[src][e] = None
        self._in[dst][e] = None

    def disconnect(self, edge: Edge) -> None:
        self._out[edge.src].pop(edge, None)
        self._in[edge.dst].pop(edge, None)

    def remove_node(self, uid: int) -> None:
        for e in list(self._out[uid]) + list(self._in[uid]):
            self.disconnect(e)
        del self.nodes[uid], self._out[uid], self._in[uid]

    def of_kind(self, *kinds: NodeKind) -> Iterator[Node]:
        return (n for n in self.nodes.values() if n.kind in kinds)

    def compute_nodes(self) -> Iterator[Node]:
        return self.of_kind(NodeKind.COMPUTE)

    def adjacency(
        self, kind: EdgeKind | None = None
    ) -> tuple[dict[int, list[int]], dict[int, list[int]]]:
        """(preds, succs) of every node, each list sorted by uid."""
        preds = {u: self.preds(u, kind) for u in self.nodes}
        succs = {u: self.succs(u, kind) for u in self.nodes}
        return preds, succs

    def preds(self, uid: int, kind: EdgeKind | None = None) -> list[int]:
        return sorted({e.src for e in self._in[uid] if kind in (None, e.kind)})

    def succs(self, uid: int, kind: EdgeKind | None = None) -> list[int]:
        return sorted({e.dst for e in self._out[uid] if kind in (None, e.kind)})

    def find_cycle(self) -> list[int] | None:
        """A list of uids forming a cycle, or None if the DAG is acyclic."""
        state: dict[int, int] = {}
        for root in sorted(self.nodes):
            if root in state:
                continue
            stack = [(root, iter(self.succs(root)))]
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
                    stack.append((nxt, iter(self.succs(nxt))))
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
                for e in sorted(self._out[uid], key=lambda e: (e.dst, e.kind.value))
            )
            lines.append(f"#{uid:<4} {str(n):<24} on {group_str(n.devices):<10} -> {outs}")
        return "\n".join(lines)

    def to_json(self) -> str:
        nodes = []
        for _, n in sorted(self.nodes.items()):
            d = dataclasses.asdict(n)
            d["kind"] = n.kind.value
            nodes.append(d)
        edges = [dataclasses.asdict(e) | {"kind": e.kind.value} for e in self.edges]
        return json.dumps({"nodes": nodes, "edges": edges}, indent=1)
