"""Prove from its trace that an optimizer treats every parameter element alike.

Note [per-element updates, proven from the trace]
`optimizer_check.plan_optimizer` must know that each parameter group's (and under ZeRO
each flat shard's) own update equals its part of one update of all parameters. Running
the optimizer on proxies answers that for any optimizer, but it traces the optimizer
under `vmap` for every group and compiles the result: 0.9 s of a ZeRO-3 GPT's 5.4 s to its
first step, and more for pipelines of many groups. Most optimizers (sgd, adam, adamw,
their schedules and masks by path) can be settled from their jaxprs alone, with no
compile and no run:

- Trace init and one update on the whole tree, and on every piece (a group's subtree, or
  its flat ZeRO shards), without `vmap`, and walk the update twice, the second walk on
  what the first left in the state (tracing optax is most of the check's time: a ZeRO-3
  GPT of 52 leaves took 0.19-0.2 s per tree tracing two updates, 0.10 s tracing one).
  An update that changes the state's types is not proven: its trace then no longer
  stands for the next update.
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

    def closed(self, closed: Any, inputs: Sequence[tuple[str | None, bool, int]]) -> list:
        """Walk a closed jaxpr (its constants named by value) on `inputs`."""
        for var, value in zip(closed.jaxpr.constvars, closed.consts):
            self.bind(var, *self.constant(value))
        return self.jaxpr(closed.jaxpr, inputs)

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
        params, state = _update(optimizer, params, g, state)
    return params


def _update(
    optimizer: optax.GradientTransformation, params: Any, grads: Any, state: Any
) -> tuple[Any, Any]:
    updates, state = optimizer.update(grads, state, params)
    return optax.apply_updates(params, updates), state


def _traced_names(
    optimizer: optax.GradientTransformation,
    tree: ParamTree,
    shapes: dict[str, tuple[int, ...]],
    names: dict[Any, int],
) -> dict[str, int]:
    """Structural name of each leaf after init and STEPS updates on the tree cut to
    `shapes` (leaf name -> shape). One update is traced and walked STEPS times, each walk
    on the names the one before left (tracing optax is most of the check's time); that
    is the trace of STEPS updates as long as an update keeps the state's types."""
    treedef, order = tree(list(shapes), False)

    def as_tree(values: dict[str, Any]) -> Any:
        return jax.tree_util.tree_unflatten(treedef, [values[n] for n in order])

    def update(params: dict[str, Any], grads: dict[str, Any], state: Any) -> tuple:
        new, state = _update(optimizer, as_tree(params), as_tree(grads), state)
        return jax.tree_util.tree_leaves(new), state

    spec = {n: jax.ShapeDtypeStruct(s, np.float32) for n, s in shapes.items()}
    init, state = jax.make_jaxpr(lambda p: optimizer.init(as_tree(p)), return_shape=True)(spec)
    step, (_, after) = jax.make_jaxpr(update, return_shape=True)(spec, spec, state)
    if _types(after) != _types(state):
        raise NotProven("an update changes the optimizer state's types")
    walk = _Walk(names)
    # make_jaxpr flattens each dict of leaves in sorted leaf order
    params = [(n, False, walk.intern(("input", "p", n))) for n in sorted(shapes)]
    state_names = walk.closed(init, params)
    for k in range(STEPS):
        grads = [(n, False, walk.intern(("input", f"g{k}", n))) for n in sorted(shapes)]
        outs = walk.closed(step, params + grads + state_names)
        by_leaf = dict(zip(order, outs[: len(order)]))
        params, state_names = [by_leaf[n] for n in sorted(shapes)], outs[len(order) :]
    result = {}
    for n, (colour, _, name) in by_leaf.items():
        if colour not in (n, None):
            raise NotProven(f"leaf {n} is updated from leaf {colour}")
        result[n] = name
    return result


def _types(tree: Any) -> tuple:
    leaves, treedef = jax.tree_util.tree_flatten(tree)
    return treedef, [(x.shape, x.dtype, getattr(x, "weak_type", False)) for x in leaves]


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
