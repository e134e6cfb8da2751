"""A step timeout that also works while the host is blocked inside a collective, and the
report that names the failing instruction and peer.

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
from collections.abc import Callable, Mapping, Sequence
from types import TracebackType
from typing import Any

import jax
from piper_jax.ir.layout import group_str

Group = tuple[int, ...]
Event = tuple[tuple[Group, ...], tuple[int, ...]]


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


class FailureReport:
    """Names the instruction and the peer processes of a failed or stalled step."""

    def __init__(
        self,
        plans: Any,
        meshes: Mapping[Group, Any],
        events: Sequence[Event],
        exchanges: Mapping[int, list[int]],
    ):
        """`exchanges`: the executor's, positions of SENDs run as one program."""
        self.plans, self.meshes, self.events = plans, meshes, list(events)
        self.exchanges = exchanges

    def _step(self, index: int) -> Any:
        members, position = self.events[index]
        return self.plans.steps[members[0]][position[0]]

    def peers_of(self, index: int) -> list[int]:
        """The other processes that step `index` exchanges data with."""
        members, _ = self.events[index]
        head = self._step(index).head
        groups = set(members) | ({tuple(head.peer)} if head.op in ("SEND", "RECV") else set())
        return sorted(
            {d.process_index for g in groups for d in self.meshes[g].devices.flat}
            - {jax.process_index()}
        )

    def message(self, index: int, what: str) -> str:
        members, _ = self.events[index]
        peers = ", ".join(f"process {p}" for p in self.peers_of(index)) or "no other process"
        text = " + ".join(str(self._step(i)) for i in self.exchanges.get(index) or [index])
        return (
            f"process {jax.process_index()}: instruction '{text}' on "
            f"{', '.join(group_str(g) for g in members)} {what}; it waits on {peers}, which "
            "died or stalled: check that process's output"
        )

    def first_failure(self, witnesses: Sequence[tuple[int, Any]]) -> int | None:
        """The step position of the first dispatched step whose outputs failed."""
        for i, out in witnesses:
            try:
                jax.block_until_ready([x for x in jax.tree.leaves(out) if not x.is_deleted()])
            except Exception:
                return i
        return None

    def stall_message(
        self, position: int, witnesses: Sequence[tuple[int, Any]], timeout_s: float
    ) -> str:
        """The first unfinished step, read without blocking (from the watchdog thread)."""
        stuck = position
        for i, out in witnesses:
            if not all(x.is_deleted() or x.is_ready() for x in jax.tree.leaves(out)):
                stuck = min(stuck, i)
                break
        return self.message(stuck, f"did not finish within {timeout_s:g} s")
