"""The core equivalence tests across real processes on 127.0.0.1 (gloo), and a dead or
stalled peer ending the survivor with a PiperError instead of a hang."""

from __future__ import annotations

import os
import socket
import subprocess
import sys
import time

import pytest

HERE = os.path.dirname(os.path.abspath(__file__))
pytestmark = pytest.mark.multiprocess


def launch(nprocs: int, devices: int, *args: str, timeout: float = 240) -> str:
    cmd = [
        sys.executable,
        "-m",
        "piper_jax.launch",
        "--nprocs",
        str(nprocs),
        "--devices-per-proc",
        str(devices),
        "--timeout",
        str(timeout - 20),
        *args,
    ]
    result = subprocess.run(cmd, capture_output=True, text=True, timeout=timeout)
    assert result.returncode == 0, result.stdout[-3000:] + result.stderr[-3000:]
    return result.stdout


@pytest.mark.parametrize(
    "nprocs,devices,strategy",
    [
        (2, 1, "pp2_1f1b"),
        (2, 1, "pp2_zbh1"),
        (2, 1, "dp2"),
        (2, 2, "pp2_dp2_1f1b"),
        (2, 1, "interleaved2"),
        (2, 1, "dualpipev2"),
        (2, 2, "pp2_2_to_1"),
        (2, 2, "pp2_1_to_2_zero3"),
        (2, 1, "tp2_spanning"),
        (2, 2, "pp2_tp2_per_process"),
        (2, 2, "pp2_ep2_per_process"),
        (2, 2, "pp3_ep_spanning"),
        (2, 2, "moe_pp2_ep2_per_process"),
    ],
)
def test_strategy_matches_single_device_on_every_process(nprocs, devices, strategy) -> None:
    out = launch(nprocs, devices, os.path.join(HERE, "train_check.py"), strategy)
    for rank in range(nprocs):
        assert f"[rank {rank}] ORACLE OK process {rank} of {nprocs}" in out


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@pytest.mark.parametrize("mode", ["kill", "stall"])
def test_dead_or_stalled_peer_fails_the_step_with_a_piper_error(mode: str) -> None:
    """Spawned without the launcher, which would stop the survivor itself."""
    port, step_timeout = _free_port(), 4
    procs = []
    for rank in range(2):
        env = dict(
            os.environ,
            PIPER_COORDINATOR=f"127.0.0.1:{port}",
            PIPER_NUM_PROCESSES="2",
            PIPER_PROCESS_ID=str(rank),
            PIPER_LOCAL_DEVICES="1",
            PIPER_PLATFORM="cpu",
            PIPER_HEARTBEAT_TIMEOUT="60",
        )
        procs.append(
            subprocess.Popen(
                [sys.executable, os.path.join(HERE, "dead_peer.py"), str(step_timeout), mode],
                env=env,
                stdout=subprocess.PIPE,
                stderr=subprocess.STDOUT,
                text=True,
            )
        )
    begin = time.monotonic()
    try:
        out, _ = procs[0].communicate(timeout=120)
        # start-up and two compiled steps take seconds; the failure comes soon after
        assert time.monotonic() - begin < step_timeout + 60
        assert "process 0 finished step 1" in out
        started = out.index("process 0 finished step 1")
        assert "PiperError: process 0: instruction '" in out[started:], out[-3000:]
        assert "waits on process 1" in out
        assert procs[0].returncode != 0
    finally:
        for p in procs:
            if p.poll() is None:
                p.kill()
            p.communicate()


@pytest.mark.parametrize("what", ["microbatches", "batch"])
def test_processes_with_different_plans_fail_at_start_up(what: str) -> None:
    """Plans, and the parameter and batch shapes they run on, must agree."""
    cmd = [
        sys.executable,
        "-m",
        "piper_jax.launch",
        "--nprocs",
        "2",
        "--timeout",
        "100",
        os.path.join(HERE, "mismatch.py"),
        what,
    ]
    result = subprocess.run(cmd, capture_output=True, text=True, timeout=120)
    out = result.stdout + result.stderr
    assert result.returncode not in (0, 124), out[-3000:]
    assert "process 1 compiled different plans than process 0" in out, out[-3000:]
    assert "went unnoticed" not in out


@pytest.mark.parametrize(
    "before,after",
    [("stage_per_process", "stages_spanning"), ("zero2_spanning", "zero3_stages_spanning")],
)
def test_checkpoint_saved_on_two_processes_resumes_under_another_placement(
    before, after, tmp_path
) -> None:
    """Stage parameters held by one process must reach the other; ZeRO shards spread over
    both processes must be read whole (and written back as shards)."""
    out = launch(2, 2, os.path.join(HERE, "checkpoint_check.py"), str(tmp_path), before, after)
    for rank in range(2):
        assert f"[rank {rank}] RESUMED OK process {rank} of 2" in out
