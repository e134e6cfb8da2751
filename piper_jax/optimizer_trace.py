"""Prove from its trace that an optimizer treats every parameter element alike.

Note [per-element updates, proven from the trace]
`optimizer_check.plan_optimizer` must know that each parameter group's (and under ZeRO
each flat shard's) own update equals its part of one update of all parameters. Running
the optimizer on proxies answers that for any optimizer, but it traces the optimizer
under `vmap` for every group and compiles the result: 0.9 s of a ZeRO-3 GPT's 5.4 s to its
first step, and more for pipelines of many groups. Most optimizers (sgd, adam, adamw,
their schedules and masks by path) can be settled from their jaxprs alone, with no
compile and no run:

- Trace init and two updates on the whole tree, and on every piece (a group's subtree, or
  its flat ZeRO shards), without `vmap`.
- Colour every value by the parameter leaf its data comes from. A coloured value may only
  flow through elementwise primitives, together with values of the same colour and values
  that are the same at every element (scalars, scalars broadcast); anything else (a
  reduction, a reshape, an iota, a value of two leaves) is not proven, and the proxies
  decide.
- Give every value a structural name: its primitive, the parameters that are not shapes,
  and its operands' names (leaves named by role and path). Equal names compute the same
  scalar function of the same elements, whatever the shapes.
- Proven when every piece gives each of its updated leaves the name the whole-tree trace
  gave it: a mask or label that reads leaf shapes, leaf counts or positions traces
  differently on a piece, and is sent to the proxies.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import jax
import numpy as np
import optax

from piper_jax.ir import jax_compat as jc
from piper_jax.mpmd_runtime.zero import shard_len
from piper_jax.param_tree import ParamTree

STEPS = 2  # updates traced, as many as the proxies run

ELEMENTWISE = frozenset(
    "abs acos acosh add and asin asinh atan atan2 atanh cbrt ceil clamp conj copy copy_p "
    "cos cosh div eq erf erf_inv erfc exp exp2 expm1 floor ge gt imag integer_pow is_finite "
    "le lgamma log log1p logistic lt max min mul ne neg nextafter not or pow real rem round "
    "rsqrt select_n sign sin sinh sqrt square sub tan tanh xor convert_element_type "
    "reduce_precision".split()
)
# primitives that call one jaxpr on their operands as they are: inlined
CALLS = frozenset(
    "jit pjit closed_call core_call custom_jvp_call custom_vjp_call remat checkpoint".split()
)
SHAPE_PARAMS = frozenset(("shape", "broadcast_dimensions", "sharding", "out_sharding"))


class NotProven(Exception):
    """The trace does something the proof does not cover; the proxies decide."""


class _Walk:
    """Colours and structural names of the values of traced jaxprs. Names are interned
    integers shared by every walk of one check, so equal names are equal integers."""

    def __init__(self, names: dict[Any, int]):
        self.names = names
        self.colour: dict[Any, str | None] = {}
        self.uniform: dict[Any, bool] = {}
        self.name: dict[Any, int] = {}

    def intern(self, key: Any) -> int:
        return self.names.setdefault(key, len(self.names))

    def read(self, atom: Any) -> tuple[str | None, bool, int]:
        if jc.is_var(atom):
            return self.colour[atom], self.uniform[atom], self.name[atom]
        value = np.asarray(jc.literal_value(atom))
        key = ("literal", str(value.dtype), value.shape, value.tobytes())
        return None, value.ndim == 0, self.intern(key)

    def bind(self, var: Any, colour: str | None, uniform: bool, name: int) -> None:
        self.colour[var], self.uniform[var], self.name[var] = colour, uniform, name

    def jaxpr(self, jaxpr: Any, inputs: Sequence[tuple[str | None, bool, int]]) -> list:
        for var, value in zip(jaxpr.invars, inputs):
            self.bind(var, *value)
        for eqn in jaxpr.eqns:
            self.equation(eqn)
        return [self.read(v) for v in jaxpr.outvars]

    def equation(self, eqn: Any) -> None:
        operands = [self.read(a) for a in eqn.invars]
        prim = eqn.primitive.name
        if prim in CALLS:
            inner = jc.called_jaxprs(eqn)
            if len(inner) == 1 and len(inner[0][0].invars) == len(operands):
                jaxpr, consts = inner[0]
                for var, value in zip(jaxpr.constvars, consts):
                    self.bind(var, *self.constant(value))
                for var, value in zip(eqn.outvars, self.jaxpr(jaxpr, operands)):
                    self.bind(var, *value)
                return
        colours = {c for c, _, _ in operands if c is not None}
        if len(colours) > 1:
            raise NotProven(f"{prim} combines leaves {sorted(colours)}")
        colour = next(iter(colours), None)
        params = tuple(sorted((k, repr(v)) for k, v in eqn.params.items() if k not in SHAPE_PARAMS))
        key = (prim, params, tuple(n for _, _, n in operands))
        if colour is None:
            # data of no leaf (the step count, a schedule): any primitive; its results are
            # the same at every element only when they are scalars or broadcast ones
            uniform = prim == "broadcast_in_dim" and all(u for _, u, _ in operands)
            uniform = uniform or (prim in ELEMENTWISE and all(u for _, u, _ in operands))
        else:
            shapes = {jc.atom_shape(a) for a, (_, u, _) in zip(eqn.invars, operands) if not u}
            if prim == "broadcast_in_dim" and not shapes and len(operands) == 1:
                uniform = True  # one leaf's scalar, broadcast
            elif (
                prim in ELEMENTWISE
                and len(shapes) <= 1
                and all(u or c == colour for c, u, _ in operands)
            ):
                uniform = not shapes
            else:
                raise NotProven(f"{prim} on the data of leaf {colour}")
        for i, var in enumerate(eqn.outvars):
            scalar = jc.atom_shape(var) == ()
            dtype = str(jc.atom_dtype(var))
            self.bind(var, colour, uniform or scalar, self.intern((*key, i, dtype)))

    def constant(self, value: Any) -> tuple[None, bool, int]:
        array = np.asarray(value)
        key = ("constant", str(array.dtype), array.shape, array.tobytes())
        return None, array.ndim == 0, self.intern(key)


def apply_steps(optimizer: optax.GradientTransformation, params: Any, grads: list) -> Any:
    """`params` after the optimizer's init and one update per gradient tree in `grads`:
    what both the trace here and the proxy run of optimizer_check.py compare."""
    state = optimizer.init(params)
    for g in grads:
        updates, state = optimizer.update(g, state, params)
        params = optax.apply_updates(params, updates)
    return params


def _traced_names(
    optimizer: optax.GradientTransformation,
    tree: ParamTree,
    shapes: dict[str, tuple[int, ...]],
    names: dict[Any, int],
) -> dict[str, int]:
    """Structural name of each leaf after init and STEPS updates on the tree cut to
    `shapes` (leaf name -> shape)."""
    treedef, order = tree(list(shapes), False)

    def as_tree(values: dict[str, Any]) -> Any:
        return jax.tree_util.tree_unflatten(treedef, [values[n] for n in order])

    def steps(params: dict[str, Any], grads: list[dict[str, Any]]) -> list:
        out = apply_steps(optimizer, as_tree(params), [as_tree(g) for g in grads])
        return jax.tree_util.tree_leaves(out)

    spec = {n: jax.ShapeDtypeStruct(s, np.float32) for n, s in shapes.items()}
    closed = jc.trace_to_jaxpr(steps, spec, [spec] * STEPS)
    walk = _Walk(names)
    roles = ["p"] + [f"g{k}" for k in range(STEPS)]
    # make_jaxpr flattens (params, [grads...]): each a dict, so in sorted leaf order
    inputs = [(n, walk.intern(("input", role, n))) for role in roles for n in sorted(shapes)]
    for var, value in zip(closed.jaxpr.constvars, closed.consts):
        walk.bind(var, *walk.constant(value))
    outs = walk.jaxpr(closed.jaxpr, [(n, False, i) for n, i in inputs])
    result = {}
    for n, (colour, _, name) in zip(order, outs):
        if colour not in (n, None):
            raise NotProven(f"leaf {n} is updated from leaf {colour}")
        result[n] = name
    return result


def updates_are_per_element(
    optimizer: optax.GradientTransformation,
    tree: ParamTree,
    shapes: dict[str, tuple[int, ...]],
    groups: Sequence[Sequence[str]],
    sharded: bool,
) -> bool:
    """True when the traces prove that each group's own update (each flat shard's under
    ZeRO) is its part of the update of all leaves (Note [per-element updates, proven from
    the trace]); False when they do not, which proves nothing either way."""
    names: dict[Any, int] = {}
    try:
        whole = _traced_names(optimizer, tree, shapes, names)
        for group in groups:
            piece = {n: shapes[n] for n in group}
            if sharded:  # one of two flat shards of each leaf, as the proxies cut them
                piece = {n: (shard_len(s, 2),) for n, s in piece.items()}
            got = _traced_names(optimizer, tree, piece, names)
            if any(got[n] != whole[n] for n in group):
                return False
    except Exception:  # NotProven, or the optimizer failed: the proxies run it and explain
        return False
    return True
