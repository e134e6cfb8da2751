"""The one place piper-jax touches JAX's jaxpr data structures.

Everything here is public in `jax.extend.core` on the supported versions; keeping it
in one module means a JAX release that moves them breaks one file, not the compiler.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Any

import jax
import jax.extend.core as jex
from jax._src import (
    source_info_util,  # private: user frames for error messages
    xla_bridge,  # private: has the backend started?
)

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
    """A short 'file:line' of the user code that emitted `eqn`, for error messages."""
    frame = source_info_util.user_frame(eqn.source_info.traceback)
    if frame is None:
        return "<unknown>"
    return f"{frame.file_name}:{frame.start_line}"


def is_var(atom: Any) -> bool:
    return isinstance(atom, Var)


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


def backends_are_initialized() -> bool:
    """Whether JAX has started its backends (after which device counts are fixed)."""
    return xla_bridge.backends_are_initialized()
