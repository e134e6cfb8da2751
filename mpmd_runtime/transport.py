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
order; the receiving side passes placeholder zeros.
"""

from __future__ import annotations

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


def _cross_process_transfer(
    src: Mesh, dst: Mesh, src_avals: Sequence[Aval], dst_avals: Sequence[Aval]
) -> Transfer:
    """One jitted program over one device of each sending replica and every receiving
    device moving every leaf, piece by piece (a tensor-parallel group holds each replica
    whole on each of its devices: one sends it, all receive it)."""
    senders = list(src.devices.reshape(replicas(src), -1)[:, 0])
    receivers = list(dst.devices.flat)
    dst_replicas = [r for r in range(replicas(dst)) for _ in range(dst.size // replicas(dst))]
    n_src, n_all = len(senders), len(senders) + len(receivers)
    mesh = Mesh(np.array(senders + receivers), (_UNION,))
    union = NamedSharding(mesh, P(_UNION))
    plans = []
    for (s_shape, _), (d_shape, _) in zip(src_avals, dst_avals):
        if s_shape == d_shape:  # equal widths: each replica whole to its devices
            plans.append((None, in_rounds([(r, 0, k, 0) for k, r in enumerate(dst_replicas)])))
        else:
            plans.append(transfer_rounds(s_shape[1], d_shape[1], dst_replicas))

    def move(x: jax.Array, d_shape: tuple[int, ...], plan: tuple) -> jax.Array:
        piece, rounds = plan
        me = jax.lax.axis_index(_UNION)
        block = x[0]
        out = None if piece is None else jnp.zeros(d_shape[1:], x.dtype)
        for moves in rounds:
            src_off = np.zeros(n_all, np.int32)
            dst_off = np.zeros(n_all, np.int32)
            takes = np.zeros(n_all, bool)
            for s, s_off, d, d_off in moves:
                src_off[s], dst_off[n_src + d], takes[n_src + d] = s_off, d_off, True
            perm = [(s, n_src + d) for s, _, d, _ in moves]
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

    def moves(xs: list[jax.Array]) -> tuple[list[jax.Array], jax.Array]:
        outs = [move(x, d, p) for x, (d, _), p in zip(xs, dst_avals, plans)]
        # a one-element copy of the first output: ready when the transfer is done, and
        # what the executor holds to wait for it (not the payload, which FREE must free)
        first = outs[0].reshape(-1)
        done = jnp.concatenate([first[:1], jnp.zeros((1,), first.dtype)])[:1]
        return outs, done

    program = jax.jit(
        jax.shard_map(
            moves,
            mesh=mesh,
            in_specs=P(_UNION),
            out_specs=P(_UNION),
            check_vma=False,
        )
    )
    sending = [d for d in senders if is_local(d)]
    dst_local = local_devices_of(dst)
    dst_sharding = stacked(dst)
    # the receiving side's input is never read (nor donated): one zero buffer per leaf and
    # device serves every call, instead of a fresh allocation that faults its pages in
    placeholders = {
        (k, d): jnp.zeros((1,) + tuple(shape[1:]), dtype, device=d)
        for k, (shape, dtype) in enumerate(src_avals)
        for d in dst_local
    }

    # an ep group holds each replica split by batch row (Note [experts over ep]): every
    # process holding part of it first makes each replica whole on each of its devices
    whole = jax.jit(lambda xs: xs, out_shardings=stacked(src)) if inner_axis(src) == EP else None

    to_inputs = [shard_assembler((n_all, *shape[1:]), union) for shape, _ in src_avals]
    to_received = [shard_assembler(tuple(shape), dst_sharding) for shape, _ in dst_avals]

    def global_inputs(xs: list[jax.Array] | None) -> list[jax.Array]:
        inputs = []
        for k, assemble in enumerate(to_inputs):
            shards = {d: placeholders[(k, d)] for d in dst_local}
            if xs is not None:  # one lookup of the leaf's shards (the senders' are among them)
                shards.update(shards_by_device(xs[k]))
            inputs.append(assemble(shards))
        return inputs

    # a process that only receives passes the same placeholders every time: built once
    receiving_inputs = global_inputs(None) if dst_local and not sending else None

    def transfer(xs: list[jax.Array] | None) -> tuple[list[jax.Array] | None, list]:
        if whole is not None and xs is not None:
            xs = whole(xs)
        if not sending and not dst_local:
            return None, []  # this process's devices hold copies another device sends
        inputs = global_inputs(xs) if receiving_inputs is None else receiving_inputs
        outs, done = program(inputs)
        if not dst_local:
            return None, [done]
        received = [assemble(shards_by_device(o)) for o, assemble in zip(outs, to_received)]
        return received, [done]

    return transfer


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
