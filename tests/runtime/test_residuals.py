"""Note [residuals hold activations only]: a forward keeps no copy of the region's
weights for its backward, so a pipeline holds activations only between F and B."""

from __future__ import annotations

from collections.abc import Callable

import jax
import jax.numpy as jnp
import optax
import pytest
from flax import nnx
from helpers import (
    StageMLP,
    assert_matches_reference,
    mlp_batches,
    mlp_loss,
    mlp_program_texts,
)
from piper_jax.ir.residuals import ResidualSplit

import piper_jax as piper
from piper_jax import annotate


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


class MaskedAttention(nnx.Module):
    """Blocks of causal self-attention (one PP region each) whose value weight is
    normalized (weight normalization): what their VJP keeps includes a broadcast mask,
    the zeros of `jnp.where`'s other branch and the weight's norm, none of which reads
    the batch."""

    def __init__(self, num_stages: int = 2, width: int = 8):
        rngs = nnx.Rngs(0)
        self.query = nnx.List([nnx.Linear(width, width, rngs=rngs) for _ in range(num_stages)])
        self.value = nnx.List(
            [
                nnx.Param(jax.random.normal(rngs.params(), (width, width)) * 0.3)
                for _ in range(num_stages)
            ]
        )

    def __call__(self, x: jax.Array) -> jax.Array:
        seq = x.shape[1]
        for s, (query, value) in enumerate(zip(self.query, self.value)):
            with annotate("PP", s):
                scores = query(x) @ x.transpose(0, 2, 1)
                scores = jnp.where(jnp.tril(jnp.ones((seq, seq), bool)), scores, -jnp.inf)
                normalized = value[...] / jnp.linalg.norm(value[...])
                x = x + jax.nn.softmax(scores) @ (x @ normalized)
        return x


def attention_loss(model: MaskedAttention, batch: dict) -> jax.Array:
    return jnp.mean((model(batch["x"]) - batch["y"]) ** 2)


def attention_batches(steps: int, rows: int = 4, seq: int = 6, width: int = 8) -> list[dict]:
    keys = jax.random.split(jax.random.key(1), 2 * steps)
    return [
        {
            "x": jax.random.normal(keys[2 * i], (rows, seq, width)),
            "y": jax.random.normal(keys[2 * i + 1], (rows, seq, width)),
        }
        for i in range(steps)
    ]


def pipeline_splits(
    loss: Callable, make_model: Callable, batches: list[dict], schedule: str, m: int
) -> list[ResidualSplit]:
    """Train `make_model()` as 2 stages on devices 0 and 1 under `schedule` ("1f1b" or
    "zb-h1"), assert the single-device oracle, and return each stage's residual split."""
    from piper_jax import schedules

    build = schedules.one_f_one_b if schedule == "1f1b" else schedules.zero_bubble_h1
    directives = [
        piper.split({"PP": "*"}, num_microbatches=m),
        piper.place({"PP": 0}, [0]),
        piper.place({"PP": 1}, [1]),
        *build(2, m),
    ]
    optimizer = optax.adam(1e-2)
    step = piper.compile(loss, make_model(), optimizer, batches[0], directives)
    assert_matches_reference(step, loss, make_model, optimizer, batches)
    return [step._executor.rt.programs(s, (s,))._residual_structure() for s in range(2)]


@pytest.mark.parametrize("schedule", ["1f1b", "zb-h1"])
def test_the_backward_computes_what_reads_only_parameters(schedule: str) -> None:
    """Note [residuals from parameters alone]: the causal mask broadcast to the scores,
    the zeros `jnp.where` keeps and the value weight's norm leave the forward's
    outputs (no boolean array is kept), and the backward, whole or cut into BI and BW,
    computes them again: the
    pipeline trains as the single-device oracle does."""
    m, rows, seq = 2, 4, 6
    scores = (rows // m) * seq * seq
    batches = attention_batches(3, rows, seq)
    for split in pipeline_splits(attention_loss, MaskedAttention, batches, schedule, m):
        derived = [split.avals[j] for j in split.derived]
        kept = split.kept_avals
        assert not [a for a in kept if a.dtype == jnp.bool_], kept
        assert any(a.dtype == jnp.bool_ and a.size == scores for a in derived), derived
        assert any(a.dtype == jnp.float32 and a.size == scores for a in derived), derived
        assert any(a.shape == () for a in derived), derived  # the weight's norm


class PaddedAttention(MaskedAttention):
    """MaskedAttention whose scores also hide padded keys, from a (rows, seq) mask in the
    batch: what the VJP keeps includes that mask broadcast to the scores' shape."""

    def __call__(self, x: jax.Array, padding: jax.Array) -> jax.Array:
        for s, (query, value) in enumerate(zip(self.query, self.value)):
            with annotate("PP", s):
                scores = query(x) @ x.transpose(0, 2, 1)
                scores = jnp.where(padding[:, None, :], scores, -1e9)
                x = x + jax.nn.softmax(scores) @ (x @ value[...])
        return x


def padded_loss(model: PaddedAttention, batch: dict) -> jax.Array:
    return jnp.mean((model(batch["x"], batch["padding"]) - batch["y"]) ** 2)


@pytest.mark.parametrize("schedule", ["1f1b", "zb-h1"])
def test_the_backward_computes_cheap_work_on_the_batch_from_the_batch(schedule: str) -> None:
    """Note [residuals from parameters alone]: a padding mask from the batch, broadcast to
    the scores' shape, is not kept; the forward keeps the (rows, seq) mask it came from
    and the backward broadcasts it again, training as the single-device oracle does. What
    costs work on the batch alone (the first stage's softmax) stays kept."""
    m, rows, seq = 2, 4, 6
    batches = attention_batches(3, rows, seq)
    for i, b in enumerate(batches):  # sequence r has its last r % seq positions padded
        b["padding"] = jnp.arange(seq)[None, :] < seq - (jnp.arange(rows)[:, None] + i) % seq
    splits = pipeline_splits(padded_loss, PaddedAttention, batches, schedule, m)
    for g, split in enumerate(splits):
        kept = split.kept_avals
        bools = [a.shape for a in kept if a.dtype == jnp.bool_]
        assert bools == [(rows // m, seq)], kept  # the batch's mask, not its broadcast
        derived = [split.avals[j] for j in split.derived]
        assert any(a.dtype == jnp.bool_ and a.size == (rows // m) * seq * seq for a in derived)
        if g == 0:  # it reads only the batch, but its softmax's exponentials cost work: kept
            assert any(a.dtype == jnp.float32 and a.shape == (rows // m, seq, seq) for a in kept)
