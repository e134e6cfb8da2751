"""What a region's forward hands its backward, and what the backward computes itself.

Note [residuals from parameters alone]
`jax.vjp` keeps every value its linear part reads, and some of those read no batch or
activation input: a causal mask broadcast to the attention scores' shape, the zeros a
`jnp.where` keeps for its other branch's cotangent (as wide as the scores), a norm's
scale reshaped, the bf16 copy of a kernel that a mixed-precision layer makes from its
fp32 parameter (half the stage's weight bytes). Within one jit XLA folds such values into
the backward's kernels; with the forward and backward as separate programs, F wrote each
one for every microbatch, B read it back, and a pipeline held them for every microbatch
in flight. In the example GPT (d_model 128, 4 layers, 8 sequences of 128 per replica)
they were 23 of the 156 residual arrays, 10.1 of 100.8 MiB per microbatch, and the mask
and zeros grow with the square of the sequence.

So the forward's linearization runs through its jaxpr: the residual leaves that read no
batch or activation input (looking into nested jit calls, whose outputs need not read
all of their inputs) leave F's outputs, and the backward computes them from the
parameters it takes anyway, with a dead-code-eliminated slice of that jaxpr. A leaf that
*is* a parameter is the parameter (Note [residuals hold activations only] in
mpmd_runtime/programs.py).
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable, Mapping, Sequence
from typing import Any

import jax
from piper_jax.ir import jax_compat as jc


@dataclasses.dataclass(frozen=True)
class ResidualSplit:
    """How the leaves of a VJP reach the backward: as a parameter (`param_of`: leaf ->
    parameter index), computed from the parameters (`derived`, by `derive`), or kept by
    the forward (every other leaf, in order)."""

    treedef: Any
    avals: tuple[jax.ShapeDtypeStruct, ...]
    param_of: Mapping[int, int]
    derived: tuple[int, ...]
    derive: Callable[[Sequence[Any]], list[Any]]

    @property
    def kept_avals(self) -> list[jax.ShapeDtypeStruct]:
        return self.kept(self.avals)

    def kept(self, leaves: Sequence[Any]) -> list[Any]:
        """The leaves the forward keeps, out of all of them."""
        skip = set(self.param_of) | set(self.derived)
        return [x for j, x in enumerate(leaves) if j not in skip]

    def leaves(self, params: Sequence[Any], kept: Sequence[Any]) -> list[Any]:
        """All the VJP's leaves again, from the parameters and the kept leaves."""
        derived = dict(zip(self.derived, self.derive(params))) if self.derived else {}
        rest = iter(kept)
        out = []
        for j in range(len(self.avals)):
            if j in self.param_of:
                out.append(params[self.param_of[j]])
            else:
                out.append(derived[j] if j in derived else next(rest))
        return out


def linearize_split(
    linearize: Callable[[list, list, list], tuple[Any, Any]],
    params: list,
    batch: list,
    acts: list,
    rewrite: Callable[[jc.ClosedJaxpr], jc.ClosedJaxpr] | None = None,
) -> tuple[Any, list, ResidualSplit]:
    """`linearize(params, batch, acts)` -> (outputs, VJP), run through its jaxpr (first
    rewritten by `rewrite`, if given): its outputs, the VJP's leaves and how they split
    (Note [residuals from parameters alone]). `params`, `batch` and `acts` are lists of
    arrays."""
    closed, (outs_shape, vjp_shape) = jc.traced_with_shape(linearize, params, batch, acts)
    if rewrite is not None:
        closed = rewrite(closed)
    values = jc.run_jaxpr(closed)(*params, *batch, *acts)
    n_out, n_p = len(jax.tree.leaves(outs_shape)), len(params)
    jaxpr = closed.jaxpr
    param_index = {v: i for i, v in enumerate(jaxpr.invars[:n_p])}
    residual_vars = jaxpr.outvars[n_out:]
    param_of = {
        j: param_index[v] for j, v in enumerate(residual_vars) if jc.is_var(v) and v in param_index
    }
    free = jc.outputs_free_of(closed, [i >= n_p for i in range(len(jaxpr.invars))])[n_out:]
    candidates = [j for j, f in enumerate(free) if f and j not in param_of]
    derived, derive = _deriver(closed, n_out, n_p, candidates)
    split = ResidualSplit(
        treedef=jax.tree.structure(vjp_shape),
        avals=tuple(jax.ShapeDtypeStruct(v.aval.shape, v.aval.dtype) for v in residual_vars),
        param_of=param_of,
        derived=derived,
        derive=derive,
    )
    outs = jax.tree.unflatten(jax.tree.structure(outs_shape), values[:n_out])
    return outs, values[n_out:], split


def _deriver(
    closed: jc.ClosedJaxpr, n_out: int, n_p: int, candidates: Sequence[int]
) -> tuple[tuple[int, ...], Callable[[Sequence[Any]], list[Any]]]:
    """The residual leaves among `candidates` a slice of `closed` computes from the
    parameters alone, and that slice as a function of the parameters."""
    if any(jc.is_tracer(c) for c in closed.consts):
        candidates = []  # constants of an enclosing trace cannot reach another program
    num_outputs = len(closed.jaxpr.outvars)

    def cut(leaves: Sequence[int]) -> tuple[jc.ClosedJaxpr, list[bool]]:
        marked = {n_out + j for j in leaves}
        return jc.output_slice(closed, [i in marked for i in range(num_outputs)])

    sliced, reads = cut(candidates)
    if any(reads[n_p:]):  # a call the slice could not cut: keep what needs no data
        candidates = [j for j in candidates if not any(cut([j])[1][n_p:])]
        sliced, reads = cut(candidates)
    run = jc.run_jaxpr(sliced)

    def derive(params: Sequence[Any]) -> list[Any]:
        return run(*[p for p, used in zip(params, reads) if used])

    return tuple(candidates), derive
