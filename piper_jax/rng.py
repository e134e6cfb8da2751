"""Random numbers inside the loss (dropout), drawn the same way under every placement.

Note [random keys of a step]
A model that draws random numbers through `nnx.Rngs` (nnx.Dropout does) has its
random state split off, and for microbatch i of training step s (counted from 0 at
compile) on data-parallel replica j of the device group running the region, every
stream's key is set to

    fold_in(fold_in(fold_in(key0, s), i), j)        (raw key data, as jax.random keeps it)

where key0 is the stream's key when the step was compiled, and every stream's count
to 0; the model then draws as it always does (nnx folds the count in and counts up as
it goes). So a run is reproducible for a given strategy (the same split into microbatches
and replicas), and a plain-JAX loop that sets the keys the same way gets the same masks.
The counter (s, i, j) is one small uint32[3] input per microbatch and replica; the
derivation is traced into the regions that draw, so no key is computed on the host.
"""

from __future__ import annotations

from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx

COUNTER_NAME = "[rng](step, microbatch, replica)"
COUNTER_AVAL = ((3,), np.dtype(np.uint32))


def derive_key(key0: jax.Array, step: Any, microbatch: Any, replica: Any) -> jax.Array:
    """The raw key data of one stream for (step, microbatch, replica)."""
    key = jax.random.key_data(key0) if jnp.issubdtype(key0.dtype, jax.dtypes.prng_key) else key0
    for value in (step, microbatch, replica):
        key = jax.random.fold_in(key, value)
    return key


class RandomState:
    """A model's random state, set for one microbatch and replica from its counter."""

    def __init__(self, state: nnx.State):
        self._flat = list(nnx.to_flat_state(state))

    def __bool__(self) -> bool:
        return bool(self._flat)

    def state(self, counter: jax.Array) -> nnx.State:
        """The random state for counter = (step, microbatch, replica), traceable."""
        out = []
        for path, variable in self._flat:
            if isinstance(variable, nnx.RngKey):
                value = derive_key(variable.get_value(), counter[0], counter[1], counter[2])
            else:  # a stream's count
                value = jnp.zeros_like(variable.get_value())
            out.append((path, variable.replace(value=value)))
        return nnx.from_flat_state(out)
