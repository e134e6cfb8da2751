"""Lift a traced loss into regions: one function per annotated region of the model.

The loss is traced once, at the per-microbatch, per-replica batch shape (shapes are baked
into a jaxpr), and its equations are cut by the annotations each was emitted in (see
Note [how regions survive tracing]). A region is one contiguous run of equations with the
same annotations, so one key may name several regions: a {PP:0} block holding a nested
{PP:0,EP:0} expert layer is three regions, {PP:0}, {PP:0,EP:0} and {PP:0} again, and the
filter {"PP": 0} matches all three. Regions are numbered in the order the model runs them.
A loss with no annotation is one region, {}. Annotations inside a nested jaxpr (code under
jax.jit, jax.checkpoint, scan) cannot be cut out, so they are refused, not ignored.

Note [which region unannotated code joins]
Unannotated code is never refused; each equation joins one region:
  * if its result is used by annotated code (directly or through other unannotated code),
    the earliest region that uses it: leading code (embeddings, input casts, a padding
    mask the model reads) and glue between regions (a residual add, a reshape, a norm
    outside a layer) join the region they feed;
  * otherwise (its result reaches only the loss) the latest region it reads from:
    trailing code (final norm, head, loss) joins the last region;
  * code reading no region's result and used by no annotated code (a label mask made from
    the batch for the loss) joins the earliest region using its result, else the last.
`Region.absorbed` and `describe_unannotated` list what each region absorbed.
"""

from __future__ import annotations

import dataclasses
import functools
from collections.abc import Callable, Sequence
from typing import Any

import jax.numpy as jnp
from piper_jax.ir import jax_compat as jc
from piper_jax.ir.errors import AnnotationError
from piper_jax.ir.fingerprint import region_fingerprint
from piper_jax.ir.regions import RegionKey, region_str
from piper_jax.ir.segments import assign_regions


@dataclasses.dataclass(frozen=True)
class ActRef:
    """Output `position` of region `region`: an activation flowing between regions."""

    region: int
    position: int


@dataclasses.dataclass(frozen=True, eq=False)
class Region:
    """One annotated region: a pure function (params, batch, acts) -> outputs.

    `index` is unique; `key` (its annotation tags) may be shared by several regions (see
    the module docstring). `absorbed` describes the unannotated code the region took in
    ("add at model.py:31"), see Note [which region unannotated code joins].
    """

    index: int
    key: RegionKey
    param_ids: tuple[int, ...]
    batch_ids: tuple[int, ...]
    act_inputs: tuple[ActRef, ...]
    in_shapes: tuple[tuple[tuple[int, ...], Any], ...]
    out_shapes: tuple[tuple[tuple[int, ...], Any], ...]
    loss_position: int | None
    fn: Callable[..., list[Any]]
    absorbed: tuple[str, ...] = ()
    # what `fingerprint` returns, computed on first use (a group of one region never asks)
    fingerprinted: Callable[[], str] = dataclasses.field(default=lambda: "", repr=False)

    @property
    def tags(self) -> dict[str, int]:
        return dict(self.key)

    def out_is_float(self, position: int) -> bool:
        return bool(jnp.issubdtype(self.out_shapes[position][1], jnp.inexact))

    def __str__(self) -> str:
        return region_str(self.key) if self.key else "{}"

    @functools.cached_property
    def fingerprint(self) -> str:
        """Equal for regions that compute the same function (ir/fingerprint.py)."""
        return self.fingerprinted()


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

    assignment = assign_regions(eqns)
    eqn_region = assignment.region_of_eqn

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
    outputs: list[list[Any]] = [[] for _ in assignment.keys]
    for v, r in defined_in.items():
        if v in used_outside or v is loss_var:
            outputs[r].append(v)
    position = {v: (r, outs.index(v)) for r, outs in enumerate(outputs) for v in outs}

    regions = []
    for r, key in enumerate(assignment.keys):
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
        assert all(position[v][0] < r for v in a_vars), "regions read earlier regions only"
        consts = [const_value[v] for v in c_vars]
        invars = p_vars + b_vars + a_vars
        fn = jc.sub_jaxpr_fn(c_vars, consts, invars, outputs[r], r_eqns)
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
                absorbed=assignment.absorbed[r],
                fingerprinted=functools.partial(
                    region_fingerprint, c_vars, consts, invars, outputs[r], r_eqns
                ),
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


def describe_unannotated(lifted: LiftedLoss, limit: int = 4) -> list[str]:
    """One line per region that absorbed unannotated code, for `explain()`: the source
    lines whose code joined it by Note [which region unannotated code joins], with their
    primitives, e.g. "region 1 {PP:1} absorbs unannotated code at model.py:31 (add)"."""
    lines = []
    for r in lifted.regions:
        by_line: dict[str, list[str]] = {}
        for entry in r.absorbed:
            primitive, _, where = entry.partition(" at ")
            by_line.setdefault(where, []).append(primitive)
        parts = [f"{where} ({_first(prims, 3)})" for where, prims in by_line.items()]
        if parts:
            lines.append(f"region {r.index} {r} absorbs unannotated code at {_first(parts, limit)}")
    return lines


def _first(items: list[str], limit: int) -> str:
    more = f", +{len(items) - limit} more" if len(items) > limit else ""
    return ", ".join(items[:limit]) + more
