"""Lift a traced loss into regions: one function per annotated region of the model.

The loss is traced once, at the per-microbatch, per-replica batch shape (shapes are baked
into a jaxpr), and its equations are cut by the region each was emitted in (see
Note [how regions survive tracing]). Unannotated equations follow one rule:

  * leading ones (before the first annotated equation: embeddings, input casts) join the
    first region that consumes their result;
  * trailing ones (after the last annotated equation: final norm, head, loss) join the
    latest region that produces one of their inputs;
  * an unannotated equation between two regions is an error, since it has no natural
    home: wrap it in an annotation.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable, Sequence
from typing import Any

import jax.numpy as jnp
from piper_jax.ir import jax_compat as jc
from piper_jax.ir.errors import AnnotationError
from piper_jax.ir.regions import RegionKey, region_from_name_stack, region_str


@dataclasses.dataclass(frozen=True)
class ActRef:
    """Output `position` of region `region`: an activation flowing between regions."""

    region: int
    position: int


@dataclasses.dataclass(frozen=True, eq=False)
class Region:
    """One annotated region: a pure function (params, batch, acts) -> outputs."""

    index: int
    key: RegionKey
    param_ids: tuple[int, ...]
    batch_ids: tuple[int, ...]
    act_inputs: tuple[ActRef, ...]
    in_shapes: tuple[tuple[tuple[int, ...], Any], ...]
    out_shapes: tuple[tuple[tuple[int, ...], Any], ...]
    loss_position: int | None
    fn: Callable[..., list[Any]]

    @property
    def tags(self) -> dict[str, int]:
        return dict(self.key)

    def out_is_float(self, position: int) -> bool:
        return bool(jnp.issubdtype(self.out_shapes[position][1], jnp.inexact))

    def __str__(self) -> str:
        return region_str(self.key) if self.key else "{}"


@dataclasses.dataclass(frozen=True, eq=False)
class LiftedLoss:
    """The regions of a loss plus the names of its flat parameter and batch leaves."""

    regions: tuple[Region, ...]
    param_names: tuple[str, ...]
    batch_names: tuple[str, ...]
    loss_region: int

    def param_users(self, param_id: int) -> list[int]:
        return [r.index for r in self.regions if param_id in r.param_ids]


def lift(
    flat_loss: Callable[[list[Any], list[Any]], Any],
    params: Sequence[Any],
    batch: Sequence[Any],
    param_names: Sequence[str],
    batch_names: Sequence[str],
) -> LiftedLoss:
    """Trace `flat_loss(params, batch)` and cut it into regions.

    Args:
      flat_loss: the loss as a function of the flat parameter and batch leaves.
      params, batch: example leaves (arrays or ShapeDtypeStructs) at the traced shape.
      param_names, batch_names: readable names of the leaves, for errors and dumps.
    """
    closed = jc.trace_to_jaxpr(flat_loss, list(params), list(batch))
    jaxpr = closed.jaxpr
    eqns = list(jaxpr.eqns)
    param_vars = list(jaxpr.invars[: len(params)])
    batch_vars = list(jaxpr.invars[len(params) :])
    if len(jaxpr.outvars) != 1 or not jc.is_var(jaxpr.outvars[0]):
        raise AnnotationError("loss_fn must return one scalar computed from the model")
    loss_var = jaxpr.outvars[0]
    if loss_var.aval.shape != () or not jnp.issubdtype(loss_var.aval.dtype, jnp.inexact):
        raise AnnotationError(
            f"loss_fn must return a float scalar, got {loss_var.aval.str_short()}"
        )

    keys = _assign_regions(eqns, loss_var)
    order = list(dict.fromkeys(keys))
    region_of = {k: i for i, k in enumerate(order)}
    eqn_region = [region_of[k] for k in keys]

    defined_in: dict[Any, int] = {}
    for i, eqn in enumerate(eqns):
        for v in eqn.outvars:
            defined_in[v] = eqn_region[i]
    used_outside: dict[Any, list[int]] = {}
    for i, eqn in enumerate(eqns):
        for v in eqn.invars:
            if jc.is_var(v) and v in defined_in and defined_in[v] != eqn_region[i]:
                used_outside.setdefault(v, []).append(eqn_region[i])

    param_index = {v: i for i, v in enumerate(param_vars)}
    batch_index = {v: i for i, v in enumerate(batch_vars)}
    const_value = dict(zip(jaxpr.constvars, closed.consts))
    outputs: list[list[Any]] = [[] for _ in order]
    for v, r in defined_in.items():
        if v in used_outside or v is loss_var:
            outputs[r].append(v)
    position = {v: (r, outs.index(v)) for r, outs in enumerate(outputs) for v in outs}

    regions = []
    for r, key in enumerate(order):
        r_eqns = [e for e, er in zip(eqns, eqn_region) if er == r]
        p_vars, b_vars, a_vars, c_vars = [], [], [], []
        for eqn in r_eqns:
            for v in eqn.invars:
                if not jc.is_var(v):
                    continue
                if v in param_index:
                    p_vars.append(v)
                elif v in batch_index:
                    b_vars.append(v)
                elif v in const_value:
                    c_vars.append(v)
                elif defined_in.get(v, r) != r:
                    a_vars.append(v)
        p_vars = sorted(set(p_vars), key=param_index.__getitem__)
        b_vars = sorted(set(b_vars), key=batch_index.__getitem__)
        a_vars = sorted(set(a_vars), key=position.__getitem__)
        c_vars = list(dict.fromkeys(c_vars))
        for v in a_vars:
            q = position[v][0]
            if q > r:
                raise AnnotationError(
                    f"region {region_str(order[q])} feeds region {region_str(key)}, which "
                    "the model enters earlier: regions must follow one another in the "
                    "order the model runs them; do not interleave one region's code with "
                    "another's"
                )
        fn = jc.sub_jaxpr_fn(
            c_vars, [const_value[v] for v in c_vars], p_vars + b_vars + a_vars, outputs[r], r_eqns
        )
        regions.append(
            Region(
                index=r,
                key=key,
                param_ids=tuple(param_index[v] for v in p_vars),
                batch_ids=tuple(batch_index[v] for v in b_vars),
                act_inputs=tuple(ActRef(*position[v]) for v in a_vars),
                in_shapes=tuple(
                    (tuple(v.aval.shape), v.aval.dtype) for v in p_vars + b_vars + a_vars
                ),
                out_shapes=tuple((tuple(v.aval.shape), v.aval.dtype) for v in outputs[r]),
                loss_position=outputs[r].index(loss_var) if loss_var in outputs[r] else None,
                fn=_as_region_fn(fn, len(p_vars), len(b_vars)),
            )
        )
    return LiftedLoss(
        regions=tuple(regions),
        param_names=tuple(param_names),
        batch_names=tuple(batch_names),
        loss_region=defined_in[loss_var],
    )


def _as_region_fn(fn: Callable[..., list[Any]], n_params: int, n_batch: int) -> Callable:
    def region_fn(params: Sequence[Any], batch: Sequence[Any], acts: Sequence[Any]) -> list:
        assert len(params) == n_params and len(batch) == n_batch
        return fn(*params, *batch, *acts)

    return region_fn


def _assign_regions(eqns: list[Any], loss_var: Any) -> list[RegionKey]:
    """The region of every equation, placing unannotated ones by the rule of the module doc."""
    keys = [region_from_name_stack(jc.eqn_name_stack(e)) for e in eqns]
    annotated = [i for i, k in enumerate(keys) if k]
    if not annotated:
        return [()] * len(eqns)
    first, last = annotated[0], annotated[-1]
    rank = {k: i for i, k in enumerate(dict.fromkeys(k for k in keys if k))}
    for i in range(first, last):
        if not keys[i]:
            raise AnnotationError(
                f"equation '{eqns[i].primitive}' at {jc.eqn_location(eqns[i])} runs between "
                "annotated regions but is in none: wrap it in piper_jax.annotate(...) or move "
                "it inside a neighbouring region"
            )
    producer: dict[Any, int] = {}
    for i, eqn in enumerate(eqns):
        for v in eqn.outvars:
            producer[v] = i
    for i in range(last + 1, len(eqns)):
        sources = [keys[producer[v]] for v in eqns[i].invars if jc.is_var(v) and v in producer]
        keys[i] = max(sources, key=rank.__getitem__) if sources else keys[last]
    consumers: dict[Any, list[int]] = {}
    for i, eqn in enumerate(eqns):
        for v in eqn.invars:
            if jc.is_var(v):
                consumers.setdefault(v, []).append(i)
    for i in reversed(range(first)):
        users = [keys[c] for v in eqns[i].outvars for c in consumers.get(v, [])]
        keys[i] = min(users, key=rank.__getitem__) if users else keys[first]
    return keys
