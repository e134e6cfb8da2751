"""Note [residuals hold activations only]: a forward keeps no copy of the region's
weights for its backward, so a pipeline holds activations only between F and B."""

from __future__ import annotations

import optax
from helpers import StageMLP, mlp_batches, mlp_loss

import piper_jax as piper


def test_forward_residuals_exclude_the_weights() -> None:
    width, batch = 256, 4
    step = piper.compile(
        mlp_loss, StageMLP(2, width=width), optax.sgd(0.1), mlp_batches(1, batch)[0], []
    )
    kernel = width * width * 4
    activations = batch * width * 4
    residuals = step._executor.residual_bytes((0,))
    assert residuals < kernel / 4  # a kept 256 x 256 kernel alone would be 256 KiB
    assert residuals >= activations  # the tanh output (and input) of a block are kept
