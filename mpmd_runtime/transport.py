"""Moving per-replica buffers between device groups, in one process or across several.

A buffer leaves its group stacked over the sender's replicas, (dp_s, rows_s, ...), and
must arrive stacked over the receiver's, (dp_r, rows_r, ...). Groups of equal width pair
replica i with replica i. Groups of different widths move each receiving replica exactly
the batch rows it needs: leaves split along the batch are cut at the gcd of the two
per-replica row counts and every piece goes straight from the replica holding it to the
one needing it (Note [device groups as named meshes]).

Within one process a transfer is `device_put` onto the receiving group's sharding (a
batch-major view of the leaf when the widths differ). When the two groups' devices
belong to more than one process, it is one jitted program over a 1-D mesh of the sending
devices followed by the receiving devices, doing one `ppermute` per round of pieces.
Every process holding one of those devices calls it, at the SEND's place in the global
instruction order, so both sides always issue their transfers in the same relative
order; the receiving side passes placeholder zeros. Several such transfers can run as
one program, an exchange (Note [transfers that meet together]).
"""

from __future__ import annotations

import dataclasses
import functools
import math
from collections.abc import Callable, Sequence
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
from jax.experimental import multihost_utils
from jax.sharding import Mesh, NamedSharding
from jax.sharding import PartitionSpec as P
from piper_jax.ir import jax_compat
from piper_jax.ir.errors import PlanError
from piper_jax.ir.layout import EP
from piper_jax.mpmd_runtime.programs import inner_axis, replicas, stacked

Aval = tuple[tuple[int, ...], Any]
_UNION = "u"


def is_local(device: jax.Device) -> bool:
    return device.process_index == jax.process_index()


def local_devices_of(mesh: Mesh) -> list[jax.Device]:
    return [d for d in mesh.devices.flat if is_local(d)]


def shard_assembler(
    shape: tuple[int, ...], sharding: NamedSharding
) -> Callable[[dict[jax.Device, jax.Array]], jax.Array]:
    """A function making the global array of `shape` over `sharding` from this process's
    shards (one per local device of `sharding`), checked once (Note [cheap small
    transfers])."""
    local = [d for d in sharding.mesh.devices.flat if is_local(d)]
    assemble = jax_compat.array_assembler(shape, sharding)

    def from_shards(shards: dict[jax.Device, jax.Array]) -> jax.Array:
        return assemble([shards[d] for d in local])

    return from_shards


def shards_by_device(array: jax.Array) -> dict[jax.Device, jax.Array]:
    return {s.device: s.data for s in array.addressable_shards}


def host_to_group(value: np.ndarray, sharding: NamedSharding) -> jax.Array:
    """Place a host value (the same on every process) onto a possibly multi-process group."""
    value = np.asarray(value)
    return jax.make_array_from_callback(value.shape, sharding, lambda index: value[index])


# Note [staging a batch]
# Every step puts each batch leaf's microbatches onto each group that reads them, one
# array per microbatch. Put one by one, that was microbatches x leaves host-to-device
# copies, 15-25 us of host time each on CPU (m=16, 2 leaves: 0.47-0.94 ms a step on
# 1-4 devices). On a group this process holds alone, each leaf now goes over in one copy
# and one program cuts all of them into their microbatches (0.33-0.50 ms). A group
# spanning processes keeps the copy per microbatch: a program over it would be a meeting
# of the processes.


def microbatch_stager(
    sharding: NamedSharding, m: int
) -> Callable[[Sequence[np.ndarray]], list[list[jax.Array]]]:
    """A function placing leaves of `m` microbatches each (their leading axis, the same on
    every process) onto a group, per microbatch (Note [staging a batch])."""
    if m == 1 or not all(is_local(d) for d in sharding.mesh.devices.flat):
        return lambda leaves: [[host_to_group(x[k], sharding) for x in leaves] for k in range(m)]
    whole = NamedSharding(sharding.mesh, P(None, *sharding.spec))
    cut = jax.jit(lambda xs: [[x[k] for x in xs] for k in range(m)], out_shardings=sharding)
    return lambda leaves: cut([host_to_group(x, whole) for x in leaves]) if leaves else [[]] * m


Transfer = Callable[[list[jax.Array] | None], tuple[list[jax.Array] | None, list[jax.Array]]]

# Note [cheap small transfers]
# A cross-process transfer is one small program, and around it each process re-wraps
# device arrays: the sender makes the program's global input from its shards and the
# receivers' placeholders, the receiver makes its group's array from the program's output.
# With `jax.make_array_from_single_device_arrays` that wrapping cost more than the
# program: on two one-device processes (4 KiB, back-to-back calls) the transfer took
# 307-339 us where its program alone, on inputs built once, took 157-176 us and a raw
# ppermute 143-148 us. Its checks cost 12 us per array on an idle core (41 us with the
# peer process busy beside it), and a program called on a freshly checked array ran some
# 20 us slower than on an array built without them. The arrays of one transfer have the
# same shapes and devices at every step, so `shard_assembler` checks them on the first
# call only (`jax_compat.array_assembler`).


def make_transfer(
    src: Mesh, dst: Mesh, src_avals: Sequence[Aval], dst_avals: Sequence[Aval]
) -> Transfer:
    """A function taking the sender's stacked buffers (None where this process holds no
    sending device) and returning the receiver's (None where it holds no receiving one),
    plus arrays that are ready once this process's part of the transfer is done.

    `src_avals` and `dst_avals` are the leaves' global shapes on each side; a leaf whose
    shapes differ is split along its batch axis (axis 1, after the replica axis)."""
    devices = list(src.devices.flat) + list(dst.devices.flat)
    if all(is_local(d) for d in devices):
        return _local_transfer(src, dst, src_avals, dst_avals)
    return _cross_process_transfer(src, dst, src_avals, dst_avals)


def _local_transfer(
    src: Mesh, dst: Mesh, src_avals: Sequence[Aval], dst_avals: Sequence[Aval]
) -> Transfer:
    dst_sharding = stacked(dst)
    if list(src_avals) == list(dst_avals):

        def same_width(xs: list[jax.Array] | None) -> tuple[list[jax.Array], list]:
            out = jax.device_put(xs, dst_sharding)
            return out, out

        return same_width
    rows = [
        (shape_s[0] * shape_s[1],) + tuple(shape_s[2:]) for shape_s, _ in src_avals
    ]  # the batch-major view of each leaf
    flatten = jax.jit(
        lambda xs: [x.reshape(r) for x, r in zip(xs, rows)], out_shardings=stacked(src)
    )
    unflatten = jax.jit(
        lambda xs: [x.reshape(s) for x, (s, _) in zip(xs, dst_avals)], out_shardings=dst_sharding
    )

    def reslice(xs: list[jax.Array] | None) -> tuple[list[jax.Array], list]:
        out = unflatten(jax.device_put(flatten(xs), dst_sharding))
        return out, out

    return reslice


Move = tuple[int, int, int, int]  # (src replica, src offset, dst device, dst offset)


def transfer_rounds(
    rows_src: int, rows_dst: int, dst_replicas: Sequence[int]
) -> tuple[int, list[list[Move]]]:
    """How batch rows move from replicas of `rows_src` rows each (replica i holds rows
    i * rows_src ...) to devices each needing the `rows_dst` rows of their replica
    (`dst_replicas[k]` is device k's): the piece size (gcd of the row counts) and rounds
    of moves in which no replica sends and no device receives twice."""
    piece = math.gcd(rows_src, rows_dst)
    moves = [
        (*divmod(replica * rows_dst + d_off, rows_src), k, d_off)
        for k, replica in enumerate(dst_replicas)
        for d_off in range(0, rows_dst, piece)
    ]
    return piece, in_rounds(moves)


def in_rounds(moves: Sequence[Move]) -> list[list[Move]]:
    """`moves` grouped into rounds (one ppermute each) in which no replica sends and no
    device receives twice, greedily, in order."""
    rounds: list[list[Move]] = []
    busy: list[tuple[set[int], set[int]]] = []
    for move in moves:
        s, _, k, _ = move
        free = [i for i, (out, into) in enumerate(busy) if s not in out and k not in into]
        i = free[0] if free else len(rounds)
        if not free:
            rounds.append([])
            busy.append((set(), set()))
        rounds[i].append(move)
        busy[i][0].add(s)
        busy[i][1].add(k)
    return rounds


@dataclasses.dataclass(frozen=True)
class TransferSpec:
    """One transfer of an exchange: the sending and receiving groups' meshes and the
    leaves' global shapes on each side (as `make_transfer` takes them)."""

    src: Mesh
    dst: Mesh
    src_avals: Sequence[Aval]
    dst_avals: Sequence[Aval]


Exchange = Callable[
    [Sequence[list[jax.Array] | None]], tuple[list[list[jax.Array] | None], list[jax.Array]]
]

# Note [transfers that meet together]
# A cross-process transfer is a program every process holding its devices calls, and
# returns on the receiving side only once the sender joined, so each one costs a meeting
# of the processes. In a pipeline's steady state two transfers between the same
# processes come back to back: stage s+1 sends a gradient back while stage s sends the
# next activation forward (Megatron's send_backward_recv_forward). `make_exchange` runs
# such transfers as one program: one meeting. Leaves that move whole in one round and
# have the same block share one `ppermute` when their senders and receivers differ
# (`_lanes`): each process puts its own block in, so both directions cross the link at
# once. Two ppermutes in one program ran one after the other on XLA:CPU, no faster than
# two programs (1.06-1.31x their time at 1-16 MiB a direction); one shared ppermute took
# 0.69-0.85x their time at 4 KiB to 64 MiB (benchmarks/p2p.py, two runs). The executor
# picks the transfers (`exchanges.exchange_sets`).


def _cross_process_transfer(
    src: Mesh, dst: Mesh, src_avals: Sequence[Aval], dst_avals: Sequence[Aval]
) -> Transfer:
    exchange = make_exchange([TransferSpec(src, dst, src_avals, dst_avals)])

    def transfer(xs: list[jax.Array] | None) -> tuple[list[jax.Array] | None, list]:
        (received,), witness = exchange([xs])
        return received, witness

    return transfer


def _senders(src: Mesh) -> list[jax.Device]:
    """One device of each sending replica (a tensor-parallel group holds each replica
    whole on each of its devices: one sends it, all receive it)."""
    return list(src.devices.reshape(replicas(src), -1)[:, 0])


def make_exchange(specs: Sequence[TransferSpec]) -> Exchange:
    """One jitted program over the sending and receiving devices of all `specs` (each
    between groups of devices of several processes) moving every leaf of each, piece by
    piece (Note [transfers that meet together]). It takes, per transfer, the sender's
    stacked buffers (None where this process holds no sending device) and returns, per
    transfer, the receiver's (None where it holds no receiving one), plus arrays that are
    ready once this process's part is done."""
    union: list[jax.Device] = []
    for spec in specs:
        for d in _senders(spec.src) + list(spec.dst.devices.flat):
            if d not in union:
                union.append(d)
    # an ep group holds each replica split by batch row (Note [experts over ep]): every
    # process holding part of it first makes each replica whole on each of its devices
    wholes = [
        jax.jit(lambda xs: xs, out_shardings=stacked(s.src)) if inner_axis(s.src) == EP else None
        for s in specs
    ]
    if not any(is_local(d) for d in union):  # another device sends this process's copies
        return _making_whole_only(len(specs), wholes)
    mesh = Mesh(np.array(union), (_UNION,))
    lanes = _lanes(specs, union)

    def moves(inputs: list[jax.Array]) -> tuple[list[jax.Array], jax.Array]:
        me = jax.lax.axis_index(_UNION)
        outs = [lane.move(x, me) for lane, x in zip(lanes, inputs)]
        # a one-element copy of the first output: ready when the exchange is done, and
        # what the executor holds to wait for it (not the payload, which FREE must free)
        first = outs[0].reshape(-1)
        done = jnp.concatenate([first[:1], jnp.zeros((1,), first.dtype)])[:1]
        return outs, done

    program = jax.jit(
        jax.shard_map(moves, mesh=mesh, in_specs=P(_UNION), out_specs=P(_UNION), check_vma=False)
    )
    sharding = NamedSharding(mesh, P(_UNION))
    sides = [_LaneSide(lane, specs, union, sharding) for lane in lanes]
    dst_local = [bool(local_devices_of(s.dst)) for s in specs]

    def exchange(xs: Sequence[list[jax.Array] | None]) -> tuple[list, list]:
        xs = [x if w is None or x is None else w(x) for x, w in zip(xs, wholes)]
        outs, done = program([side.inputs(xs) for side in sides])
        received: list[list | None] = [
            [None] * len(s.dst_avals) if r else None for s, r in zip(specs, dst_local)
        ]
        for side, out in zip(sides, outs):
            side.deliver(out, received)
        return received, [done]

    return exchange


def _making_whole_only(n_specs: int, wholes: Sequence[Callable | None]) -> Exchange:
    """The exchange of a process that holds no sending or receiving device of it but part
    of a sending ep group: its part in making that group's replicas whole, a collective the
    sending devices' processes wait in (left out, they waited for ever). Its witness is a
    one-element marker per such group, read from this process's own part."""

    def exchange(xs: Sequence[list[jax.Array] | None]) -> tuple[list, list]:
        done = []
        for x, whole in zip(xs, wholes):
            if whole is not None and x is not None:
                mine = jax.tree.leaves(whole(x))[0].addressable_shards[0].data
                done.append(mine.reshape(-1)[:1])
        return [None] * n_specs, done

    return exchange


LeafMove = Callable[[jax.Array, jax.Array], jax.Array]


@dataclasses.dataclass(frozen=True)
class _Lane:
    """Leaves of the exchange's transfers that move as one input of its program, each
    (transfer, leaf) member sending from its own devices: `block` is the per-device input
    block, `senders`/`receivers` the union positions of each member."""

    members: list[tuple[int, int]]
    block: Aval
    out_block: Aval
    senders: list[list[int]]
    receivers: list[list[int]]
    move: LeafMove


def _lanes(specs: Sequence[TransferSpec], union: list[jax.Device]) -> list[_Lane]:
    """The program's inputs: leaves that move whole in one round share one `ppermute`
    with leaves of the other transfers of the same block whose senders and receivers they
    do not share (so a pipeline's activation going forward and gradient going back cross
    the link together); every other leaf moves alone, piece by piece."""
    n_all = len(union)
    lanes: list[_Lane] = []
    shared: list[tuple[Aval, list]] = []  # (block, [(member, senders, receivers, perm)])
    for t, spec in enumerate(specs):
        senders = [union.index(d) for d in _senders(spec.src)]
        receivers = [union.index(d) for d in spec.dst.devices.flat]
        per_dst = spec.dst.size // replicas(spec.dst)
        dst_replicas = [r for r in range(replicas(spec.dst)) for _ in range(per_dst)]
        for k, ((s_shape, dtype), (d_shape, _)) in enumerate(zip(spec.src_avals, spec.dst_avals)):
            block = ((1, *s_shape[1:]), np.dtype(dtype))
            if s_shape == d_shape:  # equal widths: each replica whole to its devices
                plan = (None, in_rounds([(r, 0, j, 0) for j, r in enumerate(dst_replicas)]))
            else:
                plan = transfer_rounds(s_shape[1], d_shape[1], dst_replicas)
            piece, rounds = plan
            if piece is None and len(rounds) == 1:
                perm = [(senders[s], receivers[d]) for s, _, d, _ in rounds[0]]
                srcs, dsts = {a for a, _ in perm}, {b for _, b in perm}
                for lane_block, members in shared:
                    if lane_block == block and all(
                        not srcs & {a for a, _ in p} and not dsts & {b for _, b in p}
                        for _, _, _, p in members
                    ):
                        members.append(((t, k), senders, receivers, perm))
                        break
                else:
                    shared.append((block, [((t, k), senders, receivers, perm)]))
                continue
            out_block = ((1, *d_shape[1:]), np.dtype(dtype))
            move = _pieces_move(plan, tuple(d_shape), senders, receivers, n_all)
            lanes.append(_Lane([(t, k)], block, out_block, [senders], [receivers], move))
    for block, members in shared:
        perm = [pair for *_, p in members for pair in p]
        move = functools.partial(_whole_move, perm=perm)
        lanes.append(
            _Lane(
                [m for m, *_ in members],
                block,
                block,
                [s for _, s, _, _ in members],
                [r for _, _, r, _ in members],
                move,
            )
        )
    return lanes


def _whole_move(x: jax.Array, me: jax.Array, perm: list[tuple[int, int]]) -> jax.Array:
    return jax.lax.ppermute(x, _UNION, perm)


def _pieces_move(
    plan: tuple, d_shape: tuple[int, ...], senders: list[int], receivers: list[int], n_all: int
) -> LeafMove:
    piece, rounds = plan

    def move(x: jax.Array, me: jax.Array) -> jax.Array:
        block = x[0]
        out = None if piece is None else jnp.zeros(d_shape[1:], x.dtype)
        for round_moves in rounds:
            src_off = np.zeros(n_all, np.int32)
            dst_off = np.zeros(n_all, np.int32)
            takes = np.zeros(n_all, bool)
            for s, s_off, d, d_off in round_moves:
                src_off[senders[s]], dst_off[receivers[d]] = s_off, d_off
                takes[receivers[d]] = True
            perm = [(senders[s], receivers[d]) for s, _, d, _ in round_moves]
            if piece is None:
                got = jax.lax.ppermute(block, _UNION, perm)
                # ppermute gives zeros to the devices a round sends nothing to: the first
                # round's result is the output as it stands (no pass over the payload)
                out = got if out is None else jnp.where(jnp.asarray(takes)[me], got, out)
                continue
            part = jax.lax.dynamic_slice_in_dim(block, jnp.asarray(src_off)[me], piece, axis=0)
            got = jax.lax.ppermute(part, _UNION, perm)
            placed = jax.lax.dynamic_update_slice_in_dim(out, got, jnp.asarray(dst_off)[me], 0)
            out = jnp.where(jnp.asarray(takes)[me], placed, out)
        return out[None]

    return move


class _LaneSide:
    """This process's side of one lane: the program's global input from the shards its
    members send and placeholders, and each member's received array from the output."""

    def __init__(
        self,
        lane: _Lane,
        specs: Sequence[TransferSpec],
        union: list[jax.Device],
        sharding: NamedSharding,
    ):
        local = {i for i, d in enumerate(union) if is_local(d)}
        # per member sending from this process: (transfer, leaf, its sending devices here)
        self.sends = [
            (t, k, [union[i] for i in senders if i in local])
            for (t, k), senders in zip(lane.members, lane.senders)
            if local & set(senders)
        ]
        sending = {d for _, _, ds in self.sends for d in ds}
        shape, dtype = lane.block
        # what a local device does not send is never read (nor donated): one zero buffer
        # per device serves every call, instead of a fresh allocation that faults its
        # pages in
        self.placeholders = {
            union[i]: jnp.zeros(shape, dtype, device=union[i])
            for i in sorted(local)
            if union[i] not in sending
        }
        self.assemble = shard_assembler((len(union), *shape[1:]), sharding)
        # per member receiving on this process: (transfer, leaf, assembler of its array)
        self.receives = [
            (t, k, shard_assembler(tuple(specs[t].dst_avals[k][0]), stacked(specs[t].dst)))
            for (t, k), receivers in zip(lane.members, lane.receivers)
            if local & set(receivers)
        ]
        # a process that sends nothing here passes the same placeholders every time
        self.constant = None if self.sends else self.assemble(self.placeholders)

    def inputs(self, xs: Sequence[list[jax.Array] | None]) -> jax.Array:
        if self.constant is not None:
            return self.constant
        shards = dict(self.placeholders)
        for t, k, devices in self.sends:
            by_device = shards_by_device(xs[t][k])
            for d in devices:
                shards[d] = by_device[d]
        return self.assemble(shards)

    def deliver(self, out: jax.Array, received: list[list | None]) -> None:
        if not self.receives:
            return
        by_device = shards_by_device(out)
        for t, k, assemble in self.receives:
            received[t][k] = assemble(by_device)


def check_same_plans(fingerprint: str, what: str) -> None:
    """Raise on every process whose plans differ from process 0's (different directives,
    model or batch shapes would otherwise deadlock or silently mismatch transfers)."""
    if jax.process_count() == 1:
        return
    mine = np.frombuffer(bytes.fromhex(fingerprint), np.uint8)
    first = multihost_utils.broadcast_one_to_all(mine)
    if not np.array_equal(np.asarray(first), mine):
        raise PlanError(
            f"process {jax.process_index()} compiled different {what} than process 0 "
            f"(fingerprint {fingerprint[:12]} vs {bytes(np.asarray(first)).hex()[:12]}): "
            "every process must run the same script with the same model, directives and "
            "batch shapes"
        )
