"""The example GPT (tied embedding across stages, int tokens) under PP x DP, and the main job."""

from __future__ import annotations

import os
import re
import subprocess
import sys

import optax
from flax import nnx
from helpers import assert_matches_reference, token_batches

import piper_jax as piper

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
sys.path.insert(0, os.path.join(ROOT, "examples"))

from gpt import GPT, GPTConfig, loss_fn  # noqa: E402

CONFIG = GPTConfig(seq_len=16, d_model=32, n_heads=2, n_layers=2, num_stages=2)


def gpt_batches(steps: int, batch_size: int = 8) -> list[dict]:
    return token_batches(steps, CONFIG.vocab_size, CONFIG.seq_len, batch_size)


def test_gpt_pp2_dp2_1f1b_matches_single_device() -> None:
    directives = [piper.split({"PP": "*"}, num_microbatches=2)]
    for s in range(2):
        directives += [piper.place({"PP": s}, [s, s + 2]), piper.replicate({"PP": s}, [s, s + 2])]
    directives += piper.schedules.one_f_one_b(2, 2)
    # The key bias has an exactly zero gradient (softmax is shift invariant), so its
    # gradient is rounding noise that Adam's default eps would blow up to +-lr in both
    # runs; a larger eps keeps the comparison about the strategy, not that noise.
    opt = optax.adamw(1e-2, eps=1e-4, weight_decay=0.01)
    batches = gpt_batches(3)

    def make():
        return GPT(CONFIG, rngs=nnx.Rngs(0))

    step = piper.compile(loss_fn, make(), opt, batches[0], directives)
    assert_matches_reference(step, loss_fn, make, opt, batches)
    # the tied embedding lives on both stages and is all-reduced across all four devices
    assert "ALL_REDUCE grad[0,1] d0,2,1,3" in step.explain()


def test_gpt_recompute_keeping_matrix_products_matches_single_device() -> None:
    """keep="dots": F keeps its inputs and every matmul's output, B recomputes softmax,
    GELU and the norms; keep="costly" keeps the softmax's exponentials and the GELU's
    tanh as well. The same training, each keeping fewer residual bytes than the one
    before: everything, costly, dots, the inputs only."""
    opt = optax.adamw(1e-2, eps=1e-4, weight_decay=0.01)  # eps: see the test above
    batches = gpt_batches(3)

    def make():
        return GPT(CONFIG, rngs=nnx.Rngs(0))

    def compiled(*recompute) -> piper.TrainStep:
        directives = [piper.replicate({"PP": "*"}, [0, 1]), *recompute]
        return piper.compile(loss_fn, make(), opt, batches[0], directives)

    step = compiled(piper.recompute({"PP": "*"}, keep="dots"))
    assert_matches_reference(step, loss_fn, make, opt, batches)
    costly = compiled(piper.recompute({"PP": "*"}, keep="costly"))
    assert_matches_reference(costly, loss_fn, make, opt, batches)
    kept = [s.memory()[0]["activations"] for s in (compiled(), costly, step)]
    kept.append(compiled(piper.recompute({"PP": "*"})).memory()[0]["activations"])
    assert kept[0] > 2 * kept[1] and kept[1] > kept[2] > 4 * kept[3], kept


def test_compare_pjit_reports_agreeing_losses_and_a_ratio_per_strategy() -> None:
    """examples/compare_pjit.py (what benchmarks/overhead_vs_pjit.py runs), at toy size."""
    flags = "--devices 2 --d-model 16 --layers 1 --heads 2 --seq-len 8 --batch-size 4"
    result = subprocess.run(
        [sys.executable, os.path.join(ROOT, "examples", "compare_pjit.py")]
        + (flags + " --steps 2 --rounds 2 --warmup 1").split(),
        capture_output=True,
        text=True,
        timeout=600,
    )
    assert result.returncode == 0, result.stderr[-2000:]
    lines = result.stdout.splitlines()
    rows = {line.split()[0]: line.split() for line in lines if line.startswith(("DP ", "ZeRO-3"))}
    assert set(rows) == {"DP", "ZeRO-3/FSDP"}, result.stdout
    for row in rows.values():
        piper_loss, pjit_loss = float(row[4]), float(row[5])
        assert abs(piper_loss - pjit_loss) < 1e-4, result.stdout
    assert result.stdout.count("median of 2 rounds") == 2, result.stdout


def _train(*flags: str) -> tuple[float, float]:
    """Run the main job with `flags`; (mean loss of its first steps, of its last steps)."""
    script = os.path.join(ROOT, "examples", "train.py")
    result = subprocess.run(
        [sys.executable, script, "--batch-size", "16", "--eval-every", "0", "--sample-chars", "0"]
        + list(flags),
        capture_output=True,
        text=True,
        timeout=600,
    )
    assert result.returncode == 0, result.stderr[-2000:]
    line = next(x for x in result.stdout.splitlines() if x.startswith("loss: first"))
    return float(line.split()[4]), float(line.split()[-1])


def test_main_job_resumes_from_its_checkpoint_under_another_strategy(tmp_path) -> None:
    """--save under PP=2 x DP=2, --resume under PP=1 x DP=2: the resumed run starts near
    where the first one ended, far below a fresh start. (Exact resumption is checked
    against the reference in test_checkpoint.py; this checks the main job's flags.)"""
    fresh_first, trained_last = _train("--steps", "30", "--save", str(tmp_path / "ckpt"))
    resumed_first, _ = _train(
        "--steps", "5", "--pp", "1", "--dp", "2", "--resume", str(tmp_path / "ckpt")
    )
    numbers = (fresh_first, trained_last, resumed_first)
    assert trained_last < fresh_first - 0.5, numbers
    assert resumed_first < fresh_first - 0.5, numbers  # a fresh start would be near fresh_first


def test_gpu_check_script_runs_on_the_cpu_and_both_steps_agree() -> None:
    """benchmarks/gpu_step.py --cpu-smoke: the one-GPU check itself, on a tiny config."""
    script = os.path.join(ROOT, "benchmarks", "gpu_step.py")
    result = subprocess.run(
        [sys.executable, script, "--cpu-smoke"], capture_output=True, text=True, timeout=600
    )
    assert result.returncode == 0, result.stderr[-2000:]
    runs = re.findall(r"^(\S.*?)\s+first step .* loss (\S+)$", result.stdout, re.MULTILINE)
    losses = {name: float(loss) for name, loss in runs}
    variants = {
        "piper",
        "piper, passes apart",
        "piper, no non-finite guard",
        "piper, keeping dots",
    }
    assert set(losses) == {"pjit", *variants}, result.stdout
    for name in variants:
        assert abs(losses["pjit"] - losses[name]) < 1e-4, result.stdout
        assert f"ratio {name} / pjit" in result.stdout
