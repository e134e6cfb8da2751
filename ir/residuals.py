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

The same holds for a leaf that reads the batch but no activation through cheap
elementwise and layout work only (`CHEAP_PRIMITIVES`), such as a padding mask broadcast
to the scores' shape: F keeps the batch leaves that slice reads instead (a (batch,
sequence) mask for a (batch, heads, sequence, sequence) one), when they are smaller than
what they replace. Costly work read from the batch (a product with a weight, random bits
for dropout) stays kept: the backward would compute it a second time.
"""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Callable, Mapping, Sequence
from typing import Any

import jax
import numpy as np
from piper_jax.ir import jax_compat as jc

# cheap elementwise and layout work: recomputing it costs less than keeping its result
CHEAP_PRIMITIVES = frozenset(
    {
        *("add", "sub", "mul", "neg", "max", "min", "abs", "sign", "square"),
        *("integer_pow", "select_n", "clamp", "convert_element_type", "copy", "copy_p"),
        *("eq", "ne", "lt", "le", "gt", "ge", "and", "or", "not", "xor"),
        *("broadcast_in_dim", "reshape", "squeeze", "expand_dims", "transpose", "rev"),
        *("slice", "dynamic_slice", "concatenate", "pad", "iota"),
        *("reshard", "sharding_constraint", "device_put", "mesh_cast", "pbroadcast"),
    }
)


@dataclasses.dataclass(frozen=True)
class ResidualSplit:
    """How the leaves of a VJP reach the backward: as a parameter (`param_of`: leaf ->
    parameter index), computed by `derive` from the parameters and the batch leaves
    `batch_reads` (`derived`), or kept by the forward (every other leaf, in order,
    followed by those batch leaves)."""

    treedef: Any
    avals: tuple[jax.ShapeDtypeStruct, ...]
    param_of: Mapping[int, int]
    derived: tuple[int, ...]
    batch_reads: tuple[int, ...]
    batch_avals: tuple[jax.ShapeDtypeStruct, ...]
    derive: Callable[[Sequence[Any], Sequence[Any]], list[Any]]

    @property
    def kept_avals(self) -> list[jax.ShapeDtypeStruct]:
        return self._own(self.avals) + list(self.batch_avals)

    def kept(self, leaves: Sequence[Any], batch: Sequence[Any]) -> list[Any]:
        """What the forward keeps, from all the VJP's leaves and the batch leaves."""
        return self._own(leaves) + [batch[i] for i in self.batch_reads]

    def _own(self, leaves: Sequence[Any]) -> list[Any]:
        skip = set(self.param_of) | set(self.derived)
        return [x for j, x in enumerate(leaves) if j not in skip]

    def leaves(self, params: Sequence[Any], kept: Sequence[Any]) -> list[Any]:
        """All the VJP's leaves again, from the parameters and what the forward kept."""
        n_own = len(kept) - len(self.batch_reads)
        own, batch = kept[:n_own], kept[n_own:]
        derived = dict(zip(self.derived, self.derive(params, batch))) if self.derived else {}
        rest = iter(own)
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
    n_out, n_p, n_b = len(jax.tree.leaves(outs_shape)), len(params), len(batch)
    jaxpr = closed.jaxpr
    param_index = {v: i for i, v in enumerate(jaxpr.invars[:n_p])}
    residual_vars = jaxpr.outvars[n_out:]
    param_of = {
        j: param_index[v] for j, v in enumerate(residual_vars) if jc.is_var(v) and v in param_index
    }
    n_in = len(jaxpr.invars)
    free = jc.outputs_free_of(closed, [i >= n_p for i in range(n_in)])[n_out:]
    act_inputs = [i >= n_p + n_b for i in range(n_in)]
    cheaply = jc.outputs_free_of(closed, act_inputs, CHEAP_PRIMITIVES)[n_out:]
    from_params = [j for j, f in enumerate(free) if f and j not in param_of]
    from_batch = [j for j, (f, c) in enumerate(zip(free, cheaply)) if c and not f]
    derived, reads, derive = _Deriver(closed, n_out, n_p, n_b).choose(from_params, from_batch)
    split = ResidualSplit(
        treedef=jax.tree.structure(vjp_shape),
        avals=tuple(_aval(v) for v in residual_vars),
        param_of=param_of,
        derived=derived,
        batch_reads=reads,
        batch_avals=tuple(_aval(jaxpr.invars[n_p + i]) for i in reads),
        derive=derive,
    )
    outs = jax.tree.unflatten(jax.tree.structure(outs_shape), values[:n_out])
    return outs, values[n_out:], split


def _aval(atom: Any) -> jax.ShapeDtypeStruct:
    return jax.ShapeDtypeStruct(jc.atom_shape(atom), jc.atom_dtype(atom))


def nbytes(avals: Sequence[Any]) -> int:
    """Bytes of arrays of these shapes and dtypes."""
    return sum(math.prod(a.shape) * np.dtype(a.dtype).itemsize for a in avals)


class _Deriver:
    """Which residual leaves a slice of a linearization's jaxpr computes without the
    activations, and that slice."""

    def __init__(self, closed: jc.ClosedJaxpr, n_out: int, n_p: int, n_b: int):
        self.closed, self.n_out, self.n_p, self.n_b = closed, n_out, n_p, n_b
        # constants of an enclosing trace cannot reach another program
        self.usable = not any(jc.is_tracer(c) for c in closed.consts)

    def cut(self, leaves: Sequence[int]) -> tuple[jc.ClosedJaxpr, list[bool]]:
        """The slice computing `leaves`, and which inputs of the jaxpr it reads."""
        marked = {self.n_out + j for j in leaves}
        outputs = [i in marked for i in range(len(self.closed.jaxpr.outvars))]
        return jc.output_slice(self.closed, outputs)

    def _reads_acts(self, reads: Sequence[bool]) -> bool:
        return any(reads[self.n_p + self.n_b :])

    def choose(
        self, from_params: Sequence[int], from_batch: Sequence[int]
    ) -> tuple[tuple[int, ...], tuple[int, ...], Callable[[Sequence[Any], Sequence[Any]], list]]:
        """The leaves to derive (all of `from_params`; `from_batch`, cheap work on the
        batch, when it outweighs the batch leaves it reads), the batch leaves their slice
        reads, and that slice as a function of the parameters and those batch leaves."""
        if not self.usable:
            from_params, from_batch = [], []
        cheap = list(from_batch)
        if cheap:
            reads = self.cut(cheap)[1][self.n_p : self.n_p + self.n_b]
            avals = self.closed.jaxpr.invars[self.n_p : self.n_p + self.n_b]
            read_bytes = nbytes([_aval(v) for v, r in zip(avals, reads) if r])
            outvars = self.closed.jaxpr.outvars[self.n_out :]
            if nbytes([_aval(outvars[j]) for j in cheap]) <= read_bytes:
                cheap = []
        derived = sorted([*from_params, *cheap])
        sliced, reads = self.cut(derived)
        if self._reads_acts(reads):  # a call the slice could not cut
            derived = [j for j in derived if not self._reads_acts(self.cut([j])[1])]
            sliced, reads = self.cut(derived)
        run = jc.run_jaxpr(sliced)
        used_params = reads[: self.n_p]

        def derive(params: Sequence[Any], batch: Sequence[Any]) -> list[Any]:
            return run(*[p for p, used in zip(params, used_params) if used], *batch)

        batch_reads = tuple(i for i, r in enumerate(reads[self.n_p : self.n_p + self.n_b]) if r)
        return tuple(derived), batch_reads, derive
