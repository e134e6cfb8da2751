"""Dropout: random keys derived per (step, microbatch, replica) (Note [random keys of a
step] in piper_jax/rng.py), equal to plain-JAX gradient accumulation that sets the keys
the same way; reproducible run to run; evaluate() runs the model in eval mode."""

from __future__ import annotations

import dataclasses
import os
import sys

import jax
import numpy as np
import optax
import pytest
from flax import nnx
from helpers import PARAM_ATOL, token_batches

import piper_jax as piper

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
sys.path.insert(0, os.path.join(ROOT, "examples"))

from gpt import GPT, GPTConfig, loss_fn  # noqa: E402

CONFIG = GPTConfig(seq_len=16, d_model=32, n_heads=2, n_layers=2, num_stages=2, dropout=0.1)
OPT = optax.adamw(1e-2, eps=1e-4)


def batches(steps: int, batch_size: int = 8) -> list[dict]:
    return token_batches(steps, CONFIG.vocab_size, CONFIG.seq_len, batch_size)


def reference(config: GPTConfig, data: list[dict], m: int, replicas: int) -> tuple[list, list]:
    """Plain value_and_grad over every (microbatch, replica) slice, each with its stream
    keys set to fold_in(fold_in(fold_in(key0, step), microbatch), replica) and counts to
    0, the gradients averaged, then one optimizer step."""
    graphdef, params, random_state, rest = nnx.split(
        GPT(config, rngs=nnx.Rngs(0)), nnx.Param, nnx.RngState, ...
    )
    flat = list(nnx.to_flat_state(random_state))

    def keys(step: int, i: int, j: int) -> list:
        out = []
        for _, v in flat:
            if isinstance(v, nnx.RngKey):
                k = jax.random.key_data(v.get_value())
                for c in (step, i, j):
                    k = jax.random.fold_in(k, c)
                out.append(k)
            else:
                out.append(np.zeros((), np.uint32))
        return out

    def loss(p, values, rows):  # the random state is made inside the trace, as nnx wants
        rngs = nnx.from_flat_state(
            [(path, v.replace(value=x)) for (path, v), x in zip(flat, values)]
        )
        return loss_fn(nnx.merge(graphdef, p, rngs, rest), rows)

    grad = jax.jit(jax.value_and_grad(loss))
    state, losses = OPT.init(params), []
    for step, batch in enumerate(data):
        size = len(batch["tokens"]) // (m * replicas)
        total_loss, total_grad = 0.0, None
        for i in range(m):
            for j in range(replicas):
                start = (i * replicas + j) * size
                rows = {k: v[start : start + size] for k, v in batch.items()}
                value, g = grad(params, keys(step, i, j), rows)
                total_loss += float(value)
                total_grad = g if total_grad is None else jax.tree.map(np.add, total_grad, g)
        g = jax.tree.map(lambda x: x / (m * replicas), total_grad)
        updates, state = OPT.update(g, state, params)
        params = optax.apply_updates(params, updates)
        losses.append(total_loss / (m * replicas))
    return losses, jax.tree.leaves(params)


def pp2_dp2() -> list:
    directives = [piper.split({"PP": "*"}, num_microbatches=2)]
    for s in range(2):
        directives += [piper.place({"PP": s}, [s, s + 2]), piper.replicate({"PP": s}, [s, s + 2])]
    return directives + piper.schedules.one_f_one_b(2, 2)


STRATEGIES = {
    "pp2_dp2_1f1b": (pp2_dp2, 2, 2),
    "zero3_dp2": (lambda: [piper.replicate({"PP": "*"}, [0, 1], shard_params=True)], 1, 2),
}


@pytest.mark.parametrize("name", sorted(STRATEGIES))
def test_dropout_matches_plain_jax_with_the_documented_keys(name: str) -> None:
    directives, m, replicas = STRATEGIES[name]
    data = batches(3)
    ref_losses, ref_params = reference(CONFIG, data, m, replicas)
    runs = []
    for _ in range(2):  # the same losses run after run
        step = piper.compile(loss_fn, GPT(CONFIG, rngs=nnx.Rngs(0)), OPT, data[0], directives())
        runs.append([step(b)["loss"] for b in data])
    assert runs[0] == runs[1]
    np.testing.assert_allclose(runs[0], ref_losses, rtol=1e-5)
    for got, want in zip(jax.tree.leaves(step.params()), ref_params):
        np.testing.assert_allclose(np.asarray(got), np.asarray(want), rtol=1e-4, atol=PARAM_ATOL)
    # the masks differ from step to step and from a model without dropout
    plain, _ = reference(dataclasses.replace(CONFIG, dropout=0.0), data, m, replicas)
    assert abs(plain[0] - runs[0][0]) > 1e-4


def test_a_resumed_run_draws_the_masks_of_the_uninterrupted_one(tmp_path) -> None:
    """The checkpoint carries the step count that random keys derive from: 2 steps, save,
    restore into a new step, 2 more equal 4 steps in one go (with the count starting again
    at 0, steps 3 and 4 would reuse the masks of steps 1 and 2). Same strategy: the keys
    also depend on the microbatch and replica a row falls in."""
    data = batches(4)

    def compile_(directives: list) -> piper.TrainStep:
        return piper.compile(loss_fn, GPT(CONFIG, rngs=nnx.Rngs(0)), OPT, data[0], directives)

    whole = compile_(pp2_dp2())
    want = [whole(b)["loss"] for b in data]
    first = compile_(pp2_dp2())
    got = [first(b)["loss"] for b in data[:2]]
    first.save(tmp_path / "ckpt")
    second = compile_(pp2_dp2())
    second.restore(tmp_path / "ckpt")
    got += [second(b)["loss"] for b in data[2:]]
    np.testing.assert_allclose(got, want, rtol=1e-5)
    for a, b in zip(jax.tree.leaves(second.params()), jax.tree.leaves(whole.params())):
        np.testing.assert_allclose(np.asarray(a), np.asarray(b), rtol=1e-4, atol=1e-6)


def test_evaluate_runs_the_model_in_eval_mode() -> None:
    data = batches(2)
    step = piper.compile(loss_fn, GPT(CONFIG, rngs=nnx.Rngs(0)), OPT, data[0], pp2_dp2())
    step(data[0])
    before = [np.asarray(x) for x in jax.tree.leaves(step.params())]
    model = step.model()
    model.eval()
    want = float(loss_fn(model, data[1]))
    assert step.evaluate(data[1])["loss"] == pytest.approx(want, rel=1e-5)
    assert step.evaluate(data[1])["loss"] == pytest.approx(want, rel=1e-5)  # no dropout
    for a, b in zip(jax.tree.leaves(step.params()), before):
        np.testing.assert_array_equal(np.asarray(a), b)  # nothing updated
