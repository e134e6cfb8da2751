"""Moving per-replica buffers between device groups, in one process or across several.

Within one process a transfer is a `device_put` onto the receiving group's sharding.
When the two groups' devices belong to more than one process, it is a jitted `ppermute`
over a 1-D mesh of the sending devices followed by the receiving devices: replica i of
the sender goes to replica i of the receiver. Every process holding one of those devices
calls it, at the SEND's place in the global instruction order, so both sides always
issue their transfers in the same relative order; the receiving side passes zeros.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
from jax.experimental import multihost_utils
from jax.sharding import Mesh, NamedSharding
from jax.sharding import PartitionSpec as P
from piper_jax.ir.errors import PlanError
from piper_jax.mpmd_runtime.programs import group_mesh, stacked

Aval = tuple[tuple[int, ...], Any]


def is_local(device: jax.Device) -> bool:
    return device.process_index == jax.process_index()


def local_devices_of(mesh: Mesh) -> list[jax.Device]:
    return [d for d in mesh.devices.flat if is_local(d)]


def from_local_shards(
    shape: tuple[int, ...], sharding: NamedSharding, shards: dict[jax.Device, jax.Array]
) -> jax.Array:
    """A global array from this process's shards (one per local device of `sharding`)."""
    local = [d for d in sharding.mesh.devices.flat if is_local(d)]
    return jax.make_array_from_single_device_arrays(shape, sharding, [shards[d] for d in local])


def shards_by_device(array: jax.Array) -> dict[jax.Device, jax.Array]:
    return {s.device: s.data for s in array.addressable_shards}


def host_to_group(value: np.ndarray, sharding: NamedSharding) -> jax.Array:
    """Place a host value (the same on every process) onto a possibly multi-process group."""
    value = np.asarray(value)
    return jax.make_array_from_callback(value.shape, sharding, lambda index: value[index])


Transfer = Callable[[list[jax.Array] | None], tuple[list[jax.Array] | None, list[jax.Array]]]


def make_transfer(src: Mesh, dst: Mesh, avals: Sequence[Aval]) -> Transfer:
    """A function taking the sender's stacked buffers (None where this process holds no
    sending device) and returning the receiver's (None where it holds no receiving one),
    plus arrays that are ready once this process's part of the transfer is done."""
    dst_sharding = stacked(dst)
    devices = list(src.devices.flat) + list(dst.devices.flat)
    if all(is_local(d) for d in devices):

        def local_transfer(xs: list[jax.Array] | None) -> tuple[list[jax.Array], list]:
            out = jax.device_put(xs, dst_sharding)
            return out, out

        return local_transfer
    width = src.size
    mesh = group_mesh(devices)
    pair_sharding = stacked(mesh)
    perm = [(i, i + width) for i in range(width)]
    program = jax.jit(
        jax.shard_map(
            lambda xs: [jax.lax.ppermute(x, "r", perm) for x in xs],
            mesh=mesh,
            in_specs=P("r"),
            out_specs=P("r"),
        )
    )
    src_local = set(local_devices_of(src))
    dst_local = local_devices_of(dst)
    # the receiving side's input is never read (nor donated): one zero buffer per leaf and
    # device serves every call, instead of a fresh allocation that faults its pages in
    placeholders = {
        (k, d): jnp.zeros((1,) + tuple(shape[1:]), dtype, device=d)
        for k, (shape, dtype) in enumerate(avals)
        for d in dst_local
    }

    def transfer(xs: list[jax.Array] | None) -> tuple[list[jax.Array] | None, list]:
        inputs = []
        for k, (shape, _) in enumerate(avals):
            shards = shards_by_device(xs[k]) if src_local else {}
            for d in dst_local:
                shards[d] = placeholders[(k, d)]
            full = (2 * width,) + tuple(shape[1:])
            inputs.append(from_local_shards(full, pair_sharding, shards))
        outs = program(inputs)
        if not dst_local:
            return None, outs
        received = [
            from_local_shards(tuple(shape), dst_sharding, shards_by_device(o))
            for o, (shape, _) in zip(outs, avals)
        ]
        return received, outs

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
