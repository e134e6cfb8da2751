"""Wrong arguments to compile and to a step: each is refused before any tracing with a
PiperError naming the argument and the fix, instead of a raw error from deep in JAX or
optax, or (worse) being accepted."""

from __future__ import annotations

import math

import numpy as np
import optax
import pytest
from flax import nnx
from helpers import StageMLP, mlp_batches, mlp_loss

import piper_jax as piper

OPT = optax.sgd(0.1)


def _compile(model=None, optimizer=OPT, batch=None, loss_fn=mlp_loss, **kwargs):
    model = StageMLP(2) if model is None else model
    batch = mlp_batches(1)[0] if batch is None else batch
    return piper.compile(loss_fn, model, optimizer, batch, [], **kwargs)


def test_model_class_instead_of_an_instance() -> None:
    with pytest.raises(
        piper.AnnotationError, match=r"model is the class StageMLP.*StageMLP\(\.\.\.\)"
    ):
        _compile(model=StageMLP)


def test_arguments_in_the_wrong_order() -> None:
    with pytest.raises(piper.AnnotationError, match="got the function mlp_loss; compile takes"):
        piper.compile(StageMLP(2), mlp_loss, OPT, mlp_batches(1)[0])


@pytest.mark.parametrize("loss_fn", ["mse", None, StageMLP])
def test_loss_fn_that_is_not_a_function(loss_fn) -> None:
    with pytest.raises(piper.AnnotationError, match="loss_fn must be a function loss_fn"):
        _compile(loss_fn=loss_fn)


@pytest.mark.parametrize(
    "optimizer, fix",
    [
        ("adam", r"got 'adam' \(str\); pass an optax transformation such as optax.adam\(1e-3\)"),
        (optax.adam, r"got the function adam; call it with its hyperparameters"),
        (None, r"got None \(NoneType\); pass one such as optax.adam"),
    ],
    ids=["name", "uncalled", "none"],
)
def test_optimizer_that_is_not_an_optax_transformation(optimizer, fix) -> None:
    with pytest.raises(
        piper.PiperError, match="optimizer must be an optax.GradientTransformation, " + fix
    ):
        _compile(optimizer=optimizer)


def test_nnx_optimizer_is_refused_naming_what_to_pass() -> None:
    model = StageMLP(2)
    wrapped = nnx.Optimizer(model, optax.adam(1e-3), wrt=nnx.Param)
    with pytest.raises(
        piper.PiperError,
        match="got an object of type Optimizer; pass the optax transformation it wraps",
    ):
        _compile(model=model, optimizer=wrapped)


def test_batch_of_python_lists_is_refused_in_one_line() -> None:
    lists = {k: v.tolist() for k, v in mlp_batches(1)[0].items()}
    with pytest.raises(
        piper.BatchError, match=r"leaf \['x'\]\[0\]\[0\] is -?[0-9.]+ \(float\)"
    ) as err:
        _compile(batch=lists)
    assert "batch leaves must be arrays" in str(err.value)
    assert "\n" not in str(err.value) and len(str(err.value)) < 200
    step = _compile()
    with pytest.raises(piper.BatchError, match="batch leaves must be arrays") as err:
        step(lists)
    assert "PyTreeDef" not in str(err.value)


def test_example_batch_of_size_zero() -> None:
    empty = {k: v[:0] for k, v in mlp_batches(1)[0].items()}
    with pytest.raises(piper.BatchError, match=r"example_batch leaf \['x'\] has batch size 0"):
        _compile(batch=empty)


def test_batch_without_arrays() -> None:
    with pytest.raises(piper.BatchError, match="example_batch holds no arrays"):
        _compile(batch={})


@pytest.mark.parametrize("timeout_s", [-1, 0, math.nan, math.inf, "5"])
def test_bad_step_timeout(timeout_s) -> None:
    with pytest.raises(
        piper.DistributedError, match=r"compile\(timeout_s=.*finite number of seconds > 0"
    ):
        _compile(timeout_s=timeout_s)


@pytest.mark.parametrize(
    "text, message",
    [
        ("five minutes", "PIPER_STEP_TIMEOUT='five minutes' is not a number of seconds"),
        ("-3", "PIPER_STEP_TIMEOUT='-3': a step's timeout must be a finite number"),
        ("nan", "PIPER_STEP_TIMEOUT='nan': a step's timeout must be a finite number"),
    ],
)
def test_bad_step_timeout_in_the_environment(monkeypatch, text, message) -> None:
    monkeypatch.setenv("PIPER_STEP_TIMEOUT", text)
    with pytest.raises(piper.DistributedError, match=message):
        _compile()


def test_good_timeouts_are_kept(monkeypatch) -> None:
    monkeypatch.setenv("PIPER_STEP_TIMEOUT", "12.5")
    assert _compile().timeout_s == 12.5
    assert _compile(timeout_s=3).timeout_s == 3


def test_launched_process_that_never_initialized_is_refused(monkeypatch) -> None:
    """As under `piper-launch --nprocs 2` without piper_jax.distributed.initialize()."""
    monkeypatch.setenv("PIPER_NUM_PROCESSES", "2")
    with pytest.raises(piper.DistributedError, match=r"PIPER_NUM_PROCESSES=2.*initialize\(\)"):
        _compile()
    monkeypatch.setenv("PIPER_NUM_PROCESSES", "1")
    assert np.isfinite(_compile()(mlp_batches(1)[0])["loss"])
