"""Weight gradients as direct products (Note [weight gradients as direct products]): the
rewrite keeps every value, removes each transpose that only swaps a product's sides, and
leaves every other transpose alone; piper-jax's backward programs on CPU ask XLA for no
transposed product."""

from __future__ import annotations

import re

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from helpers import mlp_program_texts
from piper_jax.ir import jax_compat as jc
from piper_jax.ir.weight_products import swap_transposed_products, with_swapped_products

import piper_jax as piper
from piper_jax import schedules


def transposed_products(closed: jc.ClosedJaxpr) -> int:
    """Transposes that read a dot_general without batch dimensions."""
    producers = {v: e for e in closed.jaxpr.eqns for v in e.outvars}
    count = 0
    for eqn in closed.jaxpr.eqns:
        source = producers.get(eqn.invars[0]) if eqn.invars and jc.is_var(eqn.invars[0]) else None
        if eqn.primitive.name == "transpose" and source is not None:
            count += source.primitive.name == "dot_general" and not any(
                source.params["dimension_numbers"][1]
            )
    return count


def tied_mlp(params: list, x: jax.Array) -> jax.Array:
    """Two products and a tied matrix used transposed (its gradient is transposed twice)."""
    w, embed = params
    h = jnp.tanh(x @ embed)
    return jnp.tanh(h @ w) @ embed.T


def backward_of(fn, params: list, x: jax.Array) -> tuple[jc.ClosedJaxpr, list]:
    _, vjp = jax.vjp(fn, params, x)
    cot = np.random.default_rng(1).normal(size=x.shape).astype(np.float32)
    closed = jax.make_jaxpr(lambda c: jax.tree.leaves(vjp(c)))(cot)
    return closed, [cot]


def test_weight_gradients_become_direct_products_with_the_same_values() -> None:
    rng = np.random.default_rng(0)
    params = [
        rng.normal(size=(6, 6)).astype(np.float32),
        rng.normal(size=(4, 6)).astype(np.float32),
    ]
    x = rng.normal(size=(5, 4)).astype(np.float32)
    closed, args = backward_of(tied_mlp, params, x)
    assert transposed_products(closed) >= 2  # JAX's transpose of x @ w, and of h @ embed.T

    swapped = swap_transposed_products(closed)
    assert transposed_products(swapped) == 0
    assert len(swapped.jaxpr.eqns) < len(closed.jaxpr.eqns)  # a transpose fewer per product
    for got, want in zip(jc.run_jaxpr(swapped)(*args), jc.run_jaxpr(closed)(*args)):
        np.testing.assert_allclose(got, want, rtol=1e-6, atol=1e-6)

    _, vjp = jax.vjp(tied_mlp, params, x)
    run = with_swapped_products(vjp)(*args)
    for got, want in zip(jax.tree.leaves(run), jax.tree.leaves(vjp(*args))):
        np.testing.assert_allclose(got, want, rtol=1e-6, atol=1e-6)


def read_twice(a: jax.Array, b: jax.Array) -> jax.Array:
    product = a[0] @ b[0]
    return product.T + product


@pytest.mark.parametrize(
    "fn",
    [
        lambda a, b: jax.lax.dot_general(a, b, (((2,), (1,)), ((0,), (0,)))).transpose(0, 2, 1),
        read_twice,
        lambda a, b: jax.lax.dot_general(a, b[0], (((2,), (0,)), ((), ()))).transpose(1, 0, 2),
    ],
    ids=["batch_dims", "product_read_twice", "not_a_swap_of_sides"],
)
def test_other_transposes_stay(fn) -> None:
    a = jnp.ones((2, 4, 4))
    b = jnp.ones((2, 4, 4))
    closed = jax.make_jaxpr(fn)(a, b)
    assert swap_transposed_products(closed) is closed


@pytest.mark.parametrize(
    "directives",
    [
        [piper.replicate({"PP": "*"}, [0, 1])],
        [piper.split({"PP": "*"}, num_microbatches=2), piper.place({"PP": 0}, [0])]
        + [piper.place({"PP": 1}, [1])]
        + schedules.zero_bubble_h1(2, 2),
        # the backward's recomputation arrives as one checkpoint equation, opened first
        [piper.replicate({"PP": "*"}, [0, 1]), piper.recompute({"PP": "*"}, keep="costly")],
    ],
    ids=["dp2", "pp2_zbh1", "dp2_keep_costly"],
)
def test_backward_programs_ask_xla_for_no_transposed_product(directives: list) -> None:
    backward = mlp_program_texts(directives, r"\bB[IW]?\d")
    products = 0
    for label, text in backward.items():
        direct = set(re.findall(r"(%\S+) = stablehlo\.dot_general (?!.*batching_dims)", text))
        transposed = re.findall(r"= stablehlo\.transpose (%[^,\s]+)", text)
        assert not direct & set(transposed), label
        products += len(direct)
    assert products >= 4  # two weight gradients, their input gradients, the tied matrix's
