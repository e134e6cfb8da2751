"""The instruction set of a plan: small frozen values with a short, parseable string form.

F1.3                 run the forward of region 1 on microbatch 3 (B, BI, BW alike)
UPD1                 optimizer update of region 1's parameter group
SEND F1.3 -> d1,3    send the outputs of F1.3 to device group (1, 3)
RECV F1.3 <- d0      receive them from device group (0,)
ALL_REDUCE #12 d0,2  the gradient all-reduce of DAG node 12 over devices 0 and 2
FREE F1.3            drop this group's copy of F1.3's outputs; FREE batch.3 likewise
"""

from __future__ import annotations

import dataclasses
import re

from piper_jax.ir.dag import group_str

RUN, UPD, SEND, RECV, ALL_REDUCE, FREE = "RUN", "UPD", "SEND", "RECV", "ALL_REDUCE", "FREE"
BATCH = "batch"


@dataclasses.dataclass(frozen=True)
class Instruction:
    op: str
    pass_: str | None = None
    region: int | None = None
    microbatch: int | None = None
    peer: tuple[int, ...] | None = None
    uid: int | None = None

    def buffer(self) -> str:
        """The label of the computation this instruction runs, moves or frees: F1.3."""
        if self.pass_ == BATCH:
            return f"{BATCH}.{self.microbatch}"
        mb = "" if self.microbatch is None else f".{self.microbatch}"
        return f"{self.pass_}{self.region}{mb}"

    def __str__(self) -> str:
        if self.op == RUN:
            return self.buffer()
        if self.op == UPD:
            return f"UPD{self.region}"
        if self.op == SEND:
            return f"SEND {self.buffer()} -> {group_str(self.peer)}"
        if self.op == RECV:
            return f"RECV {self.buffer()} <- {group_str(self.peer)}"
        if self.op == ALL_REDUCE:
            return f"ALL_REDUCE #{self.uid} {group_str(self.peer)}"
        return f"FREE {self.buffer()}"


_LABEL = r"(F|B|BI|BW)(\d+)(?:\.(\d+))?"
_GROUP = r"d(\d+(?:,\d+)*)"
_PATTERNS = [
    (RUN, re.compile(rf"^{_LABEL}$")),
    (UPD, re.compile(r"^UPD(\d+)$")),
    (SEND, re.compile(rf"^SEND {_LABEL} -> {_GROUP}$")),
    (RECV, re.compile(rf"^RECV {_LABEL} <- {_GROUP}$")),
    (ALL_REDUCE, re.compile(rf"^ALL_REDUCE #(\d+) {_GROUP}$")),
    (FREE, re.compile(rf"^FREE (?:{_LABEL}|{BATCH}\.(\d+))$")),
]


def _group(text: str) -> tuple[int, ...]:
    return tuple(int(d) for d in text.split(","))


def _int(text: str | None) -> int | None:
    return None if text is None else int(text)


def parse(text: str) -> Instruction:
    """The instruction whose string form is `text`: parse(str(i)) == i."""
    for op, pattern in _PATTERNS:
        m = pattern.match(text.strip())
        if not m:
            continue
        g = m.groups()
        if op == UPD:
            return Instruction(UPD, region=int(g[0]))
        if op == ALL_REDUCE:
            return Instruction(ALL_REDUCE, uid=int(g[0]), peer=_group(g[1]))
        if op == FREE and g[3] is not None:
            return Instruction(FREE, BATCH, microbatch=int(g[3]))
        peer = _group(g[3]) if op in (SEND, RECV) else None
        return Instruction(op, g[0], int(g[1]), _int(g[2]), peer)
    raise ValueError(f"not an instruction: {text!r}")
