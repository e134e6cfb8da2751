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


def test_a_step_keeps_no_freed_activation_alive() -> None:
    """After a step only the store's arrays (state, the staged batch), the losses and the
    transfers' results (held to find a failed transfer) stay alive: the executor's
    record of what it dispatched (to wait for it) held every output, so a 1F1B step kept
    all its microbatches' activations and residuals alive after their FREEs, as GPipe
    would (7.5 MB here, with 1.1 MB of state)."""
    import gc

    import jax

    from piper_jax import schedules

    m, rows, width = 8, 64, 256
    batch = mlp_batches(1, rows * m)[0]
    model = StageMLP(2, width=width)
    directives = [
        piper.split({"PP": "*"}, num_microbatches=m),
        piper.place({"PP": 0}, [0]),
        piper.place({"PP": 1}, [1]),
        *schedules.one_f_one_b(2, m),
    ]
    before = {id(x) for x in jax.live_arrays()}
    step = piper.compile(mlp_loss, model, optax.sgd(0.1), batch, directives)
    step(batch)
    step(batch)
    gc.collect()  # arrays of earlier tests in this process that only garbage holds
    stores = step._executor.rt.stores.values()
    stored = {id(x) for store in stores for v in store.values() for x in jax.tree.leaves(v)}
    extra = [x for x in jax.live_arrays() if id(x) not in before and id(x) not in stored]
    one_activation = rows * width * 4
    transfers = 2 * m * one_activation  # per microbatch an activation forward, a gradient back
    held = sum(x.nbytes for x in extra)
    assert held < transfers + one_activation, sorted(x.shape for x in extra)
