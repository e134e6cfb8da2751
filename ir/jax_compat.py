"""The one place piper-jax touches JAX's internals: its jaxpr data structures, and the
array constructor the runtime's transfers use.

The jaxpr parts are public in `jax.extend.core` on the supported versions; keeping every
use in one module means a JAX release that moves them breaks one file, not the compiler.
"""

from __future__ import annotations

import os
import sys
from collections.abc import Callable, Iterator, Sequence
from typing import Any

import jax
import jax.extend.core as jex
from jax._src import (
    core,  # private: the abstract value of an assembled array
    source_info_util,  # private: user frames for error messages
    xla_bridge,  # private: has the backend started?
)
from jax._src.array import ArrayImpl  # private: an array from device arrays, unchecked
from jax._src.interpreters import partial_eval  # private: dead-code elimination of jaxprs

SUPPORTED_JAX_VERSIONS = ("0.10.2",)

ClosedJaxpr = jex.ClosedJaxpr
JaxprEqn = jex.JaxprEqn
Literal = jex.Literal
Var = jex.Var


def trace_to_jaxpr(fn: Callable[..., Any], *args: Any) -> ClosedJaxpr:
    return jax.make_jaxpr(fn)(*args)


def eqn_name_stack(eqn: JaxprEqn) -> str:
    return str(eqn.source_info.name_stack)


def eqn_location(eqn: JaxprEqn) -> str:
    """A short 'file:line' of the user code that emitted `eqn`, for error messages: the
    innermost frame outside JAX, Flax, Optax and piper-jax (an nnx.Linear's matmul points
    at the model line that called the layer, not into Flax)."""
    frames = list(source_info_util.user_frames(eqn.source_info.traceback))
    frame = next((f for f in frames if not _is_library_file(f.file_name)), None)
    frame = frame or next(iter(frames), None)
    if frame is None:
        return "<unknown>"
    return f"{frame.file_name}:{frame.start_line}"


def caller_location() -> str:
    """'file:line' of the innermost Python frame of the caller outside JAX, Flax, Optax,
    piper-jax and the standard library, for errors raised while the model runs."""
    frame = sys._getframe(1)
    while frame is not None:
        path = frame.f_code.co_filename
        if source_info_util.is_user_filename(path) and not _is_library_file(path):
            return f"{path}:{frame.f_lineno}"
        frame = frame.f_back
    return "<unknown>"


def _library_dirs() -> tuple[str, ...]:
    names = ("flax", "optax", "piper_jax", "piper_jax.ir", "piper_jax.directives")
    files = [getattr(sys.modules.get(n), "__file__", None) for n in names]
    return tuple(os.path.dirname(f) + os.sep for f in files if f)


def _is_library_file(path: str) -> bool:
    return path.startswith(_library_dirs())


def nested_eqns(eqn: JaxprEqn) -> Iterator[JaxprEqn]:
    """Every equation inside the jaxprs `eqn` carries (jit, checkpoint, scan, cond, custom
    derivatives), at any depth."""
    for inner in jex.jaxprs_in_params(eqn.params):
        for e in inner.eqns:
            yield e
            yield from nested_eqns(e)


def is_var(atom: Any) -> bool:
    return isinstance(atom, Var)


def called_jaxprs(eqn: JaxprEqn) -> list[tuple[Any, list[Any]]]:
    """The jaxprs in `eqn`'s parameters, each as (jaxpr, its constants)."""
    out = []
    for value in eqn.params.values():
        for v in value if isinstance(value, tuple) else (value,):
            if isinstance(v, ClosedJaxpr):
                out.append((v.jaxpr, list(v.consts)))
            elif isinstance(v, jex.Jaxpr):
                out.append((v, []))
    return out


def atom_shape(atom: Any) -> tuple[int, ...]:
    return tuple(atom.aval.shape)


def atom_dtype(atom: Any) -> Any:
    return atom.aval.dtype


def literal_value(atom: Any) -> Any:
    return atom.val


def sub_jaxpr_fn(
    constvars: Sequence[Var],
    consts: Sequence[Any],
    invars: Sequence[Var],
    outvars: Sequence[Var],
    eqns: Sequence[JaxprEqn],
) -> Callable[..., list[Any]]:
    """A callable running `eqns` as a function of `invars` returning `outvars`."""
    debug = jex.DebugInfo(
        "piper region",
        "region",
        tuple(f"in{i}" for i in range(len(invars))),
        tuple(f"out{i}" for i in range(len(outvars))),
    )
    effects = frozenset().union(*(e.effects for e in eqns))
    jaxpr = jex.Jaxpr(
        list(constvars), list(invars), list(outvars), list(eqns), effects, debug_info=debug
    )
    return jex.jaxpr_as_fun(ClosedJaxpr(jaxpr, list(consts)))


def with_eqns(closed: ClosedJaxpr, eqns: Sequence[JaxprEqn]) -> ClosedJaxpr:
    """`closed` with its equations replaced (same inputs, outputs and constants)."""
    return ClosedJaxpr(closed.jaxpr.replace(eqns=list(eqns)), list(closed.consts))


def inline_checkpoints(closed: ClosedJaxpr) -> ClosedJaxpr:
    """`closed` with each top-level `jax.checkpoint` equation (a backward's recomputation
    under a checkpoint policy) replaced by the equations of its body, so that passes
    over the top level (swapping transposed products, cutting BI from BW) see them."""
    eqns: list[JaxprEqn] = []
    renamed: dict[Var, Any] = {}
    inlined: set[int] = set()
    for eqn in closed.jaxpr.eqns:
        body = eqn.params.get("jaxpr")
        if eqn.primitive.name != "remat2" or id(body) in inlined or body.constvars:
            eqns.append(_renamed_eqn(eqn, renamed))
            continue
        inlined.add(id(body))  # its variables may appear once in the result
        inner = dict(zip(body.invars, (_renamed(a, renamed) for a in eqn.invars)))
        eqns += [_renamed_eqn(e, inner) for e in body.eqns]
        renamed.update({out: _renamed(v, inner) for out, v in zip(eqn.outvars, body.outvars)})
    return _with_eqns_renamed(closed, eqns, renamed) if inlined else closed


def drop_noop_rounding(closed: ClosedJaxpr) -> ClosedJaxpr:
    """`closed` without the `reduce_precision` equations that round a float32 or float64
    value to its own precision. `jax.checkpoint` puts one on every residual it saves
    (against excess precision in narrower types, which XLA does not keep for these), and
    XLA:CPU still ran them as kernels of their own: some 5% of a ZeRO-3 GPT step."""
    eqns: list[JaxprEqn] = []
    renamed: dict[Var, Any] = {}
    for eqn in closed.jaxpr.eqns:
        if eqn.primitive.name == "reduce_precision" and _rounds_to_itself(eqn):
            renamed[eqn.outvars[0]] = _renamed(eqn.invars[0], renamed)
        else:
            eqns.append(_renamed_eqn(eqn, renamed))
    return _with_eqns_renamed(closed, eqns, renamed) if renamed else closed


def _renamed(atom: Any, renamed: dict[Var, Any]) -> Any:
    return renamed.get(atom, atom) if is_var(atom) else atom


def _renamed_eqn(eqn: JaxprEqn, renamed: dict[Var, Any]) -> JaxprEqn:
    return eqn.replace(invars=[_renamed(a, renamed) for a in eqn.invars])


def _with_eqns_renamed(
    closed: ClosedJaxpr, eqns: Sequence[JaxprEqn], renamed: dict[Var, Any]
) -> ClosedJaxpr:
    """`closed` with `eqns` and its outputs read through `renamed` (a variable -> the
    atom now holding its value)."""
    outvars = [_renamed(a, renamed) for a in closed.jaxpr.outvars]
    return ClosedJaxpr(closed.jaxpr.replace(eqns=list(eqns), outvars=outvars), list(closed.consts))


def _rounds_to_itself(eqn: JaxprEqn) -> bool:
    dtype = atom_dtype(eqn.invars[0])
    if dtype not in (jax.numpy.float32, jax.numpy.float64):
        return False
    info = jax.numpy.finfo(dtype)
    return (eqn.params["exponent_bits"], eqn.params["mantissa_bits"]) == (info.nexp, info.nmant)


def traced_with_shape(fn: Callable[..., Any], *args: Any) -> tuple[ClosedJaxpr, Any]:
    """`fn(*args)` as a jaxpr over the leaves of `args`, and the shape of its result."""

    def traced(*inner: Any) -> Any:
        return fn(*inner)

    # traced through a plain function: JAX names a traced callable that has no code
    # object (a `jax.vjp` pullback) by printing it, its whole jaxpr (0.1 s of a small
    # GPT's backward trace, growing with the model)
    return jax.make_jaxpr(traced, return_shape=True)(*args)


def run_rewritten(
    fn: Callable[..., Any], rewrite: Callable[[ClosedJaxpr], ClosedJaxpr]
) -> Callable[..., Any]:
    """`fn`, traced to a jaxpr, rewritten by `rewrite` and run (its outputs as `fn`
    returns them; an output that is an input stays that very object)."""

    def run(*args: Any) -> Any:
        closed, out_shape = traced_with_shape(fn, *args)
        outs = run_jaxpr(rewrite(closed))(*jax.tree.leaves(args))
        return jax.tree.unflatten(jax.tree.structure(out_shape), outs)

    return run


# calls whose body's inputs and outputs are the equation's own, one for one, and which
# dead-code elimination cuts output by output
TRANSPARENT_CALLS = frozenset({"jit", "pjit", "closed_call", "remat2", "custom_jvp_call"})


def outputs_free_of(
    closed: ClosedJaxpr, inputs: Sequence[bool], only: frozenset[str] | None = None
) -> list[bool]:
    """For each output of `closed`: whether it reads none of the inputs marked in
    `inputs`, looking into nested calls (a `jnp.where` is a jit call whose zeros output
    reads none of its inputs); given `only`, also whether every equation on its way is
    one of those primitives."""
    return _free_of(closed.jaxpr, inputs, only)


def _free_of(jaxpr: jex.Jaxpr, inputs: Sequence[bool], only: frozenset[str] | None) -> list[bool]:
    reached = {v for v, marked in zip(jaxpr.invars, inputs) if marked}
    for eqn in jaxpr.eqns:
        reads = [is_var(a) and a in reached for a in eqn.invars]
        bodies = called_jaxprs(eqn)
        body = bodies[0][0] if len(bodies) == 1 else None
        transparent = (
            eqn.primitive.name in TRANSPARENT_CALLS
            and body is not None
            and len(body.invars) == len(eqn.invars)
            and len(body.outvars) == len(eqn.outvars)
        )
        if transparent and (any(reads) or only is not None):
            free = _free_of(body, reads, only)
            reached.update(v for v, f in zip(eqn.outvars, free) if not f)
        elif any(reads) or (only is not None and eqn.primitive.name not in only):
            reached.update(eqn.outvars)
    return [not (is_var(v) and v in reached) for v in jaxpr.outvars]


def output_slice(closed: ClosedJaxpr, outputs: Sequence[bool]) -> tuple[ClosedJaxpr, list[bool]]:
    """`closed` cut down to the outputs marked in `outputs` (dead-code elimination, into
    nested calls), and which of its inputs the cut jaxpr still takes."""
    jaxpr, used_inputs = partial_eval.dce_jaxpr(closed.jaxpr, list(outputs))
    return ClosedJaxpr(jaxpr, list(closed.consts)), used_inputs


def is_tracer(x: Any) -> bool:
    return isinstance(x, jax.core.Tracer)


def eqn_like(
    eqn: JaxprEqn, invars: Sequence[Any], outvars: Sequence[Var], params: dict[str, Any]
) -> JaxprEqn:
    """An equation of `eqn`'s primitive (and source location) on other variables."""
    return jex.new_jaxpr_eqn(
        list(invars), list(outvars), eqn.primitive, params, eqn.effects, eqn.source_info
    )


def run_jaxpr(closed: ClosedJaxpr) -> Callable[..., list[Any]]:
    return jex.jaxpr_as_fun(closed)


def backends_are_initialized() -> bool:
    """Whether JAX has started its backends (after which device counts are fixed)."""
    return xla_bridge.backends_are_initialized()


def array_assembler(
    shape: tuple[int, ...], sharding: jax.sharding.Sharding
) -> Callable[[Sequence[jax.Array]], jax.Array]:
    """A function making the global array of `shape` over `sharding` from this process's
    single-device arrays, given in the order of the sharding's addressable devices.

    Its first call is `jax.make_array_from_single_device_arrays`, which checks the
    arrays; later calls build the array without those checks. A transfer assembles
    arrays of the same shapes on the same devices at every step, and the checked
    constructor cost more than a small transfer's whole program: 12 us against 4 us to
    build, and the next program called on the checked array took some 20 us longer
    (benchmarks/p2p.py; Note [cheap small transfers] in mpmd_runtime/transport.py)."""
    aval = None

    def assemble(arrays: Sequence[jax.Array]) -> jax.Array:
        nonlocal aval
        if aval is None:
            checked = jax.make_array_from_single_device_arrays(shape, sharding, list(arrays))
            aval = core.update_aval_with_sharding(
                core.ShapedArray(shape, checked.dtype, weak_type=False), sharding
            )
            return checked
        return ArrayImpl(aval, sharding, list(arrays), committed=True, _skip_checks=True)

    return assemble
