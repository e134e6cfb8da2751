"""BI/BW split of a backward jaxpr: the two halves compute the full backward, with no
equation done twice (see Note [why BW runs after BI, and reuses it])."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
from piper_jax.ir.backward_split import live_equations, split_backward


def mlp(params: list, x: jax.Array) -> jax.Array:
    w1, w2 = params
    return jnp.tanh(x @ w1) @ w2


def test_split_halves_add_up_without_recomputation() -> None:
    rng = np.random.default_rng(0)
    params = [
        rng.normal(size=(4, 8)).astype(np.float32),
        rng.normal(size=(8, 3)).astype(np.float32),
    ]
    x = rng.normal(size=(5, 4)).astype(np.float32)
    cot = rng.normal(size=(5, 3)).astype(np.float32)
    _, vjp = jax.vjp(mlp, params, x)
    residuals = jax.tree.leaves(vjp)
    closed = jax.make_jaxpr(lambda v, c: jax.tree.leaves(v(c)))(vjp, cot)
    bi, bw, num_cross = split_backward(closed, num_weight_grads=2, num_residuals=len(residuals))

    (*input_grads_and_cross,) = bi(*residuals, cot)
    (dx,), cross = input_grads_and_cross[:1], input_grads_and_cross[1:]
    dw1, dw2 = bw(*residuals, *cross)
    (want_w1, want_w2), want_x = vjp(cot)
    np.testing.assert_allclose(dx, want_x, rtol=1e-6)
    np.testing.assert_allclose(dw1, want_w1, rtol=1e-6)
    np.testing.assert_allclose(dw2, want_w2, rtol=1e-6)
    assert num_cross == len(cross) >= 1  # BW takes the intermediate cotangent from BI

    eqns = closed.jaxpr.eqns
    bi_eqns = live_equations(eqns, closed.jaxpr.outvars[2:])
    bw_eqns = live_equations(eqns, closed.jaxpr.outvars[:2]) - bi_eqns

    def matmuls(indices: set[int]) -> int:
        return sum(eqns[i].primitive.name == "dot_general" for i in indices)

    # BI: the two input-gradient matmuls; BW: the two weight-gradient matmuls, fed by the
    # tanh derivative BI already computed (a cross value), so nothing runs twice
    assert (matmuls(bi_eqns), matmuls(bw_eqns)) == (2, 2)
    assert matmuls(set(range(len(eqns)))) == 4
