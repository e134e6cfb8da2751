"""Note [residuals hold activations only]: a forward keeps no copy of the region's
weights for its backward, so a pipeline holds activations only between F and B."""

from __future__ import annotations

import optax
from helpers import StageMLP, mlp_batches, mlp_loss, mlp_program_texts

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


def test_keeping_costly_work_drops_cheap_elementwise_intermediates() -> None:
    """Note [keeping only what costs work]: after a product, a tanh-approximated GELU's
    forward keeps the product and the tanh under recompute(keep="costly"), not the
    square, cube and sums between them that `jax.vjp` keeps by default."""
    import jax
    import jax.numpy as jnp
    from flax import nnx

    from piper_jax import annotate

    class GeluMLP(nnx.Module):
        def __init__(self, width: int, hidden: int):
            rngs = nnx.Rngs(0)
            self.up = nnx.Linear(width, hidden, rngs=rngs)
            self.down = nnx.Linear(hidden, width, rngs=rngs)

        def __call__(self, x: jax.Array) -> jax.Array:
            with annotate("PP", 0):
                return self.down(jax.nn.gelu(self.up(x), approximate=True))

    def loss(model: GeluMLP, batch: dict) -> jax.Array:
        return jnp.mean((model(batch["x"]) - batch["y"]) ** 2)

    width, hidden, rows = 16, 64, 8
    batch = {"x": jnp.ones((rows, width)), "y": jnp.zeros((rows, width))}
    hidden_array = rows * hidden * 4

    def residuals(*directives: piper.Recompute) -> int:
        step = piper.compile(loss, GeluMLP(width, hidden), optax.sgd(0.1), batch, directives)
        return step._executor.residual_bytes((0,))

    assert residuals() >= 5 * hidden_array  # 6.5 hidden-sized arrays
    kept = residuals(piper.recompute({"PP": 0}, keep="costly"))
    assert 2 * hidden_array <= kept <= 3 * hidden_array  # the product and the tanh


def test_a_checkpointed_forward_rounds_no_float32_residual() -> None:
    """Note [keeping only what costs work]: `jax.checkpoint` rounds each residual it saves
    to its own precision, a no-op for float32 that XLA:CPU still ran as kernels; the
    forward program asks XLA for none of them."""
    forward = mlp_program_texts([piper.recompute({"PP": "*"}, keep="costly")], r"\bF\d")
    for label, text in forward.items():
        assert "reduce_precision" not in text, label
