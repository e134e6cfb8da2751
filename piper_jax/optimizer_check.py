"""Decide how the optimizer can run split over parameter groups and ZeRO shards.

The runtime updates each parameter group (see Note [parameter groups and tied weights])
on its own devices, and under ZeRO each replica updates flat shards of its parameters;
each update sees the model's own parameter tree cut to its leaves (piper_jax/param_tree.py).
That equals one update of all parameters for optimizers that treat every element alike
(sgd, adam, adamw, schedules, masks and labels by path ...). Optimizers that also read the
*global gradient norm* (`optax.clip_by_global_norm`) get it through the norm carrier of
mpmd_runtime/global_norm.py. Anything else would train differently in silence, so it is
refused. Both are checked on small proxies with the real tree structure, unless the
optimizer's traces already prove it per-element (Note [per-element updates, proven from
the trace] in piper_jax/optimizer_trace.py).
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import jax
import numpy as np
import optax

from piper_jax.ir.errors import PiperError
from piper_jax.mpmd_runtime.global_norm import CARRIER
from piper_jax.optimizer_trace import apply_steps, updates_are_per_element
from piper_jax.param_tree import ParamTree


def _proxy_shape(shape: tuple[int, ...]) -> tuple[int, ...]:
    return tuple(min(d, 3) for d in shape)


Leaves = dict[str, np.ndarray]  # name -> (instances, *shape): one optimizer run per instance


Job = tuple[Leaves, list[Leaves], np.ndarray | None]  # params, grads per step, carriers


def _runs(optimizer: optax.GradientTransformation, tree: ParamTree, jobs: list[Job]) -> list:
    """Steps of `optimizer` for every job (params, grads per step, and with a carrier
    (steps, instances) each step's extra CARRIER gradient), each on the tree cut to its
    params' names and vmapped over its instances; all jobs are one jitted program, so
    the check compiles once however many groups there are."""

    def one_job(names: list[str], carrier: bool):
        treedef, order = tree(names, carrier)

        def as_tree(values: dict[str, Any], c: Any) -> Any:
            values = {**values, CARRIER: c}
            return jax.tree_util.tree_unflatten(treedef, [values[n] for n in order])

        def one(p: Leaves, gs: list[Leaves], cs: Any) -> Leaves:
            zero = jax.numpy.zeros((), jax.numpy.float32)
            carriers = [zero if cs is None else cs[step] for step in range(len(gs))]
            grads = [as_tree(g, c) for g, c in zip(gs, carriers)]
            tree_p = apply_steps(optimizer, as_tree(p, zero), grads)
            out = dict(zip(order, jax.tree_util.tree_leaves(tree_p)))
            out.pop(CARRIER, None)
            return out

        return jax.vmap(one)

    fns = [one_job(list(p), c is not None) for p, _, c in jobs]
    args = [(p, g, None if c is None else np.asarray(c, np.float32).T) for p, g, c in jobs]
    results = jax.jit(lambda a: [fn(*job) for fn, job in zip(fns, a)])(args)
    return [{n: np.asarray(v) for n, v in r.items()} for r in results]


def _halves(values: Leaves) -> Leaves:
    """Both flat shards of every leaf (ZeRO's layout with two replicas), as two
    instances per instance: (instances, *shape) -> (2 * instances, ceil(size / 2))."""
    out = {}
    for n, v in values.items():
        flat = v.reshape(v.shape[0], -1)
        flat = np.pad(flat, ((0, 0), (0, flat.shape[1] % 2)))
        out[n] = flat.reshape(v.shape[0] * 2, -1)
    return out


def _square_norms(values: Leaves) -> np.ndarray:
    """Per instance, the squared norm of all the leaves."""
    return sum(np.sum(np.square(v).reshape(len(v), -1), 1) for v in values.values())


def _agrees(
    optimizer: optax.GradientTransformation,
    tree: ParamTree,
    proxy: Leaves,
    grads: list[Leaves],
    joint: Leaves | None,
    groups: Sequence[Sequence[str]],
    sharded: bool,
    carrier: bool,
) -> tuple[bool, Leaves]:
    """Whether each group's (and under ZeRO each shard's) own update equals its part of
    the update of all parameters at once, for every instance (gradient scale) of `grads`;
    and that joint update (`joint` when given, else computed in the same program)."""
    jobs: list[Job] = [] if joint is not None else [(proxy, grads, None)]
    cuts = []
    for group in groups:

        def cut(values: Leaves, group: Sequence[str] = group) -> Leaves:
            picked = {n: values[n] for n in group}
            return _halves(picked) if sharded else picked

        piece_grads = [cut(g) for g in grads]
        carriers = None
        if carrier:
            total = [_square_norms(g) for g in grads]
            seen = [_square_norms(g) for g in piece_grads]
            reps = 2 if sharded else 1
            carriers = np.stack(
                [np.sqrt(np.maximum(np.repeat(t, reps) - s, 0.0)) for t, s in zip(total, seen)]
            )
        jobs.append((cut(proxy), piece_grads, carriers))
        cuts.append(cut)
    results = _runs(optimizer, tree, jobs)
    if joint is None:
        joint, *results = results
    agrees = all(_same_updates(got, cut(joint), cut(proxy)) for cut, got in zip(cuts, results))
    return agrees, joint


def _same_updates(got: Leaves, want: Leaves, start: Leaves) -> bool:
    for n, v in got.items():
        # compare the updates, relative to their own size: parameters of size 10 would
        # hide an update that is wrong by 15% at a small learning rate
        got_update = np.asarray(v, np.float64) - start[n]
        want_update = np.asarray(want[n], np.float64) - start[n]
        scale = np.max(np.abs(want_update.reshape(len(v), -1)), axis=1, initial=0.0)
        tol = 1e-3 * scale.reshape((-1,) + (1,) * (v.ndim - 1)) + 1e-30
        if got_update.shape != want_update.shape or not np.all(
            np.abs(got_update - want_update) <= tol + 1e-3 * np.abs(want_update)
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
    shapes = {n: _proxy_shape(np.shape(p)) for n, p in params.items()}
    if updates_are_per_element(optimizer, tree, shapes, groups, sharded):
        return False
    rng = np.random.default_rng(0)
    proxy = {n: rng.normal(size=s).astype(np.float32) * 10 for n, s in shapes.items()}
    # gradient scales far below and far above any clipping threshold a user would set, so
    # a norm-dependent transform shows its coupling at one of them: one instance each
    scales = np.array([1e-6, 1.0, 1e6], np.float32)
    instances = len(scales)
    grads = [
        {
            k: rng.normal(size=v.shape).astype(np.float32)[None]
            * 10
            * scales.reshape((-1,) + (1,) * v.ndim)
            for k, v in proxy.items()
        }
        for _ in range(2)
    ]
    proxy = {k: np.broadcast_to(v, (instances, *v.shape)).copy() for k, v in proxy.items()}
    try:
        agrees, joint = _agrees(optimizer, tree, proxy, grads, None, groups, sharded, False)
        if agrees:
            return False
        # the second try (every optimizer that clips by the global norm takes it) reuses
        # the joint update of the first
        if _agrees(optimizer, tree, proxy, grads, joint, groups, sharded, True)[0]:
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
