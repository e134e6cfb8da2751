"""Split a region's backward jaxpr into BI (input gradients) and BW (weight gradients).

Note [why BW runs after BI, and reuses it]
Zero-bubble schedules run BI as soon as the next stage's cotangent arrives, because the
previous stage waits for it, and defer BW (needed only by the optimizer) into bubbles.
The backward jaxpr is cut by dead-code elimination: BI keeps the equations the input
gradients need; BW keeps the rest of what the weight gradients need, and takes from BI
every value both need (intermediate cotangents) instead of computing it again. So the
split adds no FLOPs; it only moves the weight-gradient matmuls later.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Any

from piper_jax.ir import jax_compat as jc


def live_equations(eqns: Sequence[Any], outvars: Sequence[Any]) -> set[int]:
    """Indices of the equations `outvars` depend on (a backward DCE sweep)."""
    live = {v for v in outvars if jc.is_var(v)}
    keep: set[int] = set()
    for i in reversed(range(len(eqns))):
        eqn = eqns[i]
        if eqn.effects or any(v in live for v in eqn.outvars):
            keep.add(i)
            live.update(v for v in eqn.invars if jc.is_var(v))
    return keep


def split_backward(
    closed: jc.ClosedJaxpr, num_weight_grads: int, num_residuals: int
) -> tuple[Callable[..., list], Callable[..., list], int]:
    """Cut a backward jaxpr with inputs (residuals..., output cotangents...) and outputs
    (weight grads..., input grads...).

    Returns (bi, bw, num_cross): bi(*inputs) -> input grads + cross values;
    bw(*residuals, *cross values) -> weight grads. The cross values are what BW needs
    beyond the residuals: values BI computed, and output cotangents.
    """
    jaxpr = closed.jaxpr
    eqns = list(jaxpr.eqns)
    w_out = list(jaxpr.outvars[:num_weight_grads])
    i_out = list(jaxpr.outvars[num_weight_grads:])
    bi_idx = live_equations(eqns, i_out)
    bw_idx = live_equations(eqns, w_out) - bi_idx
    bi_defined = {v for i in bi_idx for v in eqns[i].outvars}
    bi_defined.update(jaxpr.invars[num_residuals:])
    bw_eqns = [eqns[i] for i in sorted(bw_idx)]
    cross: list[Any] = []
    for v in [v for e in bw_eqns for v in e.invars] + w_out:
        if jc.is_var(v) and v in bi_defined and v not in cross:
            cross.append(v)
    consts = list(zip(jaxpr.constvars, closed.consts))
    bi = jc.sub_jaxpr_fn(
        [c for c, _ in consts],
        [x for _, x in consts],
        jaxpr.invars,
        i_out + cross,
        [eqns[i] for i in sorted(bi_idx)],
    )
    bw = jc.sub_jaxpr_fn(
        [c for c, _ in consts],
        [x for _, x in consts],
        list(jaxpr.invars[:num_residuals]) + cross,
        w_out,
        bw_eqns,
    )
    return bi, bw, len(cross)
