"""Checks of what a user hands to `compile` and to a step, made before any tracing.

Without them a wrong argument fails deep inside JAX or optax (a model class traced as a
model, `optax.adam` used uncalled, a batch of Python lists printed as a page-long
PyTreeDef) or, worse, is accepted (an empty batch, a negative step timeout). Each check
raises the PiperError subclass of its kind, naming the argument and the fix.
"""

from __future__ import annotations

import math
import os
import reprlib
from typing import Any

import jax
import numpy as np
import optax
from flax import nnx

from piper_jax import distributed
from piper_jax.ir.errors import AnnotationError, BatchError, DistributedError, PiperError

ENV_STEP_TIMEOUT = "PIPER_STEP_TIMEOUT"

_short = reprlib.Repr()
_short.maxstring = _short.maxother = 60


def check_model_args(loss_fn: Any, model: Any, optimizer: Any, example_batch: Any) -> None:
    """The arguments `lower` and `compile` share, checked before any tracing."""
    check_loss_fn(loss_fn)
    check_model(model)
    check_optimizer(optimizer)
    check_batch_leaves(example_batch, "example_batch")


def check_run_args(timeout_s: Any) -> None:
    """What only running needs: joined processes and a step timeout."""
    distributed.check_joined()
    check_step_timeout(timeout_s)


def check_loss_fn(loss_fn: Any) -> None:
    if isinstance(loss_fn, type) or not callable(loss_fn):
        raise AnnotationError(
            f"loss_fn must be a function loss_fn(model, batch) -> scalar loss, got "
            f"{_describe(loss_fn)}"
        )


def check_model(model: Any) -> None:
    if isinstance(model, type):
        raise AnnotationError(
            f"model is {_describe(model)}, not a model: pass an instance such as "
            f"{model.__name__}(...)"
        )
    if not isinstance(model, nnx.Module):
        hint = (
            "; compile takes (loss_fn, model, optimizer, example_batch, ...) in that order"
            if callable(model)
            else ""
        )
        raise AnnotationError(
            f"model must be a flax.nnx.Module instance, got {_describe(model)}{hint}"
        )


def check_optimizer(optimizer: Any) -> None:
    """An optax transformation: piper-jax keeps the optimizer state itself, per group."""
    if isinstance(optimizer, optax.GradientTransformation):
        return
    if isinstance(optimizer, nnx.Optimizer):
        fix = (
            "pass the optax transformation it wraps (e.g. optax.adam(1e-3)) instead: "
            "piper-jax keeps the optimizer state itself, on the devices of each stage"
        )
    elif isinstance(optimizer, str):
        name = optimizer if optimizer.isidentifier() and hasattr(optax, optimizer) else "adam"
        fix = f"pass an optax transformation such as optax.{name}(1e-3), not a name"
    elif callable(optimizer) and not hasattr(optimizer, "init"):
        fix = "call it with its hyperparameters, e.g. optax.adam(1e-3)"
    elif callable(getattr(optimizer, "init", None)) and callable(
        getattr(optimizer, "update", None)
    ):
        return  # an object that acts as an optax transformation
    else:
        fix = "pass one such as optax.adam(1e-3)"
    raise PiperError(
        f"optimizer must be an optax.GradientTransformation, got {_describe(optimizer)}; {fix}"
    )


def check_batch_leaves(batch: Any, what: str) -> None:
    """Every leaf an array with a non-empty leading (batch) axis."""
    leaves = jax.tree_util.tree_flatten_with_path(batch)[0]
    if not leaves:
        raise BatchError(
            f"{what} holds no arrays ({_describe(batch)}): pass a pytree (dict, tuple) of "
            "arrays whose leading axis is the batch"
        )
    for path, leaf in leaves:
        name = jax.tree_util.keystr(path) or "(the batch itself)"
        if not isinstance(leaf, np.ndarray | jax.Array):
            raise BatchError(
                f"{what} leaf {name} is {_describe(leaf)}: batch leaves must be arrays; "
                "convert them with np.asarray"
            )
        if leaf.ndim and leaf.shape[0] == 0:
            raise BatchError(
                f"{what} leaf {name} has batch size 0 (shape {list(leaf.shape)}): give at "
                "least one example per microbatch and replica"
            )


def check_step_timeout(timeout_s: Any) -> None:
    """compile(timeout_s=) or, when it is None, $PIPER_STEP_TIMEOUT: seconds > 0."""
    if timeout_s is None:
        text = os.environ.get(ENV_STEP_TIMEOUT)
        if text is None:
            return
        where = f"{ENV_STEP_TIMEOUT}={text!r}"
        try:
            timeout_s = float(text)
        except ValueError:
            raise DistributedError(
                f"{where} is not a number of seconds; set it like '300'"
            ) from None
    else:
        where = f"compile(timeout_s={timeout_s!r})"
    if (
        isinstance(timeout_s, bool)
        or not isinstance(timeout_s, int | float)
        or not math.isfinite(timeout_s)
        or timeout_s <= 0
    ):
        raise DistributedError(
            f"{where}: a step's timeout must be a finite number of seconds > 0, such as 300"
        )


def _describe(value: Any) -> str:
    """A one-line description of a wrong argument."""
    if isinstance(value, type):
        return f"the class {value.__qualname__}"
    if callable(value) and hasattr(value, "__qualname__"):
        return f"the function {value.__qualname__}"
    if value is None or isinstance(value, str | int | float | list | tuple | dict):
        return f"{_short.repr(value)} ({type(value).__name__})"
    return f"an object of type {type(value).__qualname__}"
