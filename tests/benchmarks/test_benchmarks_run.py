"""Every benchmark still runs (at toy size, numbers unchecked): they call the runtime's
internals and the baselines directly, so an API change breaks them without breaking any
other test. Each runs as a subprocess, as a user would run it, with a timeout."""

from __future__ import annotations

import os
import subprocess
import sys

import pytest

BENCHMARKS = os.path.join(os.path.dirname(os.path.dirname(os.path.dirname(__file__))), "benchmarks")

RUNS = {
    "p2p": ["--launch", "--sizes", "4KiB", "--reps-scale", "0.05"],
    "pipeline_efficiency": [
        "--width", "32", "--batch", "16", "-m", "2", "--rounds", "1", "--steps", "1",
        "--warmup", "1",
    ],
    "sim_vs_real": [
        "--width", "32", "--batch-size", "16", "--m", "4", "--steps", "1", "--trace", "1",
    ],
    "plans_at_scale": ["--sizes", "small"],
    "residual_bytes": ["--seq-lens", "16", "--d-model", "16", "--batch-size", "4", "-m", "2"],
    "moe_schedules": [
        "--schedules", "dualpipev", "--steps", "1", "--batch-size", "16", "--seq-len", "8",
        "--d-model", "16",
    ],
}  # fmt: skip
# a line each run must print: the part of its output that a bug would leave out
EXPECTED = {
    "sim_vs_real": "transfers once every rank was in them",
    "pipeline_efficiency": "of the ideal per round (over that round's jit1): 1f1b",
    "residual_bytes": "kept/vjp",
}


@pytest.mark.parametrize("name", sorted(RUNS))
def test_benchmark_runs(name: str) -> None:
    result = subprocess.run(
        [sys.executable, os.path.join(BENCHMARKS, f"{name}.py"), *RUNS[name]],
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert result.returncode == 0, result.stdout[-3000:] + result.stderr[-3000:]
    assert EXPECTED.get(name, "") in result.stdout, result.stdout[-3000:]
