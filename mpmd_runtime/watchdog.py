"""A step timeout that also works while the host is blocked inside a collective.

On CPU (gloo), dispatching a cross-process transfer or collective blocks the calling
thread until the peer takes part, so a stalled peer can hold the host inside C code,
where no Python exception can be raised. A timer thread then reports the stuck
instruction as a PiperError on stderr and ends the process with exit code 1, the same
code an uncaught PiperError gives under `piper_jax.distributed.initialize`.
"""

from __future__ import annotations

import os
import sys
import threading
from collections.abc import Callable
from types import TracebackType


class StepWatchdog:
    """Within `timeout_s` of entering, the block must leave, or the process ends."""

    def __init__(self, timeout_s: float, describe: Callable[[], str]):
        self.timeout_s = timeout_s
        self.describe = describe
        self._timer: threading.Timer | None = None

    def __enter__(self) -> StepWatchdog:
        self._timer = threading.Timer(self.timeout_s, self._fire)
        self._timer.daemon = True
        self._timer.start()
        return self

    def __exit__(
        self,
        kind: type[BaseException] | None,
        value: BaseException | None,
        traceback: TracebackType | None,
    ) -> None:
        assert self._timer is not None
        self._timer.cancel()

    def _fire(self) -> None:
        try:
            message = self.describe()
        except Exception as err:  # the report must never keep the process alive
            message = f"the step did not finish within {self.timeout_s:g} s ({err})"
        sys.stderr.write(f"piper_jax.PiperError: {message}\n")
        sys.stderr.flush()
        sys.stdout.flush()
        os._exit(1)
