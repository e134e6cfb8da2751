"""What every instruction reads and writes on its device group: the one description the
plan compiler (where to FREE, what a fused step keeps inside) and the executor (how to
wire a program's inputs and outputs) share.

Note [buffers of a device group]
A group keeps its values in one store keyed by `Buffer`:

  value F1.3, B1.3, BI1.3   the outputs of a pass (activations, input cotangents), named
                            as plans name them; batch.3 (the batch of a microbatch),
                            param[F0.3] (ZeRO-3 gathered parameters), grad[B0.3] (ZeRO:
                            a backward's gradients before their reduce-scatter),
                            grad[0,2] (all-reduced gradients), param[UPD0] (ZeRO-2:
                            updated shards), gnorm (the global squared gradient norm)
  res R1.3, cross X1.3      what F leaves for its backward, what BI leaves for BW
  param, acc (by name)      the parameters and gradient accumulators (state)
  opt (by region)           the optimizer state of region's parameter group (state)
  loss loss.3               the loss of a microbatch, which the executor collects

Values are freed by FREE instructions after their last reader; residuals are consumed by
the backward that uses them last; state lives across steps.
"""

from __future__ import annotations

import dataclasses
import enum
import functools
from collections.abc import Mapping, Sequence
from typing import Any

from piper_jax.ir.lift import LiftedLoss
from piper_jax.mpmd_runtime.instructions import (
    ALL_GATHER,
    ALL_REDUCE,
    ALL_TO_ALL,
    BATCH,
    FREE,
    GNORM,
    RECV,
    REDUCE_SCATTER,
    RUN,
    SEND,
    UPD,
    Instruction,
    Label,
    parse_all_to_all,
    parse_label,
)

Group = tuple[int, ...]


class Kind(enum.StrEnum):
    VALUE = "value"
    RES = "res"
    CROSS = "cross"
    PARAM = "param"
    ACC = "acc"
    OPT = "opt"
    LOSS = "loss"


PERSISTENT = frozenset({Kind.PARAM, Kind.ACC, Kind.OPT})


@dataclasses.dataclass(frozen=True, slots=True, eq=False)
class Buffer:
    """A key of a group's store (Note [buffers of a device group]). Its hash is computed
    once: the executor looks buffers up in stores about a thousand times per step, and
    the generated hash (through the enum's Python-level hash) was a tenth of its host
    time."""

    kind: Kind
    name: str
    _hash: int = dataclasses.field(init=False, repr=False)

    def __post_init__(self) -> None:
        object.__setattr__(self, "_hash", hash((self.kind.value, self.name)))

    def __hash__(self) -> int:
        return self._hash

    def __eq__(self, other: object) -> bool:
        return (
            isinstance(other, Buffer)
            and self._hash == other._hash
            and self.kind is other.kind
            and self.name == other.name
        )

    def __str__(self) -> str:
        return self.name if self.kind is Kind.VALUE else f"{self.kind.value}:{self.name}"


def value(name: str | Label) -> Buffer:
    return Buffer(Kind.VALUE, str(name))


def batch(microbatch: int) -> Buffer:
    return value(f"{BATCH}.{microbatch}")


def residuals(region: int, microbatch: int | None) -> Buffer:
    return Buffer(Kind.RES, f"R{region}.{microbatch}")


def cross(region: int, microbatch: int | None) -> Buffer:
    return Buffer(Kind.CROSS, f"X{region}.{microbatch}")


def param(name: str) -> Buffer:
    return Buffer(Kind.PARAM, name)


def acc(name: str) -> Buffer:
    return Buffer(Kind.ACC, name)


def opt(region: int) -> Buffer:
    return Buffer(Kind.OPT, str(region))


def loss(microbatch: int | None) -> Buffer:
    return Buffer(Kind.LOSS, f"loss.{microbatch}")


@dataclasses.dataclass(frozen=True)
class Access:
    """What one instruction reads (in order), consumes (reads for the last time, so a
    program may donate them) and writes (in order) on its group."""

    reads: tuple[Buffer, ...] = ()
    consumes: frozenset[Buffer] = frozenset()
    writes: tuple[Buffer, ...] = ()


@dataclasses.dataclass(frozen=True)
class PlanContext:
    """The static facts buffers depend on, beyond the instruction itself.

    Attributes:
      lifted: the regions (inputs, outputs, parameters, which read the batch).
      zero_level: per device group.
      recompute: regions whose forward runs (in part) again in the backward, with what
        their forward keeps ("inputs" or "dots").
      split: (region, microbatch) whose backward runs as BI + BW.
      param_sets: parameter indices of every UPD (`UPD1`) and gradient ALL_REDUCE
        value (`grad[0,2]`, `grad[0,2]/1`) and bucketed reduce-scatter (`grad[B0.3]/1`).
      reduced_by: per group and parameter, the ALL_REDUCE value whose result the group's
        update reads instead of its own accumulator.
      update_groups: the device group of every UPD, by region.
      global_norm: the updates read `gnorm`.
      forward_only: evaluation: F keeps no residuals.
    """

    lifted: LiftedLoss
    zero_level: Mapping[Group, int]
    recompute: Mapping[int, str]
    split: frozenset[tuple[int, int | None]]
    param_sets: Mapping[str, tuple[int, ...]]
    reduced_by: Mapping[Group, Mapping[int, str]]
    update_groups: Mapping[int, Group]
    global_norm: bool
    forward_only: bool = False

    def names(self, params: Sequence[int]) -> list[str]:
        return [self.lifted.param_names[p] for p in params]

    def cotangent_pass(self, region: int, microbatch: int | None) -> str:
        """The pass whose output holds `region`'s input cotangents: BI if split."""
        return "BI" if (region, microbatch) in self.split else "B"

    def cotangent_consumers(self, region: int) -> list[int]:
        """Regions whose backward sends cotangents for `region`'s float outputs."""
        return self._cotangent_consumers.get(region, [])

    @functools.cached_property
    def _cotangent_consumers(self) -> dict[int, list[int]]:
        # once per context: every backward in the plans asks (a plan compile at scale
        # asks for each of its 10^5 instructions)
        regions = self.lifted.regions
        out: dict[int, set[int]] = {}
        for consumer in regions:
            for ref in consumer.act_inputs:
                if regions[ref.region].out_is_float(ref.position):
                    out.setdefault(ref.region, set()).add(consumer.index)
        return {r: sorted(c) for r, c in out.items()}

    def param_inputs(self, group: Group, label: Label) -> list[Buffer]:
        """The parameters a pass reads: gathered (ZeRO-3) or the group's own."""
        params = self.lifted.regions[label.region].param_ids
        if not params:
            return []
        if self.zero_level[group] >= 3:
            return [value(f"param[{label}]")]
        return [param(n) for n in self.names(params)]

    def grad_outputs(self, group: Group, label: Label) -> tuple[list[Buffer], list[Buffer]]:
        """(read, written) accumulators of a weight-gradient pass; under ZeRO it writes
        its full gradients for the reduce-scatter instead."""
        params = self.lifted.regions[label.region].param_ids
        if self.zero_level[group] >= 2:
            return [], [value(f"grad[{label}]")] if params else []
        accs = [acc(n) for n in self.names(params)]
        return accs, accs


def access(ins: Instruction, group: Group, ctx: PlanContext) -> Access:
    """The buffers `ins` reads, consumes and writes on `group`."""
    if ins.op == RUN:
        return _run_access(ins.label, group, ctx)
    if ins.op == SEND:
        return Access(reads=(value(ins.value),))
    if ins.op in (RECV,):
        return Access(writes=(value(ins.value),))
    if ins.op == FREE:
        return Access(consumes=frozenset({value(ins.value)}))
    if ins.op == UPD:
        return _update_access(int(ins.value), group, ctx)
    if ins.op == ALL_REDUCE and ins.value == GNORM:
        names = ctx.names(norm_params(ctx, group))
        reads = [_grad_input(ctx, group, n) for n in names]
        return Access(reads=tuple(dict.fromkeys(reads)), writes=(value(GNORM),))
    if ins.op == ALL_REDUCE:
        accs = tuple(acc(n) for n in ctx.names(ctx.param_sets[ins.value]))
        return Access(reads=accs, writes=(value(ins.value),))
    if ins.op == REDUCE_SCATTER:
        grads = value(f"grad[{ins.label}]")
        params = ctx.param_sets.get(ins.value, ctx.lifted.regions[ins.region].param_ids)
        accs = tuple(acc(n) for n in ctx.names(params))
        return Access(reads=(grads, *accs), consumes=frozenset(accs), writes=accs)
    if ins.op == ALL_GATHER and ins.value.startswith("param[UPD"):
        region = int(ins.value[len("param[UPD") : -1])
        names = ctx.names(ctx.param_sets[f"UPD{region}"])
        return Access(reads=(value(ins.value),), writes=tuple(param(n) for n in names))
    if ins.op == ALL_GATHER:
        names = ctx.names(ctx.lifted.regions[ins.region].param_ids)
        return Access(reads=tuple(param(n) for n in names), writes=(value(ins.value),))
    if ins.op == ALL_TO_ALL:  # relays a value to the pass fused after it, in place
        return Access(reads=(value(parse_all_to_all(ins.value).source),))
    raise AssertionError(f"no buffers known for {ins}")


def _run_access(label: Label, group: Group, ctx: PlanContext) -> Access:
    r, mb = label.region, label.microbatch
    region = ctx.lifted.regions[r]
    params = ctx.param_inputs(group, label)
    if label.pass_ == "F":
        reads = [*params]
        if region.batch_ids:
            reads.append(batch(mb))
        reads += list(dict.fromkeys(value(f"F{a.region}.{mb}") for a in region.act_inputs))
        writes = [value(label)] if ctx.forward_only else [value(label), residuals(r, mb)]
        if r == ctx.lifted.loss_region:
            writes.append(loss(mb))
        return Access(reads=tuple(reads), writes=tuple(writes))
    cots = [value(f"{ctx.cotangent_pass(c, mb)}{c}.{mb}") for c in ctx.cotangent_consumers(r)]
    res = residuals(r, mb)
    if label.pass_ == "BI":
        return Access(
            reads=(*params, res, *cots),
            writes=(value(label), cross(r, mb)),
        )
    grads_in, grads_out = ctx.grad_outputs(group, label)
    if label.pass_ == "BW":
        x = cross(r, mb)
        return Access(
            reads=(*params, res, x, *grads_in),
            consumes=frozenset({res, x, *grads_in}),
            writes=tuple(grads_out),
        )
    assert label.pass_ == "B", label
    return Access(
        reads=(*params, res, *cots, *grads_in),
        consumes=frozenset({res, *grads_in}),
        writes=(value(label), *grads_out),
    )


def _grad_input(ctx: PlanContext, group: Group, name: str) -> Buffer:
    p = ctx.lifted.param_names.index(name)
    reduced = ctx.reduced_by[group].get(p)
    return value(reduced) if reduced else acc(name)


def _update_access(region: int, group: Group, ctx: PlanContext) -> Access:
    names = ctx.names(ctx.param_sets[f"UPD{region}"])
    grads = list(dict.fromkeys(_grad_input(ctx, group, n) for n in names))
    extra = [value(GNORM)] if ctx.global_norm else []
    params = [param(n) for n in names]
    accs = [acc(n) for n in names]
    state = opt(region)
    written = (
        [value(f"param[UPD{region}]")] if ctx.zero_level[group] == 2 else params
    )  # ZeRO-2 writes the updated shards, which its ALL_GATHER turns into parameters
    # the accumulators are read, not consumed: donated, XLA:CPU would copy each one before
    # writing zeros into its buffer (three passes over it); kept, it writes fresh zeros
    # (off the CPU the executor donates them anyway: Note [state keeps its buffers])
    return Access(
        reads=tuple(dict.fromkeys((*params, *grads, *accs, state, *extra))),
        consumes=frozenset({*params, state}),
        writes=(*written, state, *accs),
    )


def norm_params(ctx: PlanContext, group: Group) -> list[int]:
    """The parameters whose gradients `group` counts in the global norm: each parameter
    once, on the group of its first update (by region)."""
    counted: set[int] = set()
    mine: list[int] = []
    for region in sorted(ctx.update_groups):
        for p in ctx.param_sets[f"UPD{region}"]:
            if p not in counted:
                counted.add(p)
                if ctx.update_groups[region] == group:
                    mine.append(p)
    return mine


def value_avals(lifted: LiftedLoss, name: str) -> list[tuple[tuple[int, ...], Any]]:
    """Per-replica (shape, dtype) of each leaf of a moved value: the outputs of an F, or
    the input cotangents (one per float input) of a B or BI."""
    label = parse_label(name)
    region = lifted.regions[label.region]
    if label.pass_ == "F":
        return [(tuple(s), d) for s, d in region.out_shapes]
    regions = lifted.regions
    shapes = [
        regions[a.region].out_shapes[a.position]
        for a in region.act_inputs
        if regions[a.region].out_is_float(a.position)
    ]
    return [(tuple(s), d) for s, d in shapes]
