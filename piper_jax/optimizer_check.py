"""Refuse optimizers whose update of one parameter group depends on another group.

The runtime updates each parameter group (see Note [parameter groups and tied weights])
on its own devices. That equals one update of all parameters only for optimizers that
treat parameters independently (sgd, adam, adamw, schedules ...). A coupled one such as
`clip_by_global_norm` would silently train differently, so it is refused until global
reductions across groups exist.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import numpy as np
import optax

from piper_jax.ir.errors import PiperError


def _proxy_shape(shape: tuple[int, ...]) -> tuple[int, ...]:
    return tuple(min(d, 3) for d in shape)


def check_optimizer_separable(
    optimizer: optax.GradientTransformation,
    params: Sequence[Any],
    groups: Sequence[Sequence[int]],
) -> None:
    """Two steps of `optimizer` on small proxies, jointly and per group, must agree."""
    if len(groups) <= 1:
        return
    rng = np.random.default_rng(0)
    proxy = {
        str(i): rng.normal(size=_proxy_shape(np.shape(p))).astype(np.float32) * 10
        for i, p in enumerate(params)
    }
    grads = [
        {k: rng.normal(size=v.shape).astype(np.float32) * 10 for k, v in proxy.items()}
        for _ in range(2)
    ]

    def run(keys: Sequence[str]) -> dict:
        p = {k: proxy[k] for k in keys}
        state = optimizer.init(p)
        for g in grads:
            updates, state = optimizer.update({k: g[k] for k in keys}, state, p)
            p = optax.apply_updates(p, updates)
        return p

    joint = run(list(proxy))
    for group in groups:
        part = run([str(i) for i in group])
        for k, v in part.items():
            if not np.allclose(np.asarray(v), np.asarray(joint[k]), rtol=1e-5, atol=1e-6):
                raise PiperError(
                    "the optimizer couples parameters across parameter groups (for example "
                    "optax.clip_by_global_norm): updating each group on its own devices "
                    "would differ from one global update. Use a per-parameter optimizer "
                    "(e.g. optax.adamw) or keep all regions on one device group."
                )
