"""Decide how the optimizer can run split over parameter groups and ZeRO shards.

The runtime updates each parameter group (see Note [parameter groups and tied weights])
on its own devices, and under ZeRO each replica updates flat shards of its parameters;
each update sees the model's own parameter tree cut to its leaves (piper_jax/param_tree.py).
That equals one update of all parameters for optimizers that treat every element alike
(sgd, adam, adamw, schedules, masks and labels by path ...). Optimizers that also read the
*global gradient norm* (`optax.clip_by_global_norm`) get it through the norm carrier of
mpmd_runtime/global_norm.py. Anything else would train differently in silence, so it is
refused. Both are checked on small proxies with the real tree structure.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import jax
import numpy as np
import optax

from piper_jax.ir.errors import PiperError
from piper_jax.mpmd_runtime.global_norm import CARRIER
from piper_jax.param_tree import ParamTree


def _proxy_shape(shape: tuple[int, ...]) -> tuple[int, ...]:
    return tuple(min(d, 3) for d in shape)


def _run(
    optimizer: optax.GradientTransformation,
    tree: ParamTree,
    params: dict[str, np.ndarray],
    grads: list[dict[str, np.ndarray]],
    carriers: list[float] | None = None,
) -> dict[str, np.ndarray]:
    """Steps of `optimizer` on the tree cut to `params`' names; with `carriers`, each
    step's extra CARRIER gradient."""
    names = list(params)
    treedef, order = tree(names, carriers is not None)

    def as_tree(values: dict[str, Any], carrier: float) -> Any:
        values = {**values, CARRIER: np.float32(carrier)}
        return jax.tree_util.tree_unflatten(treedef, [values[n] for n in order])

    p = as_tree(params, 0.0)
    state = optimizer.init(p)
    for step, g in enumerate(grads):
        updates, state = optimizer.update(as_tree(g, carriers[step] if carriers else 0.0), state, p)
        p = optax.apply_updates(p, updates)
    out = dict(zip(order, jax.tree_util.tree_leaves(p)))
    out.pop(CARRIER, None)
    return {n: np.asarray(v) for n, v in out.items()}


def _halves(values: dict[str, np.ndarray], half: int) -> dict[str, np.ndarray]:
    """One of two flat shards of every leaf (ZeRO's layout with two replicas)."""
    return {n: np.array_split(np.ravel(v), 2)[half] for n, v in values.items()}


def _agrees(
    optimizer: optax.GradientTransformation,
    tree: ParamTree,
    proxy: dict[str, np.ndarray],
    grads: list[dict[str, np.ndarray]],
    groups: Sequence[Sequence[str]],
    sharded: bool,
    carrier: bool,
) -> bool:
    joint = _run(optimizer, tree, proxy, grads)
    total = [sum(float(np.sum(np.square(v))) for v in g.values()) for g in grads]
    for group in groups:
        for half in (0, 1) if sharded else (None,):

            def cut(
                values: dict[str, np.ndarray], half: int | None = half, group: Sequence = group
            ) -> dict:
                picked = {n: values[n] for n in group}
                return picked if half is None else _halves(picked, half)

            piece_grads = [cut(g) for g in grads]
            carriers = None
            if carrier:
                carriers = [
                    np.sqrt(max(t - sum(float(np.sum(np.square(v))) for v in g.values()), 0.0))
                    for t, g in zip(total, piece_grads)
                ]
            got = _run(optimizer, tree, cut(proxy), piece_grads, carriers)
            want, start = cut(joint), cut(proxy)
            for n, v in got.items():
                # compare the updates, relative to their own size: parameters of size 10
                # would hide an update that is wrong by 15% at a small learning rate
                got_update = np.asarray(v, np.float64) - start[n]
                want_update = np.asarray(want[n], np.float64) - start[n]
                scale = float(np.max(np.abs(want_update), initial=0.0))
                if got_update.shape != want_update.shape or not np.allclose(
                    got_update, want_update, rtol=1e-3, atol=1e-3 * scale + 1e-30
                ):
                    return False
    return True


def plan_optimizer(
    optimizer: optax.GradientTransformation,
    tree: ParamTree,
    params: dict[str, Any],
    groups: Sequence[Sequence[str]],
    sharded: bool,
) -> bool:
    """True when the updates need the global-norm carrier, False when they are independent.

    Args:
      tree: the model's parameter tree.
      params: example parameter leaves by name (only shapes are used).
      groups: the parameter names of each UPD node.
      sharded: some group updates ZeRO shards rather than whole parameters.

    Raises:
      PiperError: the optimizer couples parameters in some other way, or fails on them.
    """
    if len(groups) <= 1 and not sharded:
        return False
    rng = np.random.default_rng(0)
    proxy = {
        n: rng.normal(size=_proxy_shape(np.shape(p))).astype(np.float32) * 10
        for n, p in params.items()
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
    try:
        if all(_agrees(optimizer, tree, proxy, g, groups, sharded, False) for g in scaled):
            return False
        if all(_agrees(optimizer, tree, proxy, g, groups, sharded, True) for g in scaled):
            return True
    except Exception as err:
        raise PiperError(
            f"the optimizer failed when run on part of the parameters ({type(err).__name__}: "
            f"{err}); piper-jax updates each device group's parameters (and under ZeRO each "
            "replica's flat shards of them) separately, so the optimizer must accept any "
            "subset of the model's parameter tree. Use a per-element optax chain (adamw, "
            "sgd, clip_by_global_norm, schedules, masks by path) or keep the regions on one "
            "device group without ZeRO."
        ) from err
    where = "ZeRO's flat shards" if sharded else "parameter groups"
    raise PiperError(
        f"the optimizer couples parameters in a way piper-jax cannot split over {where} "
        "(it is neither per-element nor per-element plus the global gradient norm: e.g. a "
        "per-tensor transform such as adafactor or LAMB, or a mask that reads leaf shapes, "
        "under ZeRO). Use a per-element optax chain (adamw, sgd, clip_by_global_norm, "
        "schedules, masks and labels by parameter path) or keep the regions on one device "
        "group without ZeRO."
    )
