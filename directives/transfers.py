"""insert_transfers: a SEND/RECV pair on every data edge between device groups."""

from __future__ import annotations

from piper_jax.ir.dag import EdgeKind, Node, NodeKind, TrainingDAG


def insert_transfers(dag: TrainingDAG) -> TrainingDAG:
    """One SEND on the producer's group and one RECV per consumer group, per output."""
    out = dag.copy()
    recv_of: dict[tuple[int, tuple[int, ...]], int] = {}
    for e in sorted(dag.edges, key=lambda e: (e.src, e.dst)):
        src, dst = dag.nodes[e.src], dag.nodes[e.dst]
        if (
            e.kind is not EdgeKind.DATA
            or src.kind is not NodeKind.COMPUTE
            or dst.kind is not NodeKind.COMPUTE
            or src.devices == dst.devices
        ):
            continue
        key = (src.uid, dst.devices)
        if key not in recv_of:
            send = out.add(
                Node(
                    out.new_uid(),
                    NodeKind.SEND,
                    src.region,
                    src.region_tags,
                    microbatch=src.microbatch,
                    devices=src.devices,
                    replicated=src.replicated,
                    stream=src.stream,
                    peer=dst.devices,
                    carries=src.uid,
                )
            )
            recv = out.add(
                Node(
                    out.new_uid(),
                    NodeKind.RECV,
                    src.region,
                    src.region_tags,
                    microbatch=src.microbatch,
                    devices=dst.devices,
                    replicated=dst.replicated,
                    stream=dst.stream,
                    peer=src.devices,
                    carries=src.uid,
                )
            )
            out.connect(src.uid, send.uid)
            out.connect(send.uid, recv.uid)
            recv_of[key] = recv.uid
        out.edges.discard(e)
        out.connect(recv_of[key], dst.uid)
    return out
