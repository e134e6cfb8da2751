"""The one check of a global batch's leading axis, shared by TrainStep and the baselines."""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import numpy as np

from piper_jax.ir.errors import BatchError


def check_batch_size(
    leaves: Sequence[Any], names: Sequence[str], parts: int, what: str, parts_name: str
) -> int:
    """The common leading size of every batch leaf; a BatchError unless it exists and
    divides into `parts` (described to the user as `parts_name`)."""
    sizes = {n: (np.shape(x)[0] if np.ndim(x) else None) for n, x in zip(names, leaves)}
    if any(s is None for s in sizes.values()) or len(set(sizes.values())) != 1:
        raise BatchError(
            f"{what}: every batch leaf needs the same leading (batch) axis; got sizes {sizes}"
        )
    size = next(iter(sizes.values()))
    if size % parts:
        raise BatchError(
            f"{what}: batch size {size} (leaf {names[0]}) is not divisible by {parts_name} "
            f"= {parts}; use a batch size that is a multiple of {parts}"
        )
    return size
