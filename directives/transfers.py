"""insert_transfers: a SEND/RECV pair on every data edge between device groups.

The groups may differ in size: the runtime moves each receiving replica exactly the
batch rows it needs (Note [device groups as named meshes]).
"""

from __future__ import annotations

from piper_jax.ir.dag import EdgeKind, Node, NodeKind, TrainingDAG


def insert_transfers(dag: TrainingDAG) -> TrainingDAG:
    """One SEND on the producer's group and one RECV per consumer group, per output."""
    out = dag.copy()
    recv_of: dict[tuple[int, tuple[int, ...]], int] = {}
    for e in dag.edges:
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
            send = _endpoint(out, NodeKind.SEND, src, src, dst.devices)
            recv = _endpoint(out, NodeKind.RECV, src, dst, src.devices)
            out.connect(src.uid, send.uid)
            out.connect(send.uid, recv.uid)
            recv_of[key] = recv.uid
        out.disconnect(e)
        out.connect(recv_of[key], dst.uid)
    return out


def _endpoint(
    dag: TrainingDAG, kind: NodeKind, carried: Node, side: Node, peer: tuple[int, ...]
) -> Node:
    """A SEND or RECV of `carried`'s outputs, on the device group of `side`."""
    return dag.add(
        Node(
            dag.new_uid(),
            kind,
            carried.region,
            carried.region_tags,
            microbatch=carried.microbatch,
            mesh=side.mesh,
            stream=side.stream,
            peer=peer,
            carries=carried.uid,
            value=carried.compute_label(),
        )
    )
