"""The instruction set of a plan: small frozen values with a short, parseable string form.

Every instruction is named by what it runs or carries:

F1.3                              run the forward of region 1 on microbatch 3 (B, BI, BW alike)
UPD1                              optimizer update of region 1's parameter group
SEND F1.3 -> d1,3                 send the outputs of F1.3 to device group (1, 3)
RECV F1.3 <- d0                   receive them from device group (0,)
ALL_REDUCE grad[0,2] d0,2         sum the gradients of the parameter groups of regions 0
                                  and 2 over devices 0 and 2 (`/k`: bucket k of them)
ALL_REDUCE gnorm d0,1             sum the squared gradient norms of every group
REDUCE_SCATTER grad[B0.3] d0,2    ZeRO: reduce-scatter the gradients B0.3 computed
ALL_GATHER param[F0.3] d0,2       ZeRO-3: gather the parameters F0.3 reads
ALL_GATHER param[UPD0] d0,2       ZeRO-2: gather the shards UPD0 updated
ALL_TO_ALL dispatch[F0.3>F1.3] d0,1
                                  expert parallelism: the tokens of F0.3 that expert
                                  region 1 reads, moved to their experts' devices
                                  (`combine[...]`: back to their own rows)
FREE F1.3                         drop this group's copy of a buffer (FREE batch.3 alike)

A step of a plan is one instruction or several fused into one program, written joined
by " + " (`ALL_GATHER param[F0.3] d0,2 + F0.3`).
"""

from __future__ import annotations

import dataclasses
import functools
import re

from piper_jax.ir.layout import group_str

RUN, UPD, SEND, RECV, FREE = "RUN", "UPD", "SEND", "RECV", "FREE"
ALL_REDUCE, REDUCE_SCATTER, ALL_GATHER = "ALL_REDUCE", "REDUCE_SCATTER", "ALL_GATHER"
ALL_TO_ALL = "ALL_TO_ALL"
COLLECTIVES = (ALL_REDUCE, REDUCE_SCATTER, ALL_GATHER, ALL_TO_ALL)
BATCH = "batch"
GNORM = "gnorm"

_LABEL = r"(F|B|BI|BW)(\d+)(?:\.(\d+))?"
_LABEL_RE = re.compile(rf"^{_LABEL}$")
_SERVED_RE = re.compile(rf"^(?:param|grad)\[((?:{_LABEL})|UPD(\d+))\](?:/\d+)?$")
_ALL_TO_ALL_RE = re.compile(rf"^(dispatch|combine)\[({_LABEL})>({_LABEL})\]$")


@dataclasses.dataclass(frozen=True)
class Label:
    """A pass of a region on a microbatch: F1.3."""

    pass_: str
    region: int
    microbatch: int | None

    def __str__(self) -> str:
        mb = "" if self.microbatch is None else f".{self.microbatch}"
        return f"{self.pass_}{self.region}{mb}"


@functools.cache
def parse_label(text: str) -> Label | None:
    """The pass a value names directly (F1.3) or serves (param[F1.3], grad[B0.2]/1, the
    reader F1.3 of dispatch[F0.3>F1.3])."""
    m = _LABEL_RE.match(text)
    if m:
        return Label(m.group(1), int(m.group(2)), _int(m.group(3)))
    m = _SERVED_RE.match(text)
    if m and m.group(2):
        return Label(m.group(2), int(m.group(3)), _int(m.group(4)))
    m = _ALL_TO_ALL_RE.match(text)
    if m:
        return Label(m.group(7), int(m.group(8)), _int(m.group(9)))
    return None


@dataclasses.dataclass(frozen=True)
class AllToAll:
    """What an ALL_TO_ALL moves: the value `source` wrote, for the pass `reader`;
    `to_experts` for a dispatch (rows -> experts), else a combine (experts -> rows)."""

    to_experts: bool
    source: Label
    reader: Label


def parse_all_to_all(text: str) -> AllToAll:
    """dispatch[F0.3>F1.3] -> AllToAll(True, F0.3, F1.3)."""
    m = _ALL_TO_ALL_RE.match(text)
    if not m:
        raise ValueError(f"not an all-to-all value: {text!r}")
    return AllToAll(m.group(1) == "dispatch", parse_label(m.group(2)), parse_label(text))


@dataclasses.dataclass(frozen=True)
class Instruction:
    """One instruction: `op` on `value` (a pass label, a buffer or a collective's value);
    `peer` is a SEND's destination, a RECV's source or a collective's devices."""

    op: str
    value: str
    peer: tuple[int, ...] | None = None

    @property
    def label(self) -> Label | None:
        return parse_label(self.value)

    @property
    def pass_(self) -> str | None:
        label = self.label
        return None if label is None else label.pass_

    @property
    def region(self) -> int | None:
        if self.op == UPD:
            return int(self.value)
        label = self.label
        return None if label is None else label.region

    @property
    def microbatch(self) -> int | None:
        label = self.label
        return None if label is None else label.microbatch

    def __str__(self) -> str:
        if self.op == RUN:
            return self.value
        if self.op == UPD:
            return f"UPD{self.value}"
        if self.op == SEND:
            return f"SEND {self.value} -> {group_str(self.peer)}"
        if self.op == RECV:
            return f"RECV {self.value} <- {group_str(self.peer)}"
        if self.op == FREE:
            return f"FREE {self.value}"
        return f"{self.op} {self.value} {group_str(self.peer)}"


def run(label: Label | str) -> Instruction:
    return Instruction(RUN, str(label))


def free(buffer: str) -> Instruction:
    return Instruction(FREE, buffer)


@dataclasses.dataclass(frozen=True)
class Step:
    """What a device group runs as one program: one instruction, or several fused."""

    instructions: tuple[Instruction, ...]

    def __str__(self) -> str:
        return " + ".join(str(i) for i in self.instructions)

    @property
    def head(self) -> Instruction:
        return self.instructions[0]


_VALUE = r"(\S+)"
_GROUP = r"d(\d+(?:,\d+)*)"
_PATTERNS = [
    (RUN, re.compile(rf"^({_LABEL})$")),
    (UPD, re.compile(r"^UPD(\d+)$")),
    (SEND, re.compile(rf"^SEND {_VALUE} -> {_GROUP}$")),
    (RECV, re.compile(rf"^RECV {_VALUE} <- {_GROUP}$")),
    (FREE, re.compile(rf"^FREE {_VALUE}$")),
    *[(op, re.compile(rf"^{op} {_VALUE} {_GROUP}$")) for op in COLLECTIVES],
]


def _group(text: str) -> tuple[int, ...]:
    return tuple(int(d) for d in text.split(","))


def _int(text: str | None) -> int | None:
    return None if text is None else int(text)


def parse(text: str) -> Instruction:
    """The instruction whose string form is `text`: parse(str(i)) == i."""
    text = text.strip()
    for op, pattern in _PATTERNS:
        m = pattern.match(text)
        if not m:
            continue
        if op in (RUN, UPD, FREE):
            return Instruction(op, m.group(1))
        return Instruction(op, m.group(1), _group(m.group(2)))
    raise ValueError(f"not an instruction: {text!r}")


def parse_step(text: str) -> Step:
    """The step whose string form is `text`: parse_step(str(s)) == s."""
    return Step(tuple(parse(part) for part in text.split(" + ")))
