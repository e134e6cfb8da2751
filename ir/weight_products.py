"""Write each weight gradient of a backward as the product XLA:CPU runs fastest.

Note [weight gradients as direct products]
JAX transposes `y = x @ w` into the weight gradient `transpose(dot_general(dy, x))`: a
product with the output's dimensions swapped, then a transpose. XLA's algebraic
simplifier folds that transpose into the product, and on XLA:CPU the folded product of
activations shaped (batch, sequence, features), contracted over both leading dimensions,
is not one its fast matrix library (YNNPACK) takes: it runs on Eigen, after a transposed
copy of the other operand. Written as `dot_general(x, dy)` from the start, the same
product runs in the library. Measured on one CPU device, the gradient of a (128, 512)
weight over 8 x 128 rows: 1,865 us folded against 822 us direct (with 2-D activations
both forms ran alike). In one `jax.jit` of a whole data-parallel step the sharding
partitioner happens to keep the two apart (a gradient all-reduce sits between the
product and the transpose), which is why pjit's step did not pay it and piper-jax's did:
in the example GPT (d_model 128, 4 layers, 4 CPU devices) Eigen ran 8 weight-gradient
products of the backward program (16 with the forward in the same program), some 11% of
a data-parallel step's CPU samples against 1.5% for pjit. Rewritten, the step took 0.92x
the time (0.86-1.02x over 8 rounds, same losses), under ZeRO-3 0.98x; against pjit's
step, DP went from 1.06-1.07x to 0.93x and ZeRO-3 from 1.07-1.08x to 1.00-1.01x.

`swap_transposed_products` rewrites every `transpose` that only swaps the two sides of a
`dot_general` without batch dimensions (and is that product's only reader) into the
swapped product itself: the same sums, one equation fewer. Equations inside nested
jaxprs (a `jax.jit` or `jax.checkpoint` inside the model) are left as they are.
mpmd_runtime/programs.py applies it to the backward passes on CPU devices only, where it
was measured; GPU matrix libraries take a transposed operand as it is.
"""

from __future__ import annotations

from collections import Counter
from collections.abc import Callable
from typing import Any

from piper_jax.ir import jax_compat as jc


def swap_transposed_products(closed: jc.ClosedJaxpr) -> jc.ClosedJaxpr:
    """`closed` with each `transpose(dot_general(a, b))` that only swaps a's and b's
    free dimensions written as `dot_general(b, a)` (Note [weight gradients as direct
    products]); again on the result, so a product transposed twice (a tied weight used
    transposed) becomes one product too."""
    while (swapped := _swap_once(closed)) is not closed:
        closed = swapped
    return closed


def _swap_once(closed: jc.ClosedJaxpr) -> jc.ClosedJaxpr:
    eqns = list(closed.jaxpr.eqns)
    reads = Counter(v for e in eqns for v in e.invars if jc.is_var(v))
    reads.update(v for v in closed.jaxpr.outvars if jc.is_var(v))
    producer = {v: i for i, e in enumerate(eqns) for v in e.outvars}
    swapped: dict[int, Any] = {}  # product's index -> the swapped product
    dropped: set[int] = set()  # the transposes it replaces
    for j, eqn in enumerate(eqns):
        if eqn.primitive.name != "transpose" or not jc.is_var(eqn.invars[0]):
            continue
        i = producer.get(eqn.invars[0])
        if i is None or reads[eqn.invars[0]] != 1 or eqns[i].primitive.name != "dot_general":
            continue
        product = eqns[i]
        (lhs_contract, rhs_contract), batch = product.params["dimension_numbers"]
        if any(batch):
            continue
        lhs, rhs = product.invars
        lhs_free = len(jc.atom_shape(lhs)) - len(lhs_contract)
        rhs_free = len(jc.atom_shape(rhs)) - len(rhs_contract)
        swap = (*range(lhs_free, lhs_free + rhs_free), *range(lhs_free))
        if tuple(eqn.params["permutation"]) != swap:
            continue
        params = dict(product.params, dimension_numbers=((rhs_contract, lhs_contract), ((), ())))
        swapped[i] = jc.eqn_like(product, [rhs, lhs], eqn.outvars, params)
        dropped.add(j)
    if not swapped:
        return closed
    return jc.with_eqns(closed, [swapped.get(i, e) for i, e in enumerate(eqns) if i not in dropped])


def with_swapped_products(fn: Callable[..., Any]) -> Callable[..., Any]:
    """`fn`, traced and run with `swap_transposed_products` applied to its jaxpr (and to
    the bodies of the checkpoints at its top level)."""
    return jc.run_rewritten(fn, lambda c: swap_transposed_products(jc.inline_checkpoints(c)))
