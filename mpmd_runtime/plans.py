"""Plan compiler: the training DAG -> one list of steps per device group.

The passes, in the order they run (see `compile_plans`):
  schedule_nodes, attach_collectives, sink_receives, fuse_forward_backward,
  fuse_reductions_into_updates (scheduler.py)
  to_steps        one instruction per node; consecutive nodes of one unit form one step
  insert_frees    FREE after the last step of a group that touches a value
  dry_run         replay the plans (replay.py): proves they complete, and fixes the one
                  global order in which every process issues its steps

Plans are plain text too: `Plans.to_text()` writes everything needed to run them (group
meshes, ZeRO levels, parameter sets, steps) and `Plans.from_text` reads it back.
"""

from __future__ import annotations

import dataclasses
import hashlib
from collections.abc import Mapping

from piper_jax.ir.dag import RECOMPUTE_KEEPS, NodeKind, TrainingDAG
from piper_jax.ir.errors import PlanError
from piper_jax.ir.layout import DeviceMesh, group_str
from piper_jax.ir.lift import LiftedLoss
from piper_jax.mpmd_runtime import buffers as bf
from piper_jax.mpmd_runtime.instructions import (
    ALL_GATHER,
    ALL_REDUCE,
    ALL_TO_ALL,
    GNORM,
    RECV,
    REDUCE_SCATTER,
    RUN,
    SEND,
    UPD,
    Instruction,
    Step,
    free,
    parse_step,
)
from piper_jax.mpmd_runtime.replay import Event, dry_run, format_grid
from piper_jax.mpmd_runtime.scheduler import (
    attach_collectives,
    attached,
    compute_groups,
    fuse_forward_backward,
    fuse_reductions_into_updates,
    schedule_nodes,
    sink_receives,
    unit_keys,
)

Group = tuple[int, ...]
HEADER = "piper-jax plans v1"


@dataclasses.dataclass(frozen=True)
class Plans:
    """The per-group plans and what it takes to run them.

    Attributes:
      meshes: the named mesh of every device group.
      zero_level: the ZeRO level of every device group.
      tensor: per device group, the parameters split over its `tp` axis, each with a
        partition of its dimensions ("tp" or None per dimension).
      steps: per group, the steps in execution order (a step: one instruction, or
        several fused into one program).
      param_sets: parameter indices of each UPD (`UPD1`), gradient ALL_REDUCE
        (`grad[0,2]`, buckets `grad[0,2]/1`) and bucketed reduce-scatter.
      recompute: per region whose forward runs (in part) again inside its backward, what
        the forward keeps: "inputs" or "dots" (directives/types.Recompute).
      global_norm: the updates read the global gradient norm (`gnorm`).
      forward_only: evaluation plans: forward passes only, keeping no residuals.
      order: every step once, as (groups, step indices) events in the order a single
        controller issues them; a cross-group collective is one event for all its groups.
      rounds: the round of each step in a unit-cost replay (the rows of `grid()`).
    """

    meshes: dict[Group, DeviceMesh]
    zero_level: dict[Group, int]
    tensor: dict[Group, dict[int, tuple[str | None, ...]]]
    steps: dict[Group, list[Step]]
    param_sets: dict[str, tuple[int, ...]]
    recompute: dict[int, str]
    global_norm: bool
    forward_only: bool
    order: list[Event]
    rounds: dict[Group, list[int]]

    @property
    def plans(self) -> dict[Group, list[Instruction]]:
        """Every group's instructions, fused steps flattened, in execution order."""
        return {g: [i for s in steps for i in s.instructions] for g, steps in self.steps.items()}

    def context(self, lifted: LiftedLoss) -> bf.PlanContext:
        """The facts `buffers.access` needs, read from the plans."""
        split = {
            (i.region, i.microbatch)
            for plan in self.plans.values()
            for i in plan
            if i.op == RUN and i.pass_ == "BI"
        }
        update_groups = {
            int(i.value): g for g, plan in self.plans.items() for i in plan if i.op == UPD
        }
        reduced_by: dict[Group, dict[int, str]] = {g: {} for g in self.steps}
        for g, plan in self.plans.items():
            for i in plan:
                if i.op == ALL_REDUCE and i.value != GNORM:
                    for p in self.param_sets[i.value]:
                        reduced_by[g][p] = i.value
        return bf.PlanContext(
            lifted=lifted,
            zero_level=self.zero_level,
            recompute=self.recompute,
            split=frozenset(split),
            param_sets=self.param_sets,
            reduced_by=reduced_by,
            update_groups=update_groups,
            global_norm=self.global_norm,
            forward_only=self.forward_only,
        )

    def to_text(self) -> str:
        lines = [HEADER]
        for g in sorted(self.meshes):
            lines.append(
                f"group {group_str(g)} {self.meshes[g].axes_str()} zero={self.zero_level[g]}"
            )
        for g in sorted(self.tensor):
            for p, spec in sorted(self.tensor[g].items()):
                axes = ",".join(axis or "-" for axis in spec)
                lines.append(f"spec {group_str(g)} {p} = {axes}")
        if self.recompute:
            regions = [
                str(r) if keep == "inputs" else f"{r}:{keep}"
                for r, keep in sorted(self.recompute.items())
            ]
            lines.append("recompute " + " ".join(regions))
        if self.global_norm:
            lines.append("global_norm")
        if self.forward_only:
            lines.append("forward_only")
        for name in sorted(self.param_sets, key=_param_set_key):
            lines.append(f"params {name} = " + " ".join(map(str, self.param_sets[name])))
        for g in sorted(self.steps):
            lines.append(f"plan {group_str(g)}")
            lines += [f"  {s}" for s in self.steps[g]]
        return "\n".join(lines) + "\n"

    @classmethod
    def from_text(cls, text: str) -> Plans:
        """Plans written by `to_text` (their order and rounds replayed again)."""
        meshes: dict[Group, DeviceMesh] = {}
        zero_level: dict[Group, int] = {}
        tensor: dict[Group, dict[int, tuple[str | None, ...]]] = {}
        steps: dict[Group, list[Step]] = {}
        param_sets: dict[str, tuple[int, ...]] = {}
        recompute: dict[int, str] = {}
        global_norm = forward_only = False
        current: list[Step] | None = None
        lines = text.splitlines()
        if not lines or lines[0] != HEADER:
            raise PlanError(f"not a plan text: the first line must be {HEADER!r}")
        for n, line in enumerate(lines[1:], start=2):
            try:
                if line.startswith("  "):
                    assert current is not None, "a step before any 'plan' line"
                    current.append(parse_step(line))
                    continue
                word, _, rest = line.partition(" ")
                if word == "group":
                    devices, _, rest = rest.partition(" ")
                    axes, _, zero = rest.rpartition(" ")
                    g = _parse_group(devices)
                    meshes[g] = DeviceMesh(g, _parse_axes(axes))
                    zero_level[g] = int(zero.removeprefix("zero="))
                elif word == "spec":
                    where, _, axes = rest.partition(" = ")
                    devices, param = where.split(" ")
                    spec = tuple(None if a == "-" else a for a in axes.split(","))
                    tensor.setdefault(_parse_group(devices), {})[int(param)] = spec
                elif word == "recompute":
                    for entry in rest.split():
                        region, _, keep = entry.partition(":")
                        if keep not in ("", *RECOMPUTE_KEEPS):
                            raise ValueError(f"recompute {entry!r} keeps {keep!r}")
                        recompute[int(region)] = keep or "inputs"
                elif word == "global_norm":
                    global_norm = True
                elif word == "forward_only":
                    forward_only = True
                elif word == "params":
                    name, _, ids = rest.partition(" = ")
                    param_sets[name] = tuple(int(p) for p in ids.split())
                elif word == "plan":
                    current = steps.setdefault(_parse_group(rest), [])
                elif line.strip():
                    raise ValueError(f"unknown line {line!r}")
            except (ValueError, AssertionError) as err:
                raise PlanError(f"plan text line {n}: {err}") from None
        return finish_plans(
            meshes, zero_level, tensor, steps, param_sets, recompute, global_norm, forward_only
        )

    def fingerprint(self, extra: str = "") -> str:
        """A digest of the plans (and `extra`, e.g. shapes); processes compare it to prove
        they run the same plans on the same shapes."""
        return hashlib.sha256((self.to_text() + extra).encode()).hexdigest()

    def grid(self) -> str:
        """Text grid: rows are replay rounds, columns are device groups."""
        return format_grid(self.steps, self.rounds)


def _param_set_key(name: str) -> tuple[int, str]:
    return (0 if name.startswith("UPD") else 1, name)


def _parse_group(text: str) -> Group:
    assert text.startswith("d"), f"not a device group: {text!r}"
    return tuple(int(d) for d in text[1:].split(","))


def _parse_axes(text: str) -> tuple[tuple[str, int], ...]:
    if text == "unsplit":
        return ()
    out = []
    for part in text.split("x"):
        name, _, size = part.strip().partition("=")
        out.append((name, int(size)))
    return tuple(out)


def finish_plans(
    meshes: Mapping[Group, DeviceMesh],
    zero_level: Mapping[Group, int],
    tensor: Mapping[Group, dict[int, tuple[str | None, ...]]],
    steps: Mapping[Group, list[Step]],
    param_sets: Mapping[str, tuple[int, ...]],
    recompute: dict[int, str],
    global_norm: bool,
    forward_only: bool,
) -> Plans:
    """Plans with their global order and rounds from a dry run (PlanError if stuck)."""
    order, rounds = dry_run(steps)
    return Plans(
        dict(meshes),
        dict(zero_level),
        {g: dict(t) for g, t in tensor.items() if t},
        {g: list(s) for g, s in steps.items()},
        dict(param_sets),
        recompute,
        global_norm,
        forward_only,
        order,
        rounds,
    )


def compile_plans(
    dag: TrainingDAG,
    lifted: LiftedLoss,
    fuse_collectives: bool = True,
    fuse_passes: bool = False,
) -> Plans:
    """The per-group plans of `dag` (see the module docstring for the passes);
    `fuse_passes`: Note [a forward and its backward in one program]."""
    groups = compute_groups(dag)
    keys = unit_keys(dag, fuse_collectives)
    order = schedule_nodes(dag, groups)
    serves = attached(dag)
    order = {
        g: sink_receives(dag, attach_collectives(dag, order[g], g, serves), keys) for g in groups
    }
    if fuse_passes:
        keys = fuse_forward_backward(dag, order, keys)
    if fuse_collectives:
        keys = fuse_reductions_into_updates(dag, order, keys)
    meshes = {n.devices: n.mesh for n in dag.compute_nodes()}
    zero_level = {n.devices: n.param_layout.zero_level for n in dag.compute_nodes()}
    steps = {g: to_steps(dag, order[g], keys, g) for g in groups}
    param_sets = _param_sets(dag)
    recompute = {n.region: n.recompute for n in dag.compute_nodes() if n.recompute}
    global_norm = any(n.value == GNORM for n in dag.of_kind(NodeKind.ALL_REDUCE))
    forward_only = not any(n.pass_ != "F" for n in dag.compute_nodes())
    tensor: dict[Group, dict[int, tuple[str | None, ...]]] = {}
    for n in dag.compute_nodes():
        tensor.setdefault(n.devices, {}).update(n.param_layout.tensor)
    flags = (param_sets, recompute, global_norm, forward_only)
    draft = Plans(meshes, zero_level, tensor, steps, *flags, [], {})
    steps = insert_frees(steps, draft.context(lifted))
    return finish_plans(meshes, zero_level, tensor, steps, *flags)


def _param_sets(dag: TrainingDAG) -> dict[str, tuple[int, ...]]:
    out = {}
    for n in dag.nodes.values():
        if n.kind is NodeKind.UPD:
            out[f"UPD{n.region}"] = n.params
        elif n.kind is NodeKind.ALL_REDUCE and n.value != GNORM:
            out[n.value] = n.params
        elif n.kind is NodeKind.REDUCE_SCATTER and "/" in n.value:
            out[n.value] = n.params
    return out


def to_instruction(dag: TrainingDAG, uid: int) -> Instruction:
    node = dag.nodes[uid]
    if node.kind is NodeKind.COMPUTE:
        return Instruction(RUN, node.compute_label())
    if node.kind is NodeKind.UPD:
        return Instruction(UPD, str(node.region))
    if node.kind is NodeKind.SEND:
        return Instruction(SEND, node.value, node.peer)
    if node.kind is NodeKind.RECV:
        return Instruction(RECV, node.value, node.peer)
    ops = {
        NodeKind.ALL_REDUCE: ALL_REDUCE,
        NodeKind.REDUCE_SCATTER: REDUCE_SCATTER,
        NodeKind.ALL_GATHER: ALL_GATHER,
        NodeKind.ALL_TO_ALL: ALL_TO_ALL,
    }
    if node.kind in ops:
        return Instruction(ops[node.kind], node.value, node.devices)
    raise PlanError(f"{node}: {node.kind.value} nodes are not supported by the runtime yet")


def to_steps(
    dag: TrainingDAG, uids: list[int], keys: Mapping[int, object], group: Group
) -> list[Step]:
    """The group's instructions, consecutive nodes of one unit as one step. A collective
    spanning other groups is never fused (its program runs on other devices too)."""
    steps: list[list[Instruction]] = []
    last_key = None
    for u in uids:
        ins = to_instruction(dag, u)
        fusable = ins.op not in (SEND, RECV) and dag.nodes[u].devices == group
        if steps and fusable and keys[u] == last_key:
            steps[-1].append(ins)
        else:
            steps.append([ins])
        last_key = keys[u] if fusable else None
    return [Step(tuple(s)) for s in steps]


def insert_frees(steps: Mapping[Group, list[Step]], ctx: bf.PlanContext) -> dict[Group, list[Step]]:
    """A FREE after the last step of a group that touches a value the store holds (a
    value written and read inside one fused step never reaches the store; residuals are
    consumed by the backward that reads them last; state lives on)."""
    out = {}
    for g, plan in steps.items():
        touched: dict[bf.Buffer, list[int]] = {}
        inside: set[bf.Buffer] = set()  # written by a program step (not an exchange)
        for i, step in enumerate(plan):
            for ins in step.instructions:
                acc = bf.access(ins, g, ctx)
                for b in acc.reads + acc.writes:
                    if b.kind is bf.Kind.VALUE:
                        touched.setdefault(b, []).append(i)
                if ins.op not in (SEND, RECV):
                    inside.update(b for b in acc.writes if b.kind is bf.Kind.VALUE)
        frees_after: dict[int, list[str]] = {}
        for b, where in touched.items():
            if b in inside and len(set(where)) == 1:
                continue  # made and used up inside one program
            frees_after.setdefault(where[-1], []).append(b.name)
        new = []
        for i, step in enumerate(plan):
            new.append(step)
            new += [Step((free(name),)) for name in sorted(frees_after.get(i, []))]
        out[g] = new
    return out
