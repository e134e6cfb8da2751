"""The example MoE transformer: capacity drops, the aux loss, batch-split invariance,
its nested expert regions, and training under piper equal to single-device training."""

from __future__ import annotations

import dataclasses
import os
import sys

import jax
import numpy as np
import pytest
from flax import nnx
from helpers import assert_matches_reference, token_batches

import piper_jax as piper

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
sys.path.insert(0, os.path.join(ROOT, "examples"))

from moe import MoE, MoEConfig, MoETransformer, expert_capacity, factory, loss_fn  # noqa: E402

CONFIG = MoEConfig(d_model=16, n_heads=2, n_layers=2, num_stages=2, d_expert=32)
SEQ_LEN = 8
W = ("w_gate", "w_up", "w_down")


def dense_reference(moe: MoE, x: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """(output, kept) of `moe` on x (B, S, d), token by token in numpy: each sequence's
    choices claim slots in priority order (all first choices, then all second, ...) and
    a kept choice adds gate * expert(token); kept (B, S, k) marks the choices kept."""
    cfg = moe.config
    logits = x @ np.asarray(moe.router.kernel[...])
    probs = np.exp(logits - logits.max(-1, keepdims=True))
    probs /= probs.sum(-1, keepdims=True)
    ids = np.argsort(-probs, axis=-1)[..., : cfg.top_k]
    gates = np.take_along_axis(probs, ids, -1)
    gates /= gates.sum(-1, keepdims=True)
    w_gate, w_up, w_down = (np.asarray(getattr(moe.experts, w)[...]) for w in W)
    b, s, _ = x.shape
    capacity = expert_capacity(cfg, s)
    out, kept = np.zeros_like(x), np.zeros((b, s, cfg.top_k), bool)
    for i in range(b):
        claimed = np.zeros(cfg.experts, int)
        for j in range(cfg.top_k):
            for t in range(s):
                e = ids[i, t, j]
                kept[i, t, j] = claimed[e] < capacity
                claimed[e] += 1
                if kept[i, t, j]:
                    g = x[i, t] @ w_gate[e]
                    hidden = g / (1 + np.exp(-g)) * (x[i, t] @ w_up[e])
                    out[i, t] += gates[i, t, j] * (hidden @ w_down[e])
    return out, kept


@pytest.mark.parametrize("factor", [0.01, 100.0])
def test_moe_output_equals_a_per_token_computation_dropping_over_capacity(factor: float) -> None:
    config = dataclasses.replace(CONFIG, capacity_factor=factor)
    moe = MoE(config, 0, rngs=nnx.Rngs(1))
    x = np.random.default_rng(0).normal(size=(3, SEQ_LEN, config.d_model)).astype(np.float32)
    got, aux = nnx.jit(lambda m, x: m(x))(moe, x)
    want, kept = dense_reference(moe, x)
    np.testing.assert_allclose(got, want, rtol=1e-5, atol=1e-6)
    assert aux.shape == (3,)
    if factor > 1:
        assert kept.all()
    else:  # one slot per expert and sequence: most choices are dropped
        all_dropped = ~kept.any(axis=-1)
        assert all_dropped.any() and kept.any()
        assert np.all(np.asarray(got)[all_dropped] == 0.0)


def test_aux_loss_is_positive_and_weighted_into_the_loss() -> None:
    batch = token_batches(1, CONFIG.vocab_size, SEQ_LEN, batch_size=4)[0]
    model = MoETransformer(CONFIG, rngs=nnx.Rngs(0))
    graphdef, state = nnx.split(model)

    @jax.jit
    def loss_and_aux(state: nnx.State, weight: float) -> tuple[jax.Array, jax.Array]:
        model = nnx.merge(graphdef, state)
        model.config = dataclasses.replace(CONFIG, aux_loss_weight=weight)
        return loss_fn(model, batch), model(batch["tokens"])[1].mean()

    (loss0, aux), (loss1, _) = (loss_and_aux(state, w) for w in (0.0, 0.5))
    assert np.isfinite(aux) and aux > 0.5  # 1 for uniform routing
    np.testing.assert_allclose(loss1 - loss0, 0.5 * aux, rtol=1e-4)


def test_loss_of_a_batch_is_the_mean_of_its_halves_even_when_tokens_are_dropped() -> None:
    config = dataclasses.replace(CONFIG, capacity_factor=1.0, aux_loss_weight=1.0)
    model = MoETransformer(config, rngs=nnx.Rngs(0))
    batch = token_batches(1, config.vocab_size, SEQ_LEN, batch_size=8)[0]
    dispatch = nnx.jit(lambda m, t: m.blocks[0].moe.route(m.embed(t))[0])(model, batch["tokens"])
    assert float(dispatch.sum()) < 8 * SEQ_LEN * config.top_k  # capacity drops some
    loss = nnx.jit(loss_fn)
    halves = [{k: v[i * 4 : (i + 1) * 4] for k, v in batch.items()} for i in range(2)]
    np.testing.assert_allclose(
        loss(model, batch), np.mean([loss(model, h) for h in halves]), rtol=1e-6
    )


def test_each_block_has_a_nested_expert_region_holding_exactly_its_experts() -> None:
    model, loss, optimizer, batch = factory(num_stages=2, n_layers=4, batch_size=4, seq_len=8)
    lifted = piper.lower(loss, model, optimizer, batch).lifted
    expert_regions = [str(r) for r in lifted.regions if "EP" in r.tags]
    assert expert_regions == ["{PP:0,EP:0}", "{PP:0,EP:0}", "{PP:1,EP:1}", "{PP:1,EP:1}"]
    held: dict[int, set[str]] = {0: set(), 1: set()}
    for r in lifted.regions:
        names = {lifted.param_names[p] for p in r.param_ids}
        if "EP" in r.tags:
            assert r.tags["EP"] == r.tags["PP"]
            held[r.tags["PP"]] |= names
        else:
            assert not {n for n in names if "experts" in n}, r
    for stage in range(2):
        blocks = (2 * stage, 2 * stage + 1)
        assert held[stage] == {
            f"['blocks'][{i}]['moe']['experts']['{w}']" for i in blocks for w in W
        }


def test_compiled_without_directives_trains_like_single_device() -> None:
    """One stage (an {PP:0} region, its {PP:0, EP:0} experts, {PP:0} again) keeps the
    test fast; the regions test above covers two stages."""

    def make() -> MoETransformer:
        return factory(num_stages=1, n_layers=1, d_model=16)[0]

    _, loss, optimizer, batch = factory(num_stages=1, n_layers=1, batch_size=4, seq_len=8)
    batches = [batch] + token_batches(2, CONFIG.vocab_size, 8, batch_size=4)
    step = piper.compile(loss, make(), optimizer, batch, [])
    assert_matches_reference(step, loss, make, optimizer, batches)
