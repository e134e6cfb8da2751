"""The global-norm carrier: how a group's update sees the norm of every gradient.

`optax.clip_by_global_norm` needs the norm of all gradients, but each group updates only
its own (shards of) parameters. Its update gets one extra scalar gradient leaf, CARRIER,
whose square is the squared norm of everything it does not hold, so `optax.global_norm`
of what it sees is the true global norm. The runtime sums squared norms across groups
once per step (an ALL_REDUCE with no parameters); piper_jax/optimizer_check.py proves on
small proxies that this gives the single-device update for the user's optimizer.
"""

from __future__ import annotations

from typing import Any

import jax
import jax.numpy as jnp

CARRIER = "__piper_global_norm__"


def with_carrier(params: dict, grads: dict, total_sq: Any) -> tuple[dict, dict]:
    """`params` and `grads` plus the carrier leaf (parameter 0, gradient as above)."""
    seen = square_norm(list(grads.values()))
    carrier = jnp.sqrt(jnp.maximum(total_sq - seen, 0.0))
    return {**params, CARRIER: jnp.zeros((), jnp.float32)}, {**grads, CARRIER: carrier}


def square_norm(grads: list[jax.Array]) -> jax.Array:
    return sum(jnp.sum(jnp.square(g.astype(jnp.float32))) for g in grads)
