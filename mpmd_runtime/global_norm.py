"""The global-norm carrier: how a group's update sees the norm of every gradient.

`optax.clip_by_global_norm` needs the norm of all gradients, but each group updates only
its own (shards of) parameters. Its update gets one extra scalar leaf, CARRIER, at the
top of the parameter tree (every other leaf keeps its path, so optimizers that select
parameters by path see the model's own tree); the carrier's gradient is the norm of
everything the update does not hold, so `optax.global_norm` of what it sees is the true
global norm. The runtime sums squared norms across groups once per step (ALL_REDUCE
gnorm); piper_jax/optimizer_check.py proves on small proxies that this gives the
single-device update for the user's optimizer.
"""

from __future__ import annotations

from collections.abc import Sequence

import jax
import jax.numpy as jnp

CARRIER = "__piper_global_norm__"


def carrier_gradient(total_sq: jax.Array, seen: Sequence[jax.Array]) -> jax.Array:
    """The carrier's gradient: the norm of what the global total has beyond `seen`."""
    return jnp.sqrt(jnp.maximum(total_sq - square_norm(seen), 0.0))


def square_norm(grads: Sequence[jax.Array]) -> jax.Array:
    return sum((jnp.sum(jnp.square(g.astype(jnp.float32))) for g in grads), jnp.float32(0.0))
