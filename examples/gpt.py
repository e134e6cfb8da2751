"""A small character-level GPT in Flax NNX, annotated into pipeline regions.

The model knows nothing of parallelism: it only marks which blocks form each pipeline
region with `annotate("PP", i)`. The embedding lookup, the final LayerNorm and the tied
head stay outside any annotation; the lifter assigns unannotated code to a region.
"""

from __future__ import annotations

from dataclasses import dataclass

import jax
import jax.numpy as jnp
import numpy as np
import optax
from flax import nnx

from piper_jax.annotate import annotate

_INIT = jax.nn.initializers.normal(stddev=0.02)


@dataclass(frozen=True)
class GPTConfig:
    """Model sizes; `num_stages` is how many pipeline regions the blocks are grouped into."""

    vocab_size: int = 128
    seq_len: int = 64
    d_model: int = 64
    n_heads: int = 4
    n_layers: int = 4
    num_stages: int = 2
    dropout: float = 0.0  # on each residual branch; drawn per step, microbatch and replica

    def __post_init__(self) -> None:
        if self.num_stages < 1 or self.n_layers % self.num_stages != 0:
            raise ValueError(
                f"n_layers={self.n_layers} must be divisible by num_stages={self.num_stages}; "
                f"pick num_stages from the divisors of {self.n_layers}"
            )
        if self.d_model % self.n_heads != 0:
            raise ValueError(f"d_model={self.d_model} must be divisible by n_heads={self.n_heads}")


def _linear(d_in: int, d_out: int, rngs: nnx.Rngs) -> nnx.Linear:
    return nnx.Linear(d_in, d_out, kernel_init=_INIT, rngs=rngs)


class CausalSelfAttention(nnx.Module):
    """Multi-head self-attention with a causal mask; softmax in float32 for stability."""

    def __init__(self, config: GPTConfig, *, rngs: nnx.Rngs) -> None:
        self.n_heads = config.n_heads
        self.qkv = _linear(config.d_model, 3 * config.d_model, rngs)
        self.out = _linear(config.d_model, config.d_model, rngs)

    def __call__(self, x: jax.Array) -> jax.Array:
        b, t, d = x.shape
        h = self.n_heads
        q, k, v = jnp.split(self.qkv(x), 3, axis=-1)
        q, k, v = (a.reshape(b, t, h, d // h) for a in (q, k, v))
        scores = jnp.einsum("bqhd,bkhd->bhqk", q, k).astype(jnp.float32) / jnp.sqrt(d // h)
        causal = jnp.tril(jnp.ones((t, t), dtype=bool))
        scores = jnp.where(causal, scores, jnp.finfo(jnp.float32).min)
        probs = jax.nn.softmax(scores, axis=-1).astype(v.dtype)
        y = jnp.einsum("bhqk,bkhd->bqhd", probs, v).reshape(b, t, d)
        return self.out(y)


class Block(nnx.Module):
    """Pre-LayerNorm transformer block: x + attn(ln(x)), then x + mlp(ln(x))."""

    def __init__(self, config: GPTConfig, *, rngs: nnx.Rngs) -> None:
        d = config.d_model
        self.ln1 = nnx.LayerNorm(d, rngs=rngs)
        self.attn = CausalSelfAttention(config, rngs=rngs)
        self.ln2 = nnx.LayerNorm(d, rngs=rngs)
        self.fc = _linear(d, 4 * d, rngs)
        self.proj = _linear(4 * d, d, rngs)
        self.drop = nnx.Dropout(config.dropout, rngs=rngs) if config.dropout else None

    def __call__(self, x: jax.Array) -> jax.Array:
        x = x + self._dropped(self.attn(self.ln1(x)))
        return x + self._dropped(self.proj(jax.nn.gelu(self.fc(self.ln2(x)))))

    def _dropped(self, x: jax.Array) -> jax.Array:
        return x if self.drop is None else self.drop(x)


class GPT(nnx.Module):
    """Decoder-only transformer with a tied token embedding / output head."""

    def __init__(self, config: GPTConfig, *, rngs: nnx.Rngs) -> None:
        self.config = config
        self.wte = nnx.Param(_INIT(rngs.params(), (config.vocab_size, config.d_model)))
        self.wpe = nnx.Param(_INIT(rngs.params(), (config.seq_len, config.d_model)))
        self.blocks = nnx.List([Block(config, rngs=rngs) for _ in range(config.n_layers)])
        self.ln_f = nnx.LayerNorm(config.d_model, rngs=rngs)

    def __call__(self, tokens: jax.Array) -> jax.Array:
        """Logits (B, T, vocab) for int tokens (B, T)."""
        t = tokens.shape[1]
        wte = self.wte[...]
        x = wte[tokens] + self.wpe[:t]
        per_stage = self.config.n_layers // self.config.num_stages
        for stage in range(self.config.num_stages):
            # Explicit index: the region numbering does not depend on annotation counters.
            with annotate("PP", stage):
                for block in self.blocks[stage * per_stage : (stage + 1) * per_stage]:
                    x = block(x)
        return self.ln_f(x) @ wte.T


def loss_fn(model: GPT, batch: dict) -> jax.Array:
    """Mean next-token cross-entropy; `batch` holds int32 "tokens" and "targets" (B, T)."""
    logits = model(batch["tokens"])
    return optax.softmax_cross_entropy_with_integer_labels(logits, batch["targets"]).mean()


def generate(
    model: GPT, prompt: np.ndarray, num_tokens: int, temperature: float = 0.8, seed: int = 0
) -> np.ndarray:
    """Sample `num_tokens` ids after the int ids `prompt` (1D), in eval mode (no dropout).

    One jitted loop: the context is a fixed window of seq_len ids, filled from the left;
    causal attention makes the logits at the last filled position independent of the
    unfilled rest, and once full the window slides by one id per sample.
    """
    model = nnx.merge(*nnx.split(model))  # a copy: the caller's model keeps its mode
    model.eval()
    graphdef, state = nnx.split(model)
    t = model.config.seq_len
    prompt = np.asarray(prompt, np.int32)[-t:]
    window = np.zeros(t, np.int32)
    window[: prompt.size] = prompt

    @jax.jit
    def run(state: nnx.State, window: jax.Array, key: jax.Array) -> jax.Array:
        net = nnx.merge(graphdef, state)

        def one(i: int, carry: tuple) -> tuple:
            window, filled, out = carry
            logits = net(window[None])[0, filled - 1].astype(jnp.float32)
            token = jax.random.categorical(jax.random.fold_in(key, i), logits / temperature)
            full = filled == t
            window = jnp.where(full, jnp.roll(window, -1), window)
            window = window.at[jnp.where(full, t - 1, filled)].set(token)
            return window, jnp.minimum(filled + 1, t), out.at[i].set(token)

        init = (window, jnp.int32(prompt.size), jnp.zeros(num_tokens, jnp.int32))
        return jax.lax.fori_loop(0, num_tokens, one, init)[2]

    return np.asarray(run(state, window, jax.random.key(seed)))


def factory(
    num_stages: int = 2,
    n_layers: int | None = None,
    batch_size: int = 32,
    seq_len: int = 64,
    d_model: int = 64,
    dropout: float = 0.0,
    seed: int = 0,
) -> tuple[GPT, object, optax.GradientTransformation, dict]:
    """(model, loss_fn, optimizer, example_batch) of the main job's model, for the `piper`
    command line (`--model examples/gpt.py:factory`); one region per `annotate("PP", i)`,
    `num_stages` of them (n_layers defaults to max(4, num_stages))."""
    config = GPTConfig(
        seq_len=seq_len,
        d_model=d_model,
        n_layers=n_layers or max(4, num_stages),
        num_stages=num_stages,
        dropout=dropout,
    )
    ids = np.random.default_rng(seed).integers(0, config.vocab_size, (batch_size, seq_len + 1))
    batch = {"tokens": ids[:, :-1].astype(np.int32), "targets": ids[:, 1:].astype(np.int32)}
    return GPT(config, rngs=nnx.Rngs(seed)), loss_fn, optax.adamw(3e-3, weight_decay=0.01), batch
