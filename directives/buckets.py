"""Gradient buckets: cutting a set of parameters into collectives of bounded size."""

from __future__ import annotations

import math
from collections.abc import Callable, Sequence

import numpy as np
from piper_jax.ir.lift import LiftedLoss


def param_nbytes(lifted: LiftedLoss) -> dict[int, int]:
    """Bytes of every parameter leaf read by some region."""
    nbytes = {}
    for region in lifted.regions:
        for p, (shape, dtype) in zip(region.param_ids, region.in_shapes):
            nbytes[p] = math.prod(shape) * np.dtype(dtype).itemsize
    return nbytes


def buckets_by_size(
    params: Sequence[int],
    order: Callable[[int], object],
    nbytes: dict[int, int],
    limit_mb: float,
) -> list[list[int]]:
    """`params` sorted by `order`, cut into buckets of at most `limit_mb` (one parameter
    at least). Gradient all-reduces are ordered so that the last region's gradients come
    first: a bucket's collective can start as soon as the regions it serves are done."""
    out: list[list[int]] = [[]]
    size = 0
    for p in sorted(params, key=order):
        if out[-1] and size + nbytes.get(p, 0) > limit_mb * 2**20:
            out.append([])
            size = 0
        out[-1].append(p)
        size += nbytes.get(p, 0)
    return out
