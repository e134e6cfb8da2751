"""Region fingerprints: equal for regions computing the same function of inputs of the same
shapes (the middle blocks of a pipeline), different as soon as anything they compute
differs, constants included."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import optax
from helpers import StageMLP, mlp_batches, mlp_loss
from piper_jax.ir import lift

import piper_jax as piper
from piper_jax.annotate import reset_annotation_counters


def fingerprints(fn, *args) -> list[str]:
    reset_annotation_counters()
    leaves = [jnp.asarray(a) for a in args]
    lifted = lift(lambda p, b: fn(*p, *b), leaves, [], [f"p{i}" for i in range(len(args))], [])
    return [r.fingerprint for r in lifted.regions]


def test_the_middle_stages_of_a_pipeline_share_a_fingerprint() -> None:
    batch = mlp_batches(1)[0]
    lowered = piper.lower(mlp_loss, StageMLP(4), optax.sgd(0.1), batch, [])
    got = [r.fingerprint for r in lowered.lifted.regions]
    # the first and last stages also hold the tied embedding's products
    assert got[1] == got[2]
    assert len({got[0], got[1], got[3]}) == 3


def stages(second, third):
    """Four stages; the loss joins the last, so the second and third are the middle."""

    def fn(w1, w2, w3, x):
        with piper.annotate("PP", 0):
            h = jnp.tanh(x @ w1)
        with piper.annotate("PP", 1):
            h = second(h, w2)
        with piper.annotate("PP", 2):
            h = third(h, w3)
        with piper.annotate("PP", 3):
            h = jnp.tanh(h)
        return jnp.sum(h)

    return fn


W = np.ones((4, 4), np.float32)
X = np.ones((2, 4), np.float32)
KEYS = [jax.random.key(0), jax.random.key(1)]


def test_the_same_function_on_other_weights_matches() -> None:
    same = stages(lambda h, w: jnp.tanh(h @ w), lambda h, w: jnp.tanh(h @ w))
    got = fingerprints(same, W, 2 * W, 3 * W, X)
    assert got[1] == got[2]


def test_a_different_function_constant_or_shape_does_not_match() -> None:
    variants = {
        "primitive": (lambda h, w: jnp.tanh(h @ w), lambda h, w: jnp.sin(h @ w)),
        "literal": (lambda h, w: 2.0 * (h @ w), lambda h, w: 3.0 * (h @ w)),
        "constant": (
            lambda h, w: h @ w + np.arange(4, dtype=np.float32),
            lambda h, w: h @ w + np.arange(4, dtype=np.float32)[::-1].copy(),
        ),
        "random key": (  # typed keys have no numpy form: their data counts
            lambda h, w: h @ w + jax.random.normal(KEYS[0], (4,)),
            lambda h, w: h @ w + jax.random.normal(KEYS[1], (4,)),
        ),
        "axis": (lambda h, w: h @ w + h.sum(0), lambda h, w: h @ w + h.sum(1, keepdims=True)),
    }
    for name, (second, third) in variants.items():
        got = fingerprints(stages(second, third), W, W, W, X)
        assert got[1] != got[2], name
    reshaped = fingerprints(stages(lambda h, w: h @ w, lambda h, w: h @ w), W, W, W[:, :2], X)
    assert reshaped[1] != reshaped[2]
