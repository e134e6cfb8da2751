"""piper-launch and piper_jax.distributed: real processes on 127.0.0.1, each bounded in time."""

import os
import re
import subprocess
import sys
import textwrap
import time

import pytest

from piper_jax.launch import main

pytestmark = pytest.mark.multiprocess

LAUNCH = [sys.executable, "-m", "piper_jax.launch"]
PREFIX = re.compile(r"^\[rank (\d+)\] ")


def _clean_env() -> dict[str, str]:
    """The test runner's environment without anything that would steer the ranks."""
    return {
        k: v
        for k, v in os.environ.items()
        if not k.startswith(("PIPER_", "JAX_", "XLA_", "SLURM_", "OMPI_"))
    }


def _script(tmp_path, source: str, name: str = "script.py") -> str:
    path = tmp_path / name
    path.write_text(textwrap.dedent(source))
    return str(path)


def _launch(args: list[str], timeout: float) -> subprocess.CompletedProcess:
    return subprocess.run(
        [*LAUNCH, *args], capture_output=True, text=True, timeout=timeout, env=_clean_env()
    )


def _rank_lines(text: str, rank: int) -> list[str]:
    return [
        line.removeprefix(f"[rank {rank}] ")
        for line in text.splitlines()
        if line.startswith(f"[rank {rank}] ")
    ]


def _values(lines: list[str], key: str) -> list[str]:
    return [line.split(key, 1)[1].strip() for line in lines if line.startswith(key)]


COLLECTIVE = """
    import piper_jax.distributed

    piper_jax.distributed.initialize(timeout_s=60)

    import jax
    import jax.numpy as jnp
    import numpy as np
    from jax.sharding import Mesh, NamedSharding, PartitionSpec as P

    rank = jax.process_index()
    print("count", jax.process_count(), len(jax.devices()), len(jax.local_devices()))

    # A global array over all 4 devices, each process supplying its own shards.
    mesh = Mesh(np.array(jax.devices()), ("x",))
    shards = [jax.device_put(np.full((1,), rank + 1.0, np.float32), d)
              for d in jax.local_devices()]
    x = jax.make_array_from_single_device_arrays((4,), NamedSharding(mesh, P("x")), shards)
    print("sum", float(jax.jit(jnp.sum)(x)))

    # A SEND/RECV pair: ppermute on a 2-device mesh of one device of each process.
    pair = [min((d for d in jax.devices() if d.process_index == p), key=lambda d: d.id)
            for p in (0, 1)]
    mesh2 = Mesh(np.array(pair), ("p",))
    mine = jax.device_put(np.array([7.0 + rank], np.float32), pair[rank])
    y = jax.make_array_from_single_device_arrays((2,), NamedSharding(mesh2, P("p")), [mine])
    send = jax.jit(jax.shard_map(lambda v: jax.lax.ppermute(v, "p", [(0, 1)]), mesh=mesh2,
                                 in_specs=P("p"), out_specs=P("p")))
    print("received", float(send(y).addressable_shards[0].data[0]))
"""


def test_two_processes_run_collectives_across_processes(tmp_path):
    script = _script(tmp_path, COLLECTIVE)
    r = _launch(["--nprocs", "2", "--devices-per-proc", "2", "--timeout", "60", script], 90)
    assert r.returncode == 0, r.stdout + r.stderr
    for rank in (0, 1):
        lines = _rank_lines(r.stdout, rank)
        assert _values(lines, "count") == ["2 4 2"], r.stdout
        assert _values(lines, "sum") == ["6.0"], r.stdout  # 2 * 1 + 2 * 2
    assert _values(_rank_lines(r.stdout, 1), "received") == ["7.0"], r.stdout  # rank 0's value
    assert _values(_rank_lines(r.stdout, 0), "received") == ["0.0"], r.stdout  # nothing sent


def test_a_failing_rank_stops_the_others_and_sets_the_exit_code(tmp_path):
    marker = tmp_path / "rank0.pid"
    script = _script(
        tmp_path,
        f"""
        import os, sys, time
        if os.environ["PIPER_PROCESS_ID"] == "1":
            while not os.path.exists({str(marker)!r}):  # rank 0 is up
                time.sleep(0.01)
            sys.exit(3)
        open({str(marker)!r} + ".tmp", "w").write(str(os.getpid()))
        os.rename({str(marker)!r} + ".tmp", {str(marker)!r})
        time.sleep(60)
        print("rank 0 slept to the end")
        """,
    )
    start = time.monotonic()
    r = _launch(["--nprocs", "2", script], 30)
    assert r.returncode == 3, r.stdout + r.stderr
    assert time.monotonic() - start < 15
    assert "rank 1 exited with code 3; stopping ranks [0]" in r.stderr
    assert "slept to the end" not in r.stdout
    with pytest.raises(ProcessLookupError):  # rank 0 was killed (and reaped)
        os.kill(int(marker.read_text()), 0)


@pytest.mark.parametrize(
    "fail, code",
    [('raise RuntimeError("rank 1 fails on purpose")', 1), ("piper_jax.distributed.abort(5)", 5)],
    ids=["uncaught-exception", "abort"],
)
def test_a_rank_failing_during_a_collective_ends_the_run_quickly(tmp_path, fail, code):
    # Without Note [a crashed rank] rank 1 would wait in JAX's shutdown barrier while
    # rank 0 waits in the collective for it: a hang until --timeout. (With 2 devices per
    # process gloo does not notice a dead peer; with 1 it would, and rank 0 could fail
    # in the same instant as rank 1, making the exit code a race.)
    script = _script(
        tmp_path,
        f"""
        import piper_jax.distributed

        piper_jax.distributed.initialize(timeout_s=60)

        import time
        import jax, jax.numpy as jnp, numpy as np
        from jax.sharding import Mesh, NamedSharding, PartitionSpec as P

        mesh = Mesh(np.array(jax.devices()), ("x",))
        def total():
            shards = [jax.device_put(np.ones((1,), np.float32), d) for d in jax.local_devices()]
            x = jax.make_array_from_single_device_arrays((4,), NamedSharding(mesh, P("x")), shards)
            return float(jax.jit(jnp.sum)(x))
        print("first", total())
        if jax.process_index() == 1:
            time.sleep(1)  # rank 0 is in the next collective by now
            {fail}
        print("second", total())  # waits for rank 1, which never comes
        """,
    )
    start = time.monotonic()
    r = _launch(["--nprocs", "2", "--devices-per-proc", "2", "--timeout", "60", script], 90)
    assert r.returncode == code, r.stdout + r.stderr
    assert time.monotonic() - start < 30
    assert f"rank 1 exited with code {code}; stopping ranks [0]" in r.stderr
    assert _values(_rank_lines(r.stdout, 0), "first") == ["4.0"], r.stdout
    assert "second" not in r.stdout
    if code == 1:
        assert "[rank 1] RuntimeError: rank 1 fails on purpose" in r.stderr


def test_every_output_line_names_its_rank_and_script_args_pass_through(tmp_path):
    script = _script(
        tmp_path,
        """
        import os, sys
        rank = os.environ["PIPER_PROCESS_ID"]
        print("args", sys.argv[1:])
        print("out", rank, "line two")
        print("err", rank, file=sys.stderr)
        sys.stdout.write("no newline at the end")
        """,
    )
    r = _launch(["--nprocs", "2", script, "--steps", "3", "-x"], 30)
    assert r.returncode == 0, r.stdout + r.stderr
    for text, per_rank in ((r.stdout, 3), (r.stderr, 1)):
        lines = text.splitlines()
        assert lines and all(PREFIX.match(line) for line in lines), text
        assert len(lines) == 2 * per_rank
    for rank in (0, 1):
        out = _rank_lines(r.stdout, rank)
        assert out == [
            "args ['--steps', '3', '-x']",
            f"out {rank} line two",
            "no newline at the end",
        ]
        assert _rank_lines(r.stderr, rank) == [f"err {rank}"]


def test_timeout_stops_every_rank_with_exit_code_124(tmp_path):
    script = _script(tmp_path, "import time\ntime.sleep(60)\n")
    start = time.monotonic()
    r = _launch(["--nprocs", "2", "--timeout", "2", script], 30)
    assert r.returncode == 124, r.stdout + r.stderr
    assert time.monotonic() - start < 15
    assert "timed out after 2 s" in r.stderr


def test_help_and_usage_errors(capsys):
    r = _launch(["--help"], 30)
    assert r.returncode == 0
    assert "--nprocs" in r.stdout and "--devices-per-proc" in r.stdout
    assert main(["--nprocs", "0", "missing.py"]) == 2
    assert "--nprocs 0: need at least 1 process" in capsys.readouterr().err
    assert main(["--nprocs", "2", "missing.py"]) == 2
    assert "script 'missing.py' not found" in capsys.readouterr().err


def _run_script(tmp_path, source: str, env: dict[str, str]) -> subprocess.CompletedProcess:
    return subprocess.run(
        [sys.executable, _script(tmp_path, source)],
        capture_output=True,
        text=True,
        timeout=60,
        env={**_clean_env(), **env},
    )


@pytest.mark.parametrize("env", [{}, {"SLURM_JOB_ID": "7"}], ids=["plain", "salloc-shell"])
def test_initialize_without_a_launcher_or_cluster_is_a_single_process(tmp_path, env):
    r = _run_script(
        tmp_path,
        """
        import piper_jax.distributed as dist
        dist.initialize()
        dist.initialize()  # a second call is a no-op
        import jax
        print(dist.process_count(), dist.process_index(), float(jax.numpy.ones(3).sum()))
        """,
        env,
    )
    assert r.returncode == 0, r.stderr
    assert r.stdout.split() == ["1", "0", "3.0"]


LAUNCHER_ENV = {
    "PIPER_COORDINATOR": "127.0.0.1:1",
    "PIPER_NUM_PROCESSES": "1",
    "PIPER_PROCESS_ID": "0",
    "PIPER_LOCAL_DEVICES": "2",
    "PIPER_PLATFORM": "cpu",
}
# (changes to LAUNCHER_ENV, or None for only PIPER_PROCESS_ID; the PiperError it gives)
BAD_ENVIRONMENTS = [
    ({"PIPER_LOCAL_DEVICES": "two"}, "PIPER_LOCAL_DEVICES='two' is not an integer"),
    ({"PIPER_PROCESS_ID": "1"}, "PIPER_PROCESS_ID=1 is not below PIPER_NUM_PROCESSES=1"),
    ({"PIPER_COORDINATOR": "nowhere"}, "PIPER_COORDINATOR='nowhere' is not HOST:PORT"),
    ({"PIPER_PLATFORM": "tpu"}, "PIPER_PLATFORM='tpu' is not one of"),
    ({"PIPER_HEARTBEAT_TIMEOUT": "soon"}, "PIPER_HEARTBEAT_TIMEOUT='soon' is not a number"),
    (None, "sets PIPER_PROCESS_ID but not PIPER_COORDINATOR"),
]


def test_initialize_refuses_a_bad_environment(tmp_path):
    # One process tries every case in turn (a refused initialize() leaves JAX untouched),
    # and last calls it after starting JAX's backend.
    r = _run_script(
        tmp_path,
        f"""
        import os
        import piper_jax.distributed as dist
        from piper_jax.ir.errors import PiperError

        def attempt(env):
            for name in (*{tuple(LAUNCHER_ENV)!r}, "PIPER_HEARTBEAT_TIMEOUT"):
                os.environ.pop(name, None)
            os.environ.update(env)
            try:
                dist.initialize(timeout_s=5)
                print("no error")
            except PiperError as e:
                print("PiperError:", e)

        for change, _ in {BAD_ENVIRONMENTS!r}:
            attempt({{**{LAUNCHER_ENV!r}, **change}} if change else {{"PIPER_PROCESS_ID": "0"}})
        import jax
        jax.devices()
        attempt({LAUNCHER_ENV!r})
        """,
        {},
    )
    assert r.returncode == 0, r.stderr
    lines = r.stdout.splitlines()
    messages = [m for _, m in BAD_ENVIRONMENTS] + ["called after JAX started its backend"]
    assert len(lines) == len(messages), r.stdout
    for line, message in zip(lines, messages):
        assert line.startswith("PiperError:") and message in line, line


@pytest.mark.parametrize("devices_per_proc", [1, 2])
def test_a_launched_script_that_never_initializes_is_told_to(tmp_path, devices_per_proc):
    """Without initialize() each rank saw only itself: with 2 devices per process it
    trained the whole model alone and exited 0; with 1, device index 1 was out of range."""
    tests = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    script = _script(
        tmp_path,
        f"""
        import sys
        sys.path.insert(0, {tests!r})
        import optax
        import piper_jax as piper
        from helpers import StageMLP, mlp_batches, mlp_loss

        directives = [piper.place({{"PP": 0}}, [0]), piper.place({{"PP": 1}}, [1])]
        step = piper.compile(mlp_loss, StageMLP(2), optax.sgd(0.1), mlp_batches(1)[0],
                             directives if {devices_per_proc} == 1 else [])
        print("trained alone", step(mlp_batches(1)[0])["loss"])
        """,
    )
    args = ["--nprocs", "2", "--devices-per-proc", str(devices_per_proc), "--timeout", "90"]
    r = _launch([*args, script], 120)
    assert r.returncode == 1, r.stdout + r.stderr
    assert "trained alone" not in r.stdout
    assert re.search(
        r"\[rank \d\] piper_jax\.ir\.errors\.DistributedError: PIPER_NUM_PROCESSES=2: .*"
        r"call piper_jax\.distributed\.initialize\(\) at the top of the script",
        r.stderr,
    ), r.stderr[-3000:]
