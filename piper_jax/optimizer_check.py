"""Decide how the optimizer can run split over parameter groups and ZeRO shards.

The runtime updates each parameter group (see Note [parameter groups and tied weights])
on its own devices, and under ZeRO each replica updates flat shards of its parameters.
That equals one update of all parameters for optimizers that treat every element alike
(sgd, adam, adamw, schedules ...). Optimizers that also read the *global gradient norm*
(`optax.clip_by_global_norm`) get it through the norm carrier of
mpmd_runtime/global_norm.py. Anything else would train differently in silence, so it is
refused. Both are checked on small proxies.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import numpy as np
import optax

from piper_jax.ir.errors import PiperError
from piper_jax.mpmd_runtime.global_norm import CARRIER


def _proxy_shape(shape: tuple[int, ...]) -> tuple[int, ...]:
    return tuple(min(d, 3) for d in shape)


def _run(
    optimizer: optax.GradientTransformation,
    params: dict,
    grads: list[dict],
    carriers: list[float] | None = None,
) -> dict:
    """Steps of `optimizer`; with `carriers`, each step's extra CARRIER gradient."""
    p = dict(params)
    if carriers is not None:
        p[CARRIER] = np.float32(0.0)
    state = optimizer.init(p)
    for step, g in enumerate(grads):
        g = dict(g)
        if carriers is not None:
            g[CARRIER] = np.float32(carriers[step])
        updates, state = optimizer.update(g, state, p)
        p = optax.apply_updates(p, updates)
    p.pop(CARRIER, None)
    return p


def _pieces(group: Sequence[int], sharded: bool) -> list[list[str]]:
    """The leaves one update sees: the group's, or each of two flat shards of them."""
    names = [str(i) for i in group]
    if not sharded:
        return [names]
    return [[f"{n}#{half}" for n in names] for half in range(2)]


def _split(tree: dict) -> dict:
    out = {}
    for name, value in tree.items():
        for half, part in enumerate(np.array_split(np.ravel(value), 2)):
            out[f"{name}#{half}"] = part
    return out


def _agrees(
    optimizer: optax.GradientTransformation,
    proxy: dict,
    grads: list[dict],
    groups: Sequence[Sequence[int]],
    sharded: bool,
    carrier: bool,
) -> bool:
    joint = _run(optimizer, proxy, grads)
    leaves = _split(proxy) if sharded else proxy
    leaf_grads = [_split(g) if sharded else g for g in grads]
    total = [sum(float(np.sum(np.square(v))) for v in g.values()) for g in grads]
    want = _split(joint) if sharded else joint
    for group in groups:
        for piece in _pieces(group, sharded):
            piece_grads = [{k: lg[k] for k in piece} for lg in leaf_grads]
            carriers = None
            if carrier:
                carriers = [
                    np.sqrt(max(t - sum(float(np.sum(np.square(v))) for v in g.values()), 0.0))
                    for t, g in zip(total, piece_grads)
                ]
            got = _run(optimizer, {k: leaves[k] for k in piece}, piece_grads, carriers)
            for k, v in got.items():
                # compare the updates, relative to their own size: parameters of size 10
                # would hide an update that is wrong by 15% at a small learning rate
                got_update = np.asarray(v, np.float64) - leaves[k]
                want_update = np.asarray(want[k], np.float64) - leaves[k]
                scale = float(np.max(np.abs(want_update), initial=0.0))
                if not np.allclose(got_update, want_update, rtol=1e-3, atol=1e-3 * scale + 1e-30):
                    return False
    return True


def plan_optimizer(
    optimizer: optax.GradientTransformation,
    params: Sequence[Any],
    groups: Sequence[Sequence[int]],
    sharded: bool,
) -> bool:
    """True when the updates need the global-norm carrier, False when they are independent.

    Args:
      params: example parameter leaves (only shapes are used).
      groups: the parameter indices of each UPD node.
      sharded: some group updates ZeRO shards rather than whole parameters.

    Raises:
      PiperError: the optimizer couples parameters in some other way.
    """
    if len(groups) <= 1 and not sharded:
        return False
    rng = np.random.default_rng(0)
    proxy = {
        str(i): rng.normal(size=_proxy_shape(np.shape(p))).astype(np.float32) * 10
        for i, p in enumerate(params)
    }
    grads = [
        {k: rng.normal(size=v.shape).astype(np.float32) * 10 for k, v in proxy.items()}
        for _ in range(2)
    ]
    # gradient scales far below and far above any clipping threshold a user would set, so
    # a norm-dependent transform shows its coupling at one of them
    scaled = [
        [{k: v * np.float32(f) for k, v in g.items()} for g in grads] for f in (1e-6, 1.0, 1e6)
    ]
    if all(_agrees(optimizer, proxy, g, groups, sharded, carrier=False) for g in scaled):
        return False
    if all(_agrees(optimizer, proxy, g, groups, sharded, carrier=True) for g in scaled):
        return True
    raise PiperError(
        "the optimizer couples parameters in a way piper-jax cannot split over parameter "
        "groups or ZeRO shards (it is neither per-element nor per-element plus the global "
        "gradient norm, e.g. a per-tensor transform such as adafactor under ZeRO). Use a "
        "per-element optax chain (adamw, sgd, clip_by_global_norm, schedules) or keep the "
        "regions on one device group without ZeRO."
    )
