"""The main job (examples/train.py) under every strategy its flags offer, in this process
through `main(argv)`, at toy size for two steps: every schedule, ZeRO level and
recompute trains the same model to the same losses, since each equals single-device
training; a strategy file, dropout, the held-out loss, the sample and the timeline."""

from __future__ import annotations

import contextlib
import io
import os
import re
import sys

import pytest

import piper_jax as piper

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
sys.path.insert(0, os.path.join(ROOT, "examples"))

import train  # noqa: E402

TINY = "--steps 2 --batch-size 8 --seq-len 8 --d-model 16 --layers 4 --lr 1e-2".split()
QUIET = ["--eval-every", "0", "--sample-chars", "0"]


def run(*flags: str) -> str:
    """The main job's output with `flags` (at toy size); it must succeed."""
    out = io.StringIO()
    with contextlib.redirect_stdout(out):
        code = train.main(TINY + list(flags))
    assert code == 0, out.getvalue()
    return out.getvalue()


def numbers(out: str) -> list[float]:
    """The losses of the first and the last training step a run printed."""
    first, last = re.search(r"loss: first 1 steps (\S+) -> last 1 steps (\S+)", out).groups()
    return [float(first), float(last)]


@pytest.fixture(scope="module")
def one_f_one_b(tmp_path_factory: pytest.TempPathFactory) -> list[float]:
    """The default strategy (PP=2 x DP=2, 1F1B), written out as reference JSON and run
    with --strategy, once; the model gets one region per PP index the file names."""
    args = train.parse_args(TINY)
    directives, regions, devices = train.built_strategy(args)
    path = tmp_path_factory.mktemp("strategy") / "pp2_dp2_1f1b.json"
    piper.dump_directives(directives, path)
    assert train.file_strategy(str(path))[1:] == (regions, devices) == (2, 4)
    out = run("--strategy", str(path), *QUIET)
    assert f"compiled 2 regions onto 4 devices (strategy {path})" in out
    return numbers(out)


@pytest.mark.parametrize(
    "flags, layout",
    [
        (
            ["--schedule", "gpipe", "--zero", "2", "--recompute", "dots"],
            "params replicated, grads flat(dp)",
        ),
        (["--schedule", "interleaved", "--recompute"], "params replicated, grads partial(dp)"),
        (["--schedule", "zb-h1", "--zero", "3"], "params flat(dp), grads flat(dp)"),
        (["--schedule", "dualpipev", "--zero", "1"], "params replicated, grads flat(dp)"),
    ],
    ids=["gpipe-zero2-recompute-dots", "interleaved-recompute", "zb-h1-zero3", "dualpipev-zero1"],
)
def test_every_schedule_trains_like_1f1b(
    one_f_one_b: list[float], flags: list[str], layout: str
) -> None:
    """The same model (4 blocks, cut into 2 or 4 regions) under another schedule, ZeRO
    level or recompute prints the same losses as under 1F1B from a strategy file: all
    equal one-device training."""
    out = run(*flags, "--explain", *QUIET)
    assert f"{flags[1]}, m=4" in out
    if "--recompute" in flags:
        keeps = "its inputs and matmul outputs" if "dots" in flags else "its inputs"
        assert f"recomputed: F keeps {keeps} for B" in out
    assert f"on d0,2[dp=2]; {layout}" in out
    assert numbers(out) == pytest.approx(one_f_one_b, abs=2e-3), flags


def test_moe_with_experts_split_over_each_stage() -> None:
    """--model moe --ep 2: the mixture-of-experts model under PP=2 x DP=2 with its experts
    split over both devices of each stage (equal to one device: test_moe_experts.py)."""
    out = run("--model", "moe", "--ep", "2", "--explain", *QUIET)
    assert "EP=2" in out and "d0,2[dp=1 x ep=2]" in out and "params split over ep" in out


def test_dropout_held_out_loss_sample_and_timeline(tmp_path) -> None:
    """With dropout, a ZeRO-3 data-parallel strategy file: the held-out loss every step,
    a sample of the asked length at the end, and the measured timeline of a step."""
    path = tmp_path / "zero3.json"
    path.write_text(
        '[{"op": "split", "filter": {}, "num_microbatches": 2},'
        ' {"op": "replicate", "filter": {}, "device": [0, 1], "shard_params": true}]'
    )
    timeline = tmp_path / "step.png"
    out = run(
        "--strategy", str(path), "--dropout", "0.1", "--eval-every", "1",
        "--sample-chars", "24", "--timeline", str(timeline),
    )  # fmt: skip
    assert re.search(r"step 1: train loss \d+\.\d+, validation loss \d+\.\d+", out), out
    assert re.search(r"validation loss after 2 steps: \d+\.\d+", out), out
    sample = out.split("sample (24 characters after the held-out ")[1].split("):\n", 1)[1]
    assert len(sample.split("\nmeasured timeline")[0]) == 24
    assert timeline.stat().st_size > 0


@pytest.mark.parametrize(
    "flags, error",
    [
        (["--zero", "2", "--dp", "1"], "--zero 2 shards over data-parallel replicas"),
        (["--schedule", "zb-h1", "--recompute"], "cannot be used with zb-h1"),
        (["--schedule", "interleaved", "--microbatches", "3"], "a multiple of --pp 2"),
        (["--schedule", "dualpipev", "--microbatches", "2"], "at least 2 x --pp = 4"),
        (["--strategy", "s.json", "--pp", "2"], "drop --pp"),
        (["--ep", "2"], "--ep 2 splits the experts of --model moe"),
    ],
)
def test_flags_that_do_not_fit_are_refused(capsys, flags: list[str], error: str) -> None:
    with pytest.raises(SystemExit):
        train.parse_args(flags)
    assert error in capsys.readouterr().err


def test_processes_runs_the_same_flags_under_the_launcher(monkeypatch) -> None:
    """--processes N re-runs this script under piper-launch, devices split evenly."""
    from piper_jax import launch

    seen = []
    monkeypatch.setattr(launch, "main", lambda argv: seen.append(argv) or 0)
    assert train.main(["--processes", "2", "--steps", "3", "--pp", "2", "--dp", "2"]) == 0
    (argv,) = seen
    assert argv[:4] == ["--nprocs", "2", "--devices-per-proc", "2"]
    assert argv[4].endswith("train.py") and argv[5:] == ["--steps", "3", "--pp", "2", "--dp", "2"]


@pytest.mark.multiprocess
def test_processes_trains_across_two_processes() -> None:
    """The main job as 2 processes of 1 device each, one pipeline stage per process."""
    import subprocess

    flags = TINY + QUIET + ["--pp", "2", "--dp", "1", "--processes", "2"]
    result = subprocess.run(
        [sys.executable, os.path.join(ROOT, "examples", "train.py"), *flags],
        capture_output=True,
        text=True,
        timeout=600,
    )
    assert result.returncode == 0, result.stdout[-2000:] + result.stderr[-2000:]
    assert "[rank 0] loss: first 1 steps" in result.stdout
    assert "[rank 1] loss:" not in result.stdout  # only the first process reports
