"""A fingerprint of the computation a region runs, equal for regions that compute the same
function: the middle blocks of a transformer, each a pipeline stage of its own.

The runtime compiles a program once for all such regions on a device group (Note [twin
regions share programs] in mpmd_runtime/twins.py), so two regions may only share a
fingerprint when they are the same function of their inputs, constants included. The
fingerprint names every variable by its order of appearance and records each equation's
primitive, parameters, operand and result types; a parameter that holds a jaxpr counts
with its printed form and its constants' values, any other with its `repr`, which for a
function or other object without a printed value names its address: two regions calling
different objects never match, whatever the objects do.
"""

from __future__ import annotations

import hashlib
from collections.abc import Sequence
from typing import Any

import jax
import numpy as np
from piper_jax.ir import jax_compat as jc


def region_fingerprint(
    constvars: Sequence[Any],
    consts: Sequence[Any],
    invars: Sequence[Any],
    outvars: Sequence[Any],
    eqns: Sequence[Any],
) -> str:
    """The fingerprint of `eqns` as a function of `invars` returning `outvars`; "" (the
    twin of no region) when a value in them has no form to compare."""
    digest = hashlib.sha256()
    ids: dict[Any, int] = {}

    def atom(a: Any) -> str:
        if jc.is_var(a):
            return f"v{ids[a]}"  # a variable from outside: KeyError, nobody's twin
        return f"lit:{_value_digest(jc.literal_value(a))}"

    try:
        for v in invars:
            ids[v] = len(ids)
            digest.update(f"in {v.aval}\n".encode())
        for v, value in zip(constvars, consts):
            ids[v] = len(ids)
            digest.update(f"const {_value_digest(value)}\n".encode())
        for eqn in eqns:
            params = sorted((k, _param_text(p)) for k, p in eqn.params.items())
            operands = [atom(a) for a in eqn.invars]
            results = [str(v.aval) for v in eqn.outvars]
            digest.update(repr((eqn.primitive.name, operands, results, params)).encode())
            for v in eqn.outvars:
                ids[v] = len(ids)
        digest.update(repr([atom(v) for v in outvars]).encode())
    except Exception:  # noqa: BLE001 - sharing programs is an optimization: decline it
        return ""
    return digest.hexdigest()


def _value_digest(value: Any) -> str:
    if jax.dtypes.issubdtype(getattr(value, "dtype", None), jax.dtypes.prng_key):
        return f"key:{_value_digest(jax.random.key_data(value))}"  # no numpy form
    array = np.asarray(value)
    body = hashlib.sha256(np.ascontiguousarray(array).tobytes()).hexdigest()[:16]
    return f"{array.dtype}{list(array.shape)}:{body}"


def _param_text(value: Any) -> str:
    if isinstance(value, jc.ClosedJaxpr):
        return f"{value.jaxpr} consts {[_value_digest(c) for c in value.consts]}"
    if isinstance(value, (tuple, list)):
        return "(" + ", ".join(_param_text(v) for v in value) + ")"
    if isinstance(value, np.ndarray):
        return _value_digest(value)
    return repr(value)
