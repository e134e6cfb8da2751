"""`piper-launch`: run one script as N local processes joined by `jax.distributed`.

    piper-launch --nprocs 2 --devices-per-proc 2 train.py --steps 10

Every rank runs `python train.py --steps 10` with the `PIPER_*` environment that
`piper_jax.distributed.initialize()` reads; the coordinator listens on 127.0.0.1. Each
line a rank prints comes out prefixed with `[rank i] `. When a rank fails, the others
are stopped (SIGTERM, then SIGKILL after a grace period) and the launcher exits with the
first failing rank's code; `--timeout` stops all ranks and exits with 124.
"""

from __future__ import annotations

import argparse
import ctypes
import os
import queue
import signal
import socket
import subprocess
import sys
import threading
import time
from collections.abc import Callable, Iterable, Sequence
from typing import IO

from piper_jax import distributed

TIMEOUT_EXIT_CODE = 124
POLL_S = 0.05
_PR_SET_PDEATHSIG = 1  # from <linux/prctl.h>


class _UsageError(Exception):
    """The command line asks for something this machine cannot give."""


class _Stop(Exception):
    """The launcher itself was asked to stop (Ctrl-C or SIGTERM)."""

    def __init__(self, code: int):
        super().__init__(code)
        self.code = code


def main(argv: Sequence[str] | None = None) -> int:
    """Run the launcher; returns the exit code (0 when every rank succeeded).

    Args:
      argv: the command line without the program name; default `sys.argv[1:]`.

    Returns:
      0, the first non-zero exit code of a rank, 124 on `--timeout`, or 128 + signal
      number when a rank was killed by a signal or the launcher was interrupted.
    """
    parser = _parser()
    try:
        args = parser.parse_args(argv)
        _check_args(parser, args)
    except SystemExit as e:  # --help or a usage error; argparse has printed why
        return e.code if isinstance(e.code, int) else 2
    try:
        envs = _rank_envs(args, _free_port())
    except _UsageError as e:
        _say(str(e))
        return 2
    return _Group(args.script, args.script_args, envs, args.grace).run(args.timeout)


def _parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="piper-launch",
        description="Run SCRIPT as NPROCS local processes joined by jax.distributed "
        "(coordinator on 127.0.0.1). The script calls piper_jax.distributed.initialize() "
        "before any JAX computation.",
        epilog="example: piper-launch --nprocs 2 --devices-per-proc 2 train.py --steps 10",
    )
    parser.add_argument("--nprocs", type=int, required=True, help="number of processes")
    parser.add_argument(
        "--devices-per-proc", type=int, default=1, help="devices of each process (default 1)"
    )
    parser.add_argument(
        "--platform",
        choices=distributed.PLATFORMS,
        default="cpu",
        help="cpu: K virtual CPU devices per process, gloo collectives; gpu: K GPUs per "
        "process through CUDA_VISIBLE_DEVICES (default cpu)",
    )
    parser.add_argument(
        "--timeout",
        type=float,
        default=None,
        metavar="SECONDS",
        help=f"stop every rank after this long and exit with {TIMEOUT_EXIT_CODE}",
    )
    parser.add_argument(
        "--heartbeat-timeout",
        type=float,
        default=None,
        metavar="SECONDS",
        help="a rank silent this long is counted dead by jax.distributed (default "
        f"{distributed.DEFAULT_HEARTBEAT_TIMEOUT_S:g})",
    )
    parser.add_argument(
        "--grace",
        type=float,
        default=3.0,
        metavar="SECONDS",
        help="after SIGTERM, wait this long before SIGKILL (default 3)",
    )
    parser.add_argument("script", help="the Python script every rank runs")
    parser.add_argument(
        "script_args", nargs=argparse.REMAINDER, help="arguments passed on to the script"
    )
    return parser


def _check_args(parser: argparse.ArgumentParser, args: argparse.Namespace) -> None:
    if args.nprocs < 1:
        parser.error(f"--nprocs {args.nprocs}: need at least 1 process")
    if args.devices_per_proc < 1:
        parser.error(f"--devices-per-proc {args.devices_per_proc}: need at least 1 device")
    for flag in ("timeout", "heartbeat_timeout"):
        value = getattr(args, flag)
        if value is not None and value <= 0:
            parser.error(f"--{flag.replace('_', '-')} {value}: must be a positive number")
    if args.grace < 0:
        parser.error(f"--grace {args.grace}: must not be negative")
    if not os.path.isfile(args.script):
        parser.error(f"script {args.script!r} not found")


def _free_port() -> int:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _rank_envs(args: argparse.Namespace, port: int) -> list[dict[str, str]]:
    k = args.devices_per_proc
    gpus = os.environ.get("CUDA_VISIBLE_DEVICES")
    gpu_ids = gpus.split(",") if gpus else [str(i) for i in range(args.nprocs * k)]
    if args.platform == "gpu" and len(gpu_ids) < args.nprocs * k:
        raise _UsageError(
            f"{args.nprocs} processes x {k} GPUs need {args.nprocs * k} GPUs but "
            f"CUDA_VISIBLE_DEVICES={gpus!r} lists {len(gpu_ids)}; lower --nprocs or "
            "--devices-per-proc"
        )
    envs = []
    for rank in range(args.nprocs):
        env = dict(os.environ)
        env.update(
            {
                distributed.ENV_COORDINATOR: f"127.0.0.1:{port}",
                distributed.ENV_NUM_PROCESSES: str(args.nprocs),
                distributed.ENV_PROCESS_ID: str(rank),
                distributed.ENV_LOCAL_DEVICES: str(k),
                distributed.ENV_PLATFORM: args.platform,
                "PYTHONUNBUFFERED": "1",  # lines reach the launcher as they are printed
            }
        )
        if args.heartbeat_timeout is not None:
            env[distributed.ENV_HEARTBEAT_TIMEOUT] = str(args.heartbeat_timeout)
        if args.platform == "gpu":
            env["CUDA_VISIBLE_DEVICES"] = ",".join(gpu_ids[rank * k : (rank + 1) * k])
        envs.append(env)
    return envs


class _Group:
    """The ranks of one run: start them, relay their output, stop them together."""

    def __init__(self, script: str, script_args: list[str], envs: list[dict], grace: float):
        self.command = [sys.executable, script, *script_args]
        self.envs = envs
        self.grace = grace
        self.procs: list[subprocess.Popen] = []
        self.readers: list[threading.Thread] = []
        self.write_lock = threading.Lock()
        self.done: list[threading.Event] = []  # set once rank i has ended
        self.exits: queue.Queue[tuple[int, int]] = queue.Queue()
        self.stopping = False

    def run(self, timeout: float | None) -> int:
        previous = _set_stop_handler(self._on_signal)
        try:
            self._start()
            return self._watch(timeout)
        except _Stop as e:
            _say(f"interrupted; stopping all {len(self.procs)} ranks")
            return e.code
        finally:
            self.stopping = True  # a second Ctrl-C must not leave ranks running
            self._stop(range(len(self.procs)))
            for t in self.readers:
                t.join(timeout=5)
            _set_stop_handler(previous)

    def _start(self) -> None:
        preexec = _die_with_launcher()
        for env in self.envs:  # every fork before any thread (see _die_with_launcher)
            self.procs.append(
                subprocess.Popen(
                    self.command,
                    env=env,
                    stdin=subprocess.DEVNULL,
                    stdout=subprocess.PIPE,
                    stderr=subprocess.PIPE,
                    start_new_session=True,  # its own process group: we stop its children too
                    preexec_fn=preexec,
                )
            )
            self.done.append(threading.Event())
        for rank, proc in enumerate(self.procs):
            threading.Thread(target=self._wait, args=(rank,), daemon=True).start()
            for pipe, out in ((proc.stdout, sys.stdout), (proc.stderr, sys.stderr)):
                t = threading.Thread(target=self._relay, args=(rank, pipe, out), daemon=True)
                t.start()
                self.readers.append(t)

    def _wait(self, rank: int) -> None:
        code = self.procs[rank].wait()
        self.done[rank].set()
        self.exits.put((rank, code))  # in the order the ranks end

    def _watch(self, timeout: float | None) -> int:
        deadline = None if timeout is None else time.monotonic() + timeout
        ended: set[int] = set()
        while len(ended) < len(self.procs):
            try:
                rank, returncode = self.exits.get(timeout=POLL_S)
            except queue.Empty:
                if deadline is not None and time.monotonic() >= deadline:
                    running = self._running()
                    _say(f"timed out after {timeout:g} s; stopping ranks {running}")
                    self._stop(running)
                    return TIMEOUT_EXIT_CODE
                continue
            ended.add(rank)
            if returncode != 0:
                code = _exit_code(returncode)
                running = self._running()
                stopping = f"; stopping ranks {running}" if running else ""
                _say(f"rank {rank} exited with code {code}{stopping}")
                self._stop(running)
                return code
        return 0

    def _running(self) -> list[int]:
        return [r for r, done in enumerate(self.done) if not done.is_set()]

    def _stop(self, ranks: Iterable[int]) -> None:
        """SIGTERM the process groups of `ranks`, then SIGKILL what outlives the grace."""
        alive = [r for r in ranks if not self.done[r].is_set()]
        for r in alive:
            _signal_group(self.procs[r], signal.SIGTERM)
        end = time.monotonic() + self.grace
        for r in alive:
            self.done[r].wait(timeout=max(0.0, end - time.monotonic()))
        for r in alive:
            if not self.done[r].is_set():
                _signal_group(self.procs[r], signal.SIGKILL)
        for r in alive:
            self.done[r].wait()

    def _relay(self, rank: int, pipe: IO[bytes], out: IO[str]) -> None:
        prefix = f"[rank {rank}] "
        for raw in iter(pipe.readline, b""):
            line = raw.decode(errors="replace").rstrip("\r\n")
            with self.write_lock:
                out.write(prefix + line + "\n")
                out.flush()
        pipe.close()

    def _on_signal(self, signum: int, frame: object) -> None:
        if not self.stopping:
            raise _Stop(128 + signum)


def _die_with_launcher() -> Callable[[], None] | None:
    """A preexec_fn by which Linux kills a rank when the launcher dies, even by SIGKILL.

    Without it, ranks outlive a killed launcher, and ranks waiting in a collective with
    each other keep heartbeating and hang forever. preexec_fn is only safe while the
    launcher has no other thread, so `_start` forks every rank before starting any.
    """
    if not sys.platform.startswith("linux"):
        return None
    try:
        prctl = ctypes.CDLL(None, use_errno=True).prctl
    except (OSError, AttributeError):
        return None
    launcher = os.getpid()

    def preexec() -> None:
        prctl(_PR_SET_PDEATHSIG, signal.SIGKILL)
        if os.getppid() != launcher:  # the launcher died before prctl took effect
            os._exit(1)

    return preexec


def _signal_group(proc: subprocess.Popen, sig: signal.Signals) -> None:
    try:
        os.killpg(proc.pid, sig)
    except ProcessLookupError:
        pass  # it has just exited


def _set_stop_handler(handler: Callable | dict | None) -> dict | None:
    """Install `handler` for SIGINT and SIGTERM; returns the previous ones.

    Off the main thread (where Python allows no handlers) it does nothing.
    """
    if threading.current_thread() is not threading.main_thread():
        return None
    if not isinstance(handler, dict):
        handler = {signal.SIGINT: handler, signal.SIGTERM: handler}
    return {sig: signal.signal(sig, h) for sig, h in handler.items() if h is not None}


def _exit_code(returncode: int) -> int:
    return 128 - returncode if returncode < 0 else returncode  # killed by signal n: 128 + n


def _say(message: str) -> None:
    print(f"piper-launch: {message}", file=sys.stderr, flush=True)


if __name__ == "__main__":
    sys.exit(main())
