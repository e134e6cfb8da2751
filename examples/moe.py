"""A small mixture-of-experts transformer in Flax NNX, shaped like Qwen3-MoE, annotated
into pipeline regions with a nested expert region per block.

Each block is RMSNorm -> rotary causal self-attention (with Qwen3's per-head q/k RMSNorm)
-> residual, then RMSNorm -> MoE MLP -> residual. The MoE MLP routes each token to its
top-k experts (softmax over all experts, top-k probabilities renormalised), dispatches
tokens into per-expert capacity slots with one-hot einsums, runs stacked SwiGLU experts
and combines their outputs weighted by the gate probabilities.

Like gpt.py, the model knows nothing of parallelism: it marks blocks with
`annotate("PP", stage)` and the experts' call with a nested `annotate("EP", stage)`,
so a strategy can shard exactly the experts (see Note [the expert layout contract]).

Note [per-sequence capacity]
Every sequence has its own capacity: C slots per expert, claimed by that sequence's
tokens only. Data parallelism and microbatching split the batch by sequences; were the
slots shared by the whole batch, which tokens are dropped would depend on how the batch
is split, and no strategy could equal single-device training. With per-sequence slots,
and every loss term a mean over sequences of per-sequence values, any split into equal
parts gives the same loss and gradients.

Note [the expert layout contract]
The dispatched tokens have shape (B, E, C, d): dim 0 is the batch, dim 1 the experts.
`Experts` maps them to (B, E, C, d) strictly per (batch row, expert, slot), and every
expert parameter has the expert dimension first. So the EP region can be split along
dim 1 of its input and dim 0 of its parameters (each device holding some experts, an
all-to-all in front and behind) while data parallelism splits dim 0, with no other
change to the math.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import jax
import jax.numpy as jnp
import numpy as np
import optax
from data import VOCAB_SIZE
from flax import nnx
from gpt import _INIT

from piper_jax.annotate import annotate


@dataclass(frozen=True)
class MoEConfig:
    """Model sizes and routing; `num_stages` is how many pipeline regions the blocks are
    grouped into."""

    vocab_size: int = VOCAB_SIZE
    d_model: int = 32
    n_heads: int = 2
    n_layers: int = 2
    num_stages: int = 2
    experts: int = 4
    top_k: int = 2
    d_expert: int = 64  # hidden width of each SwiGLU expert
    capacity_factor: float = 1.25  # slots per expert = factor x its fair share of a sequence
    aux_loss_weight: float = 0.01
    rope_theta: float = 10_000.0
    norm_eps: float = 1e-6

    def __post_init__(self) -> None:
        if self.num_stages < 1 or self.n_layers % self.num_stages != 0:
            raise ValueError(
                f"n_layers={self.n_layers} must be divisible by num_stages={self.num_stages}; "
                f"pick num_stages from the divisors of {self.n_layers}"
            )
        if self.d_model % self.n_heads != 0 or (self.d_model // self.n_heads) % 2 != 0:
            raise ValueError(
                f"d_model={self.d_model} must be n_heads={self.n_heads} times an even head size"
            )
        if not 1 <= self.top_k <= self.experts:
            raise ValueError(f"top_k={self.top_k} must lie in [1, experts={self.experts}]")
        if self.capacity_factor <= 0:
            raise ValueError(f"capacity_factor={self.capacity_factor} must be positive")


def expert_capacity(config: MoEConfig, seq_len: int) -> int:
    """Slots per expert and sequence: ceil(capacity_factor * seq_len * top_k / experts),
    at most seq_len (a token picks an expert once, so more slots would stay empty)."""
    fair_share = config.capacity_factor * seq_len * config.top_k / config.experts
    return min(math.ceil(fair_share), seq_len)


def _linear(d_in: int, d_out: int, rngs: nnx.Rngs) -> nnx.Linear:
    return nnx.Linear(d_in, d_out, use_bias=False, kernel_init=_INIT, rngs=rngs)


def _rotate(x: jax.Array, theta: float) -> jax.Array:
    """Rotary position embedding of (B, T, heads, head_dim), halves rotated as pairs."""
    t, half = x.shape[1], x.shape[-1] // 2
    freqs = theta ** (-jnp.arange(half, dtype=jnp.float32) / half)
    angles = jnp.arange(t, dtype=jnp.float32)[:, None] * freqs
    cos, sin = (a[None, :, None, :].astype(x.dtype) for a in (jnp.cos(angles), jnp.sin(angles)))
    x1, x2 = x[..., :half], x[..., half:]
    return jnp.concatenate([x1 * cos - x2 * sin, x2 * cos + x1 * sin], axis=-1)


class RotaryAttention(nnx.Module):
    """Causal multi-head self-attention with rotary positions and per-head q/k RMSNorm."""

    def __init__(self, config: MoEConfig, *, rngs: nnx.Rngs) -> None:
        d, self.n_heads, self.theta = config.d_model, config.n_heads, config.rope_theta
        head_dim = d // config.n_heads
        self.q, self.k, self.v, self.out = (_linear(d, d, rngs) for _ in range(4))
        self.q_norm = nnx.RMSNorm(head_dim, epsilon=config.norm_eps, rngs=rngs)
        self.k_norm = nnx.RMSNorm(head_dim, epsilon=config.norm_eps, rngs=rngs)

    def __call__(self, x: jax.Array) -> jax.Array:
        b, t, d = x.shape
        heads = (b, t, self.n_heads, d // self.n_heads)
        q = _rotate(self.q_norm(self.q(x).reshape(heads)), self.theta)
        k = _rotate(self.k_norm(self.k(x).reshape(heads)), self.theta)
        y = jax.nn.dot_product_attention(q, k, self.v(x).reshape(heads), is_causal=True)
        return self.out(y.reshape(b, t, d))


class Experts(nnx.Module):
    """`experts` SwiGLU MLPs as stacked weights, the expert dimension first in each.

    Maps dispatched tokens (B, E, C, d) -> (B, E, C, d), each (batch row, expert, slot)
    on its own: the layout contract of Note [the expert layout contract].
    """

    def __init__(self, config: MoEConfig, *, rngs: nnx.Rngs) -> None:
        e, d, f = config.experts, config.d_model, config.d_expert
        self.w_gate = nnx.Param(_INIT(rngs.params(), (e, d, f)))
        self.w_up = nnx.Param(_INIT(rngs.params(), (e, d, f)))
        self.w_down = nnx.Param(_INIT(rngs.params(), (e, f, d)))

    def __call__(self, x: jax.Array) -> jax.Array:
        gate = jnp.einsum("becd,edf->becf", x, self.w_gate[...])
        up = jnp.einsum("becd,edf->becf", x, self.w_up[...])
        return jnp.einsum("becf,efd->becd", jax.nn.silu(gate) * up, self.w_down[...])


class MoE(nnx.Module):
    """Top-k routed experts with per-sequence capacity (Note [per-sequence capacity])."""

    def __init__(self, config: MoEConfig, stage: int, *, rngs: nnx.Rngs) -> None:
        self.config, self.stage = config, stage
        self.router = _linear(config.d_model, config.experts, rngs)
        self.experts = Experts(config, rngs=rngs)

    def route(self, x: jax.Array) -> tuple[jax.Array, jax.Array, jax.Array]:
        """(dispatch, combine, aux) for tokens x (B, S, d).

        dispatch (B, S, E, C) is 1 where a token's choice of expert e took slot c;
        combine is dispatch times that choice's gate probability; aux (B,) is each
        sequence's load-balancing loss, E * sum_e f_e * P_e (f_e: the share of the
        sequence's top-k choices that picked e, before any drop; P_e: its mean router
        probability for e), 1 when routing is uniform.
        """
        cfg = self.config
        b, s, _ = x.shape
        probs = jax.nn.softmax(self.router(x).astype(jnp.float32), axis=-1)  # (B, S, E)
        top_probs, top_ids = jax.lax.top_k(probs, cfg.top_k)  # (B, S, k)
        gates = top_probs / top_probs.sum(axis=-1, keepdims=True)
        chosen = jax.nn.one_hot(top_ids, cfg.experts, dtype=jnp.float32)  # (B, S, k, E)
        # Slots are claimed in priority order: every token's first choice in token
        # order, then every second choice, ...; a choice's slot is how many claimed e
        # before it in its own sequence.
        by_priority = chosen.transpose(0, 2, 1, 3).reshape(b, cfg.top_k * s, cfg.experts)
        earlier = jnp.cumsum(by_priority, axis=1) - by_priority
        earlier = earlier.reshape(b, cfg.top_k, s, cfg.experts).transpose(0, 2, 1, 3)
        slot = jnp.sum(earlier * chosen, axis=-1).astype(jnp.int32)  # (B, S, k)
        # (B, S, k, C); a slot >= C has an all-zero row: that choice is dropped.
        slots = jax.nn.one_hot(slot, expert_capacity(cfg, s), dtype=jnp.float32)
        dispatch = jnp.einsum("bske,bskc->bsec", chosen, slots)
        combine = jnp.einsum("bske,bsk,bskc->bsec", chosen, gates, slots)
        share = chosen.sum(axis=(1, 2)) / (s * cfg.top_k)  # (B, E)
        aux = cfg.experts * jnp.sum(share * probs.mean(axis=1), axis=-1)
        return dispatch.astype(x.dtype), combine.astype(x.dtype), aux

    def __call__(self, x: jax.Array) -> tuple[jax.Array, jax.Array]:
        """(output (B, S, d), aux (B,)); a dropped choice adds nothing to its token."""
        dispatch, combine, aux = self.route(x)
        xd = jnp.einsum("bsec,bsd->becd", dispatch, x)  # (B, E, C, d): batch, then experts
        with annotate("EP", self.stage):
            y = self.experts(xd)
        return jnp.einsum("bsec,becd->bsd", combine, y), aux


class Block(nnx.Module):
    """Pre-RMSNorm block: x + attn(norm(x)), then x + moe(norm(x)); also returns aux."""

    def __init__(self, config: MoEConfig, stage: int, *, rngs: nnx.Rngs) -> None:
        d = config.d_model
        self.attn_norm = nnx.RMSNorm(d, epsilon=config.norm_eps, rngs=rngs)
        self.attn = RotaryAttention(config, rngs=rngs)
        self.moe_norm = nnx.RMSNorm(d, epsilon=config.norm_eps, rngs=rngs)
        self.moe = MoE(config, stage, rngs=rngs)

    def __call__(self, x: jax.Array) -> tuple[jax.Array, jax.Array]:
        x = x + self.attn(self.attn_norm(x))
        y, aux = self.moe(self.moe_norm(x))
        return x + y, aux


class MoETransformer(nnx.Module):
    """Decoder-only MoE transformer with an untied output head (as Qwen3-MoE)."""

    def __init__(self, config: MoEConfig, *, rngs: nnx.Rngs) -> None:
        self.config = config
        per_stage = config.n_layers // config.num_stages
        self.embed = nnx.Embed(config.vocab_size, config.d_model, embedding_init=_INIT, rngs=rngs)
        self.blocks = nnx.List(
            [Block(config, i // per_stage, rngs=rngs) for i in range(config.n_layers)]
        )
        self.norm = nnx.RMSNorm(config.d_model, epsilon=config.norm_eps, rngs=rngs)
        self.head = _linear(config.d_model, config.vocab_size, rngs)

    def __call__(self, tokens: jax.Array) -> tuple[jax.Array, jax.Array]:
        """(logits (B, T, vocab), aux (B,): each sequence's load-balancing loss, averaged
        over the layers) for int tokens (B, T)."""
        x = self.embed(tokens)
        aux = jnp.zeros(tokens.shape[0], jnp.float32)
        per_stage = self.config.n_layers // self.config.num_stages
        for stage in range(self.config.num_stages):
            with annotate("PP", stage):
                for block in self.blocks[stage * per_stage : (stage + 1) * per_stage]:
                    x, layer_aux = block(x)
                    aux = aux + layer_aux
        return self.head(self.norm(x)), aux / self.config.n_layers


def loss_fn(model: MoETransformer, batch: dict) -> jax.Array:
    """Mean next-token cross-entropy + aux_loss_weight * mean aux; `batch` holds int32
    "tokens" and "targets" (B, T). Both terms are means over sequences of per-sequence
    values, so equal parts of a batch average to the whole batch's loss."""
    logits, aux = model(batch["tokens"])
    ce = optax.softmax_cross_entropy_with_integer_labels(logits, batch["targets"]).mean()
    return ce + model.config.aux_loss_weight * aux.mean()


def factory(
    num_stages: int = 2,
    n_layers: int | None = None,
    experts: int = 4,
    top_k: int = 2,
    capacity_factor: float = 1.25,
    batch_size: int = 16,
    seq_len: int = 32,
    d_model: int = 32,
    seed: int = 0,
) -> tuple[MoETransformer, object, optax.GradientTransformation, dict]:
    """(model, loss_fn, optimizer, example_batch) for the `piper` command line
    (`--model examples/moe.py:factory`): `num_stages` PP regions, each with an
    {PP: s, EP: s} region per block (n_layers defaults to max(2, num_stages))."""
    config = MoEConfig(
        d_model=d_model,
        n_layers=n_layers or max(2, num_stages),
        num_stages=num_stages,
        experts=experts,
        top_k=top_k,
        capacity_factor=capacity_factor,
    )
    ids = np.random.default_rng(seed).integers(0, config.vocab_size, (batch_size, seq_len + 1))
    batch = {"tokens": ids[:, :-1].astype(np.int32), "targets": ids[:, 1:].astype(np.int32)}
    model = MoETransformer(config, rngs=nnx.Rngs(seed))
    return model, loss_fn, optax.adamw(3e-3, weight_decay=0.01), batch
