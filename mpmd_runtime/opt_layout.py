"""Optimizer state between the layout a UPD node keeps and the full layout a checkpoint holds.

Note [portable optimizer state]
Each UPD node keeps `optimizer.init` of its own parameters only (the model's tree cut to
them): replicated over its group, or (ZeRO) of the flat shards each replica owns, stacked
over the replicas, plus the global-norm carrier's entries when the step clips by the
global norm. A checkpoint holds instead the state `optimizer.init` would give for the
whole model on one device, so it restores under any other directive list (another
pipeline split, ZeRO level or device count). Both trees have the same key paths: a leaf
whose path ends in a parameter's path (adam's mu and nu) maps to that parameter's leaf,
and a leaf under no parameter (a step count) is shared by every node. The carrier's
entries only ever feed the carrier's own discarded update, so they are left out of
checkpoints and keep their value on restore.
"""

from __future__ import annotations

from collections.abc import Callable, Collection, Mapping
from typing import Any

import jax
import numpy as np
from jax.sharding import Mesh
from jax.tree_util import keystr
from piper_jax.ir.errors import PiperError
from piper_jax.mpmd_runtime import programs as pg
from piper_jax.mpmd_runtime import zero
from piper_jax.mpmd_runtime.global_norm import CARRIER
from piper_jax.mpmd_runtime.transport import host_to_group

Shape = tuple[int, ...]
_CARRIER_KEY = f"[{CARRIER!r}]"


def owner(key: str, names: Collection[str]) -> str | None:
    """The parameter (or CARRIER) a state leaf (by key path) belongs to, None for a
    shared leaf: the longest parameter path the leaf's path ends with."""
    if _CARRIER_KEY in key:
        return CARRIER
    found = [n for n in names if key.endswith(n + ".value") or key.endswith(n)]
    return max(found, key=len, default=None)


def to_full(
    state: Any,
    shapes: Mapping[str, Shape],
    zero_level: int,
    read: Callable[[jax.Array], np.ndarray],
) -> dict[str, np.ndarray]:
    """A node's state as {key path: host value in the full layout}, carrier left out.

    `shapes` holds the node's parameters' full shapes; `zero_level` its group's (0: the
    state is replicated; otherwise every leaf is stacked over the replicas); `read` gives
    an array's whole value on this host."""
    out = {}
    for path, leaf in jax.tree_util.tree_flatten_with_path(state)[0]:
        key = keystr(path)
        name = owner(key, shapes)
        if name == CARRIER:
            continue
        value = read(leaf)
        if zero_level and name is not None:
            value = zero.from_shards(value, shapes[name])
        elif zero_level:
            value = value[0]  # a shared leaf: the same on every replica
        out[key] = value
    return out


def from_full(
    full: Mapping[str, np.ndarray],
    state: Any,
    shapes: Mapping[str, Shape],
    zero_level: int,
    mesh: Mesh,
) -> Any:
    """The node's `state` with every leaf but the carrier's replaced from `full`."""
    replicas = pg.replicas(mesh)

    def place(path: tuple, leaf: jax.Array) -> jax.Array:
        key = keystr(path)
        name = owner(key, shapes)
        if name == CARRIER:
            return leaf
        value = np.asarray(full[key], leaf.dtype)
        if zero_level and name is not None:
            value = zero.to_shards(value, replicas)
        elif zero_level:
            value = np.broadcast_to(value, (replicas,) + value.shape)
        if value.shape != leaf.shape:
            raise PiperError(
                f"optimizer state leaf {key} of shape {list(value.shape)} does not "
                f"fit this step's {list(leaf.shape)}: the optimizer keeps state across "
                "parameters, which the single-device layout cannot carry"
            )
        return host_to_group(value, leaf.sharding)  # where the update keeps it

    return jax.tree_util.tree_map_with_path(place, state)
