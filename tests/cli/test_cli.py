"""The `piper` command line, run in this process through `cli.main(argv)`."""

from __future__ import annotations

import os

import pytest

import piper_jax as piper
from piper_jax import cli

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
GPT = os.path.join(ROOT, "examples", "gpt.py") + ":factory"
TINY = [f"--model-arg={a}" for a in ("d_model=16", "seq_len=8", "batch_size=8")]


@pytest.fixture
def pp2_1f1b(tmp_path) -> str:
    """PP=2 1F1B with 4 microbatches on devices 0 and 1, as a strategy file."""
    directives = [piper.split({"PP": "*"}, num_microbatches=4)]
    directives += [piper.place({"PP": s}, [s]) for s in range(2)]
    path = tmp_path / "pp2.json"
    piper.dump_directives(directives + piper.schedules.one_f_one_b(2, 4), path)
    return str(path)


def piper_cli(capsys, *argv: str) -> tuple[int, str, str]:
    code = cli.main(list(argv))
    out, err = capsys.readouterr()
    return code, out, err


def test_explain_prints_regions_placement_and_plans(capsys, pp2_1f1b: str) -> None:
    code, out, _ = piper_cli(capsys, "explain", pp2_1f1b, "--model", GPT, *TINY)
    assert code == 0
    assert "region 0 {PP:0}" in out and "on d0[dp=1]" in out and "on d1[dp=1]" in out
    assert "plan d0: F0.0; FREE batch.0; SEND F0.0 -> d1; FREE F0.0; F0.1" in out


def test_simulate_prints_step_bubble_memory_and_draws(capsys, pp2_1f1b, tmp_path) -> None:
    png = tmp_path / "timeline.png"
    code, out, _ = piper_cli(capsys, "simulate", pp2_1f1b, "--model", GPT, *TINY, "--out", str(png))
    assert code == 0
    assert "step time 15 (units: F=1, B=2)" in out  # (m + p - 1)(F + B)
    assert "bubble 20.0%" in out
    rows = [line.split() for line in out.splitlines() if line.strip()[:1] in ("0", "1")]
    assert [r[0] for r in rows] == ["0", "1"] and all(float(r[-1]) > 0 for r in rows)
    assert png.read_bytes()[:4] == b"\x89PNG"


def test_simulate_on_measured_costs(capsys, pp2_1f1b: str, tmp_path) -> None:
    trace = tmp_path / "timeline.json"
    argv = ["simulate", pp2_1f1b, "--model", GPT, *TINY, "--costs", "measured"]
    code, out, _ = piper_cli(capsys, *argv, "--out", str(trace))
    assert code == 0
    assert out.startswith("step time ") and " ms\n" in out
    assert '"name": "F0.0"' in trace.read_text()


def test_search_prints_a_ranking_and_writes_its_pick(capsys, tmp_path) -> None:
    best, png = tmp_path / "best.json", tmp_path / "best.png"
    code, out, _ = piper_cli(
        capsys, "search", "--model", GPT, *TINY, "--model-arg", "num_stages=2",
        "--devices", "2", "--costs", "unit", "--microbatches", "2", "--zero", "0",
        "--no-recompute", "--out", str(best), "--timeline", str(png),
    )  # fmt: skip
    assert code == 0, out
    lines = out.splitlines()
    assert lines[0].split() == ["#", "step", "units", "bubble", "peak", "MiB", "strategy"]
    assert "PP2 [0|1] x DP1, gpipe, m=2" in out and "PP1 [0,1] x DP2, m=2" in out
    assert "candidates ranked, 0 dropped" in out
    assert png.stat().st_size > 0
    code, out, _ = piper_cli(capsys, "explain", str(best), "--model", GPT, *TINY, "--model-arg",
                             "num_stages=2")  # fmt: skip
    assert code == 0 and "plan grid" in out


def test_launch_is_piper_launch(capsys) -> None:
    code, out, _ = piper_cli(capsys, "launch", "--help")
    assert code == 0 and out.startswith("usage: piper-launch")


@pytest.mark.parametrize(
    "argv, code, error",
    [
        (["explain", "{strategy}", "--model", "examples/gpt.py"], 2, "write MODULE:FACTORY"),
        (["explain", "{strategy}", "--model", GPT + "x"], 2, "has no function 'factoryx'"),
        (["explain", "{strategy}", "--model", "nowhere.py:f"], 2, "no file nowhere.py"),
        (["explain", "{strategy}", "--model", "no_such_module:f"], 2, "cannot import"),
        (["explain", "{strategy}", "--model", GPT, "--model-arg", "4"], 2, "write KEY=VALUE"),
        (["explain", "missing.json", "--model", GPT], 1, "cannot read strategy file"),
        (["simulate", "{strategy}", "--model", GPT, "--devices", "1"], 1, "out of range"),
    ],
)
def test_bad_command_lines_say_what_to_write(capsys, pp2_1f1b, argv, code, error) -> None:
    argv = [a.replace("{strategy}", pp2_1f1b) for a in argv]
    got, _, err = piper_cli(capsys, *argv)
    assert got == code and error in err, err


def test_the_console_script_is_installed_by_pyproject() -> None:
    with open(os.path.join(ROOT, "pyproject.toml")) as f:
        text = f.read()
    assert 'piper = "piper_jax.cli:main"' in text
    assert 'piper-launch = "piper_jax.launch:main"' in text
