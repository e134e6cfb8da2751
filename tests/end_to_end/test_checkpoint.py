"""step.save / step.restore: a run that stops, saves and resumes (under the same or another
directive list) must match uninterrupted single-device training step for step."""

from __future__ import annotations

import os
import sys

import jax
import numpy as np
import optax
import pytest
from flax import nnx
from helpers import (
    StageMLP,
    mlp_batches,
    mlp_loss,
    reference_run,
    token_batches,
    xla_compilations,
)

import piper_jax as piper

sys.path.insert(0, os.path.join(os.path.dirname(__file__), "..", "..", "examples"))
from gpt import GPT, GPTConfig, loss_fn  # noqa: E402

PP2_DP2 = [
    piper.split({"PP": "*"}, num_microbatches=2),
    piper.place({"PP": 0}, [0, 1]),
    piper.place({"PP": 1}, [2, 3]),
    piper.replicate({"PP": 0}, [0, 1]),
    piper.replicate({"PP": 1}, [2, 3]),
    *piper.schedules.one_f_one_b(2, 2),
]
ZERO3_DP4 = [piper.replicate({"PP": "*"}, [0, 1, 2, 3], shard_grads=True, shard_params=True)]
ZERO2_DP2 = [piper.replicate({"PP": "*"}, [0, 1], shard_grads=True)]
TP2 = [
    piper.shard_tensor({"PP": "*"}, [0, 1], params={"blocks/0": "colwise", "blocks/1": "rowwise"})
]
CLIPPED_ADAMW = optax.chain(optax.clip_by_global_norm(0.05), optax.adamw(3e-2, weight_decay=0.1))


def _compile(
    directives: list, optimizer: optax.GradientTransformation, seed: int = 0
) -> piper.TrainStep:
    model = StageMLP(2, rngs=nnx.Rngs(seed))
    return piper.compile(mlp_loss, model, optimizer, mlp_batches(1)[0], directives)


@pytest.mark.parametrize(
    "before, after, optimizer",
    [
        (PP2_DP2, PP2_DP2, optax.adam(3e-2)),
        (PP2_DP2, ZERO3_DP4, optax.adam(3e-2)),
        (ZERO3_DP4, [], optax.adam(3e-2)),
        (ZERO2_DP2, PP2_DP2, CLIPPED_ADAMW),
        (PP2_DP2, TP2, optax.adam(3e-2)),
    ],
    ids=[
        "pp2xdp2-same",
        "pp2xdp2-to-zero3",
        "zero3-to-one-device",
        "zero2-clip-to-pp2xdp2",
        "pp2xdp2-to-tp2",
    ],
)
def test_resumed_run_matches_uninterrupted_reference(before, after, optimizer, tmp_path) -> None:
    """Train 2 steps under `before`, save, restore into a step of a differently initialised
    model under `after`, train 2 more: losses and final parameters match the reference, and
    the restored state lies where the update keeps it (the last step compiles nothing)."""
    batches = mlp_batches(4)
    first = _compile(before, optimizer)
    losses = [first(b)["loss"] for b in batches[:2]]
    first.save(tmp_path / "ckpt")
    second = _compile(after, optimizer, seed=7)
    second.restore(tmp_path / "ckpt")
    losses.append(second(batches[2])["loss"])
    compiled = xla_compilations()
    losses.append(second(batches[3])["loss"])
    assert xla_compilations() == compiled, "the step after the restored one compiled a program"
    ref_losses, ref_params = reference_run(mlp_loss, StageMLP(2), optimizer, batches)
    np.testing.assert_allclose(losses, ref_losses, rtol=1e-5)
    got, want = jax.tree.leaves(second.params()), jax.tree.leaves(ref_params)
    assert len(got) == len(want)
    for g, w in zip(got, want):
        np.testing.assert_allclose(np.asarray(g), np.asarray(w), rtol=1e-4, atol=1e-6)


def test_optimizer_state_survives_not_only_the_parameters(tmp_path) -> None:
    """Resuming with fresh adam moments would give other losses: the check above can fail."""
    batches = mlp_batches(4)
    first = _compile(PP2_DP2, optax.adam(3e-2))
    for b in batches[:2]:
        first(b)
    first.save(tmp_path / "ckpt")
    state = first._executor.optimizer_state()
    assert any("mu" in key and np.abs(v).max() > 0 for key, v in state.items())
    second = _compile(ZERO3_DP4, optax.adam(3e-2), seed=7)
    second.restore(tmp_path / "ckpt")
    restored = second._executor.optimizer_state()
    assert restored.keys() == state.keys()
    for key in state:
        np.testing.assert_allclose(restored[key], state[key], rtol=1e-6, err_msg=key)


def test_save_refuses_an_existing_path(tmp_path) -> None:
    step = _compile([], optax.sgd(0.1))
    (tmp_path / "taken").mkdir()
    with pytest.raises(piper.PiperError, match="already exists"):
        step.save(tmp_path / "taken")


def test_restore_refuses_another_model_naming_the_parameter(tmp_path) -> None:
    step = _compile([], optax.sgd(0.1))
    step.save(tmp_path / "ckpt")
    wider = StageMLP(2, width=24)
    other = piper.compile(mlp_loss, wider, optax.sgd(0.1), mlp_batches(1)[0], [])
    with pytest.raises(
        piper.PiperError, match=r"parameter \S+ is float32\[16\] in .* but float32\[24\]"
    ):
        other.restore(tmp_path / "ckpt")


def test_restore_refuses_another_optimizer(tmp_path) -> None:
    step = _compile([], optax.sgd(0.1))
    step.save(tmp_path / "ckpt")
    with pytest.raises(piper.PiperError, match="optimizer state leaf"):
        _compile([], optax.adam(0.1)).restore(tmp_path / "ckpt")


def test_restore_of_a_missing_directory_is_a_piper_error(tmp_path) -> None:
    with pytest.raises(piper.PiperError, match="no checkpoint directory"):
        _compile([], optax.sgd(0.1)).restore(tmp_path / "nothing")


def test_an_optimizer_with_state_across_parameters_is_refused_naming_the_leaf(tmp_path) -> None:
    """optax.flatten keeps one moment vector per update: per stage here, one for the whole
    model on one device; saving it would resume with the wrong moments."""
    directives = [
        piper.split({"PP": "*"}, num_microbatches=2),
        piper.place({"PP": 0}, [0]),
        piper.place({"PP": 1}, [1]),
        *piper.schedules.one_f_one_b(2, 2),
    ]
    step = _compile(directives, optax.flatten(optax.adam(3e-2)))
    step(mlp_batches(1)[0])
    with pytest.raises(piper.PiperError, match=r"optimizer state leaf \S*mu.* across parameters"):
        step.save(tmp_path / "ckpt")


def test_a_tied_parameter_under_clipping_saves_and_resumes(tmp_path) -> None:
    """Both stages of a GPT hold its tied embedding, and each group's clip sees the global
    norm summed in its own order (global_norm.py's carrier), so the two copies of its
    moments differ in the last bits; saving refused them as state across parameters. The
    resumed step continues as the uninterrupted one does."""
    cfg = GPTConfig(seq_len=8, d_model=16, n_heads=2, n_layers=2, num_stages=2)
    opt = optax.chain(optax.clip_by_global_norm(0.5), optax.adam(1e-2))
    batches = token_batches(4, cfg.vocab_size, cfg.seq_len, 8)
    groups = [[0, 2], [1, 3]]
    directives = [
        piper.split({"PP": "*"}, num_microbatches=2),
        *[piper.place({"PP": s}, g) for s, g in enumerate(groups)],
        *[piper.replicate({"PP": s}, g, shard_params=True) for s, g in enumerate(groups)],
        *piper.schedules.one_f_one_b(2, 2),
    ]

    def compile_gpt(seed: int) -> piper.TrainStep:
        return piper.compile(loss_fn, GPT(cfg, rngs=nnx.Rngs(seed)), opt, batches[0], directives)

    step = compile_gpt(0)
    for batch in batches[:3]:
        step(batch)
    step.save(tmp_path / "ckpt")
    resumed = compile_gpt(1)
    resumed.restore(tmp_path / "ckpt")
    np.testing.assert_allclose(resumed(batches[3])["loss"], step(batches[3])["loss"], rtol=1e-6)
