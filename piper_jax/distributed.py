"""Joining the processes of one run: `initialize()` before any JAX computation.

A script meant for many processes calls `piper_jax.distributed.initialize()` first. It
reads the environment `piper-launch` sets (`PIPER_*` below); without it, it lets
`jax.distributed.initialize` detect a cluster (SLURM, Open MPI, ...), and on a plain
single machine it does nothing, so the same script also runs as one process.

# Note [a dead peer]
When a process dies, a survivor in a gloo collective with it either fails at once with
a ValueError ("Gloo ... failed: Connection closed by peer"; seen when each process has
one device in the collective, as in a SEND/RECV pair) or waits (seen with two devices
per process in the collective). What ends the wait is the coordination service of
`jax.distributed`: it counts a process dead when its heartbeats stop for
`heartbeat_timeout_s`, then aborts every survivor (SIGABRT, with a log line naming the
dead task). Inside a training step the step watchdog (mpmd_runtime/watchdog.py) reports
first, as a PiperError naming the stuck instruction and the peer, after the step
timeout (default 300 s); so the heartbeat default, 330 s, is only the backstop for a
process that hangs outside a step. `piper-launch` besides stops every rank as soon as
one exits with an error. When process 0 (which hosts the service) dies, the others abort
within a second.

# Note [a crashed rank]
At exit, JAX waits in a shutdown barrier for every process (`shutdown_timeout_s`, JAX
default 300 s). A rank that dies of an exception while its peers sit in a collective
with it would wait there, still heartbeating, and its peers with it: the whole run
hangs until the barrier times out, then every rank aborts and the exit code is lost.
So in a multi-process run an uncaught exception prints its traceback and ends the
process at once with exit code 1, skipping the barrier; the peers are then stopped by
the launcher or by Note [a dead peer]. `sys.exit(n)` with n != 0 after `initialize()`
still goes through the barrier (Python gives exit hooks no exit code); use `abort(n)`.
"""

from __future__ import annotations

import math
import os
import sys

import jax

from piper_jax.ir import jax_compat
from piper_jax.ir.errors import DistributedError

ENV_COORDINATOR = "PIPER_COORDINATOR"
ENV_NUM_PROCESSES = "PIPER_NUM_PROCESSES"
ENV_PROCESS_ID = "PIPER_PROCESS_ID"
ENV_LOCAL_DEVICES = "PIPER_LOCAL_DEVICES"
ENV_PLATFORM = "PIPER_PLATFORM"
ENV_HEARTBEAT_TIMEOUT = "PIPER_HEARTBEAT_TIMEOUT"
LAUNCHER_ENV = (ENV_COORDINATOR, ENV_NUM_PROCESSES, ENV_PROCESS_ID, ENV_LOCAL_DEVICES)
PLATFORMS = ("cpu", "gpu")

DEFAULT_TIMEOUT_S = 300.0
DEFAULT_HEARTBEAT_TIMEOUT_S = 330.0
DEFAULT_SHUTDOWN_TIMEOUT_S = 300.0

# JAX takes a process for a SLURM task when all of these are set (as in an srun step).
_SLURM_ENV = (
    "SLURM_JOB_ID",
    "SLURM_STEP_NODELIST",
    "SLURM_NTASKS",
    "SLURM_PROCID",
    "SLURM_LOCALID",
)

_initialized = False


def initialize(
    timeout_s: float | None = None,
    *,
    heartbeat_timeout_s: float | None = None,
    shutdown_timeout_s: float | None = None,
) -> None:
    """Join this process to the others of the run; call it before any JAX computation.

    Calling it again is a no-op.

    Args:
      timeout_s: how long to wait for all processes to connect (default 300 s).
      heartbeat_timeout_s: a process whose heartbeats stop for this long is counted dead
        and every other process is aborted (default: `PIPER_HEARTBEAT_TIMEOUT` if set,
        else 330 s). See Note [a dead peer].
      shutdown_timeout_s: how long a finishing process waits at exit for the others to
        finish too (default 300 s). See Note [a crashed rank].

    Raises:
      DistributedError: the launcher environment is malformed, a cluster was detected but
        could not be joined, or JAX already started its backend.
    """
    global _initialized
    if _initialized or jax.distributed.is_initialized():
        _initialized = True
        return
    timeouts = {
        "initialization_timeout": _whole_seconds(
            "timeout_s", DEFAULT_TIMEOUT_S if timeout_s is None else timeout_s
        ),
        "heartbeat_timeout_seconds": _whole_seconds(
            "heartbeat_timeout_s", _heartbeat_s(heartbeat_timeout_s)
        ),
        "shutdown_timeout_seconds": _whole_seconds(
            "shutdown_timeout_s",
            DEFAULT_SHUTDOWN_TIMEOUT_S if shutdown_timeout_s is None else shutdown_timeout_s,
        ),
    }
    present = [name for name in LAUNCHER_ENV if name in os.environ]
    if present:
        _initialize_from_launcher(present, timeouts)
    else:
        _initialize_from_cluster(timeouts)
    _initialized = True
    if jax.distributed.is_initialized():
        _exit_at_once_on_uncaught_exception()


def check_joined() -> None:
    """Refuse to train in a process that the launcher started as one of N but that never
    joined the others: it would train the whole model alone (and exit 0), or fail on a
    device index that only exists across processes."""
    if ENV_NUM_PROCESSES not in os.environ:
        return
    expected = _env_int(ENV_NUM_PROCESSES, minimum=1)
    if expected > 1 and jax.process_count() == 1:
        raise DistributedError(
            f"{ENV_NUM_PROCESSES}={expected}: this process was started as one of {expected} "
            "(by piper-launch), but JAX sees only itself: call "
            "piper_jax.distributed.initialize() at the top of the script, before any other "
            "JAX call, so that the processes train together"
        )


def process_index() -> int:
    """This process's index among the processes of the run (0 when single-process)."""
    return jax.process_index()


def process_count() -> int:
    """How many processes the run has (1 when single-process)."""
    return jax.process_count()


def abort(code: int = 1) -> None:
    """End this process now with `code`, without waiting for the other processes.

    Use it instead of `sys.exit(code)` to fail one rank of a multi-process run; see
    Note [a crashed rank].
    """
    _flush_std_streams()
    os._exit(code)


def _initialize_from_launcher(present: list[str], timeouts: dict[str, int]) -> None:
    missing = [name for name in LAUNCHER_ENV if name not in present]
    if missing:
        raise DistributedError(
            f"the environment sets {', '.join(present)} but not {', '.join(missing)}: "
            "start the script with `piper-launch --nprocs N --devices-per-proc K script.py`, "
            "which sets all of them, or unset them to run as a single process"
        )
    coordinator = os.environ[ENV_COORDINATOR]
    host, _, port = coordinator.rpartition(":")
    if not host or not port.isdigit():
        raise DistributedError(
            f"{ENV_COORDINATOR}={coordinator!r} is not HOST:PORT; set it like '127.0.0.1:12345'"
        )
    num_processes = _env_int(ENV_NUM_PROCESSES, minimum=1)
    process_id = _env_int(ENV_PROCESS_ID, minimum=0)
    local_devices = _env_int(ENV_LOCAL_DEVICES, minimum=1)
    if process_id >= num_processes:
        raise DistributedError(
            f"{ENV_PROCESS_ID}={process_id} is not below {ENV_NUM_PROCESSES}={num_processes}: "
            f"process ids run 0..{num_processes - 1}"
        )
    platform = os.environ.get(ENV_PLATFORM, "").lower()
    if platform and platform not in PLATFORMS:
        raise DistributedError(
            f"{ENV_PLATFORM}={platform!r} is not one of {PLATFORMS}; piper-launch sets it "
            "from --platform"
        )
    if _backends_started():
        raise _backend_started_error()
    try:
        if platform == "cpu":
            jax.config.update("jax_platforms", "cpu")
        # A local run is stopped by piper-launch with SIGTERM; JAX's preemption service
        # would catch it (for checkpoint-on-preemption on clusters) and keep running.
        jax.config.update("jax_enable_preemption_service", False)
        if platform != "gpu":  # CPU devices: K per process, collectives across processes
            jax.config.update("jax_num_cpu_devices", local_devices)
            jax.config.update("jax_cpu_collectives_implementation", "gloo")
        jax.distributed.initialize(
            coordinator_address=coordinator,
            num_processes=num_processes,
            process_id=process_id,
            # Listen only where the launcher said, not on every interface.
            coordinator_bind_address=coordinator,
            **timeouts,
        )
    except RuntimeError as e:
        if _says_backend_started(e):
            raise _backend_started_error() from e
        raise DistributedError(
            f"process {process_id} of {num_processes} could not join the coordinator at "
            f"{coordinator} within {timeouts['initialization_timeout']} s ({e}); check "
            "that every rank was started, or raise timeout_s"
        ) from e


def _initialize_from_cluster(timeouts: dict[str, int]) -> None:
    try:
        jax.distributed.initialize(**timeouts)
    except RuntimeError as e:
        if not _says_backend_started(e):
            raise _cluster_error(e) from e
        if _cluster_env():  # JAX refused before looking for a cluster: guess from the env
            raise _backend_started_error() from e
    except ValueError as e:
        if "coordinator_address" not in str(e):
            raise _cluster_error(e) from e
        # No cluster detected: a single process on a plain machine, nothing to join.


def _cluster_env() -> list[str]:
    """The variables by which jax.distributed.initialize() would detect a cluster."""
    found = [
        name for name in ("JAX_COORDINATOR_ADDRESS", "OMPI_MCA_orte_hnp_uri") if name in os.environ
    ]
    if all(name in os.environ for name in _SLURM_ENV):
        found.append("SLURM_JOB_ID")
    return found


def _cluster_error(e: Exception) -> DistributedError:
    return DistributedError(
        f"a cluster was detected ({', '.join(_cluster_env()) or 'by jax.distributed'}) but "
        f"could not be joined: {e}; unset its variables to run as one process, or start "
        "the ranks with `piper-launch`"
    )


def _exit_at_once_on_uncaught_exception() -> None:
    """See Note [a crashed rank]."""
    previous = sys.excepthook

    def hook(exc_type, exc, tb):
        previous(exc_type, exc, tb)
        abort(130 if issubclass(exc_type, KeyboardInterrupt) else 1)

    sys.excepthook = hook


def _flush_std_streams() -> None:
    for stream in (sys.stdout, sys.stderr):
        try:
            stream.flush()
        except (OSError, ValueError):
            pass  # closed or broken: nothing more can reach it anyway


def _heartbeat_s(heartbeat_timeout_s: float | None) -> float:
    if heartbeat_timeout_s is not None:
        return heartbeat_timeout_s
    text = os.environ.get(ENV_HEARTBEAT_TIMEOUT)
    if text is None:
        return DEFAULT_HEARTBEAT_TIMEOUT_S
    try:
        return float(text)
    except ValueError:
        raise DistributedError(
            f"{ENV_HEARTBEAT_TIMEOUT}={text!r} is not a number of seconds; set it like '10'"
        ) from None


def _whole_seconds(name: str, seconds: float) -> int:
    if not seconds > 0:
        raise DistributedError(f"{name}={seconds!r} must be a positive number of seconds")
    return max(1, math.ceil(seconds))  # jax.distributed takes whole seconds


def _env_int(name: str, minimum: int) -> int:
    text = os.environ[name]
    try:
        value = int(text)
    except ValueError:
        raise DistributedError(
            f"{name}={text!r} is not an integer; piper-launch sets it, so start the script "
            "with piper-launch or set it to a whole number"
        ) from None
    if value < minimum:
        raise DistributedError(f"{name}={value} must be at least {minimum}")
    return value


def _backends_started() -> bool:
    """Whether JAX's backend has started (a RuntimeError JAX raises later is turned into
    the same error, in case this check misses a path)."""
    return jax_compat.backends_are_initialized()


def _says_backend_started(e: Exception) -> bool:
    text = str(e)
    return "before any JAX calls" in text or "before backends are initialized" in text


def _backend_started_error() -> DistributedError:
    return DistributedError(
        "piper_jax.distributed.initialize() was called after JAX started its backend "
        "(some JAX computation, jax.devices() or jax.device_put ran first); call it at the "
        "top of the script, before anything else touches JAX"
    )
