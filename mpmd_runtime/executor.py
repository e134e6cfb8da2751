"""The MPMD executor of one process: binds every plan instruction of its own device groups
to a closure once, then runs a step as a flat loop over them in the dry run's global order.

The loop never blocks the host: every closure only dispatches (jitted programs,
transfers, dict moves), and JAX's asynchronous dispatch runs ahead of the devices. A
process skips the instructions of groups it holds no device of; a group may span
processes (its programs then run multi-controller SPMD on every process that holds part).
"""

from __future__ import annotations

import dataclasses
import time
from collections.abc import Callable, Mapping, Sequence
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
import optax
from jax.experimental import multihost_utils
from jax.tree_util import keystr
from piper_jax.ir.dag import Node, NodeKind, TrainingDAG, group_str
from piper_jax.ir.errors import PiperError
from piper_jax.ir.lift import LiftedLoss, Region
from piper_jax.mpmd_runtime import opt_layout, zero
from piper_jax.mpmd_runtime import programs as pg
from piper_jax.mpmd_runtime.instructions import ALL_REDUCE, FREE, RECV, RUN, SEND, UPD
from piper_jax.mpmd_runtime.plans import Group, Plans
from piper_jax.mpmd_runtime.simulator import TimelineEvent
from piper_jax.mpmd_runtime.transport import (
    Aval,
    from_local_shards,
    host_to_group,
    is_local,
    make_transfer,
    shards_by_device,
)
from piper_jax.mpmd_runtime.watchdog import StepWatchdog

Step = Callable[[], Any]


@dataclasses.dataclass(frozen=True)
class RunPart:
    """One pass of one region on one microbatch: read its inputs from the buffers, run
    `programs.mapped[program]`, write its outputs back (returning what to wait on)."""

    programs: pg.RegionPrograms
    program: str
    gather: Callable[[], tuple]
    scatter: Callable[[tuple, Any], Any]


class Executor:
    """Holds the parameters, optimizer state and buffers of this process's device groups."""

    def __init__(
        self,
        dag: TrainingDAG,
        plans: Plans,
        lifted: LiftedLoss,
        optimizer: optax.GradientTransformation,
        devices: Sequence[jax.Device],
        init_params: Sequence[Any],
        num_microbatches: int,
        global_norm: bool = False,
    ):
        self.dag, self.plans, self.lifted = dag, plans, lifted
        self.optimizer = optimizer
        self.global_norm = global_norm
        self.groups: list[Group] = sorted(plans.plans)
        self.meshes = {g: pg.group_mesh([devices[i] for i in g]) for g in self.groups}
        self.local = {
            g for g in self.groups if any(is_local(d) for d in self.meshes[g].devices.flat)
        }
        self.num_microbatches = num_microbatches
        self.num_replicas = len(self.groups[0])
        self.upd_nodes = [n for n in dag.of_kind(NodeKind.UPD) if n.devices in self.local]
        self.param_avals = {
            name: (tuple(np.shape(v)), np.asarray(v).dtype)
            for name, v in zip(lifted.param_names, init_params)
        }
        self.devices = list(devices)
        self.zero = {n.devices: n.zero for n in dag.compute_nodes()}
        self.params: dict[Group, dict[str, jax.Array]] = {g: {} for g in self.groups}
        for node in self.upd_nodes:
            g = node.devices
            for p in node.params:
                self.params[g][lifted.param_names[p]] = self._place_param(g, init_params[p])
        self.opt_state = {}
        for node in self.upd_nodes:
            g, mesh = node.devices, self.meshes[node.devices]
            init = (
                zero.init_program(optimizer, mesh, self.zero[g], global_norm)
                if self.zero[g]
                else pg.init_program(optimizer, mesh, global_norm)
            )
            self.opt_state[node.uid] = init(self._subset(g, node.params))
        self.acc = {g: self._zero_accumulators(g) for g in self.local}
        self.norm_total: dict[Group, jax.Array] = {}
        self.norm_params: dict[Group, list[str]] = {g: [] for g in self.groups}
        counted: set[str] = set()
        for node in dag.of_kind(NodeKind.UPD):  # each parameter counts once in the norm
            for p in node.params:
                name = lifted.param_names[p]
                if name not in counted:
                    counted.add(name)
                    self.norm_params[node.devices].append(name)
        self.reduced: dict[Group, dict[str, jax.Array]] = {g: {} for g in self.groups}
        self.stores: dict[Group, dict[str, Any]] = {g: {} for g in self.groups}
        self.mailbox: dict[tuple[str, Group], Any] = {}
        self.losses: list[jax.Array] = []
        self.batch_leaves = {
            g: sorted({b for r in self._regions_on(g) for b in r.batch_ids}) for g in self.local
        }
        loss_seed = 1.0 / (num_microbatches * self.num_replicas)
        modes = {}
        for n in dag.compute_nodes():
            if n.recompute:
                modes[n.region] = "recompute"
            elif n.pass_ in ("BI", "BW"):
                modes[n.region] = "split"
        self.cotangent_pass = {r: "BI" if m == "split" else "B" for r, m in modes.items()}
        self._programs = {
            (region.index, g): pg.RegionPrograms(
                region,
                lifted,
                self.meshes[g],
                loss_seed,
                modes.get(region.index, "plain"),
                self.zero[g],
            )
            for g in self.local
            for region in self._regions_on(g)
        }
        shapes = {n: shape for n, (shape, _) in self.param_avals.items()}
        self._update = {
            g: zero.update_program(optimizer, self.meshes[g], self.zero[g], shapes, global_norm)
            if self.zero[g]
            else pg.update_program(optimizer, self.meshes[g], global_norm)
            for g in self.local
        }
        self.loss_group = next(
            n.devices for n in dag.compute_nodes() if n.region == lifted.loss_region
        )
        self._mean_loss_program = jax.jit(
            lambda xs: jnp.mean(jnp.stack(xs)),
            out_shardings=pg.replicated(self.meshes[self.loss_group]),
        )
        self._position = 0
        self.fused: list[str] = []  # overlap units bound as one program, for explain()
        self._gather_programs: dict[Group, Callable] = {}
        self._witnesses: list[tuple[int, Any]] = []
        events = [(m, i) for m, i in plans.order if self._takes_part(m, i)]
        self.steps: list[Step] = [self._bind(members, index) for members, index in events]
        self.step_events = events

    def _place_param(self, g: Group, value: Any) -> jax.Array:
        """A parameter's initial value on group g: replicated, or as ZeRO-3 shards."""
        if self.zero[g] == 3:
            return host_to_group(
                zero.to_shards(np.asarray(value), len(g)), pg.stacked(self.meshes[g])
            )
        return host_to_group(value, pg.replicated(self.meshes[g]))

    def _zero_accumulators(self, g: Group) -> dict[str, jax.Array]:
        """Per-replica gradient accumulators: full, or the owned shard under ZeRO."""
        out = {}
        for name in self.params[g]:
            shape, dtype = self.param_avals[name]
            rows = (len(g), zero.shard_len(shape, len(g))) if self.zero[g] else (len(g),) + shape
            out[name] = host_to_group(np.zeros(rows, dtype), pg.stacked(self.meshes[g]))
        return out

    def host_param(self, g: Group, name: str) -> np.ndarray:
        """One parameter's full value on this host, read from group g."""
        value = self._host_value(g, self.params[g][name])
        if self.zero[g] == 3:
            return zero.from_shards(value, self.param_avals[name][0])
        return value

    def _host_value(self, g: Group, x: jax.Array) -> np.ndarray:
        """The whole of an array of group g on this host, also where it is stacked over
        devices of other processes (then the group replicates it in one program)."""
        if x.is_fully_addressable:
            return np.asarray(x)
        if x.sharding.is_fully_replicated:
            return np.asarray(x.addressable_shards[0].data)
        if g not in self._gather_programs:
            self._gather_programs[g] = jax.jit(
                lambda x: x, out_shardings=pg.replicated(self.meshes[g])
            )
        return np.asarray(self._gather_programs[g](x).addressable_shards[0].data)

    def memory(self) -> dict[int, dict[str, int]]:
        """Bytes per local device (index into the step's devices) held in parameters,
        gradient accumulators and optimizer state between steps."""
        index = {d: i for i, d in enumerate(self.devices)}
        out: dict[int, dict[str, int]] = {}
        kinds = {
            "params": [a for g in self.local for a in self.params[g].values()],
            "grads": [a for g in self.local for a in self.acc[g].values()],
            "opt_state": jax.tree.leaves(list(self.opt_state.values())),
        }
        for kind, arrays in kinds.items():
            for array in arrays:
                for shard in array.addressable_shards:
                    row = out.setdefault(index[shard.device], dict.fromkeys(kinds, 0))
                    row[kind] += shard.data.nbytes
        return out

    def residual_bytes(self, g: Group) -> int:
        """Per device of g: bytes of the largest residual set one F of g leaves for its
        backward (its VJP residuals, or its inputs under recompute)."""
        if g not in self.local:
            return 0
        best = 0
        for region in self._regions_on(g):
            programs = self._programs[(region.index, g)]
            n_p, n_b = len(region.param_ids), len(region.batch_ids)
            shapes = [jax.ShapeDtypeStruct(s, d) for s, d in region.in_shapes]
            stacked = [jax.ShapeDtypeStruct((len(g),) + s.shape, s.dtype) for s in shapes]
            params = [self.params[g][self.lifted.param_names[p]] for p in region.param_ids]
            _, res = jax.eval_shape(
                programs.forward, params, stacked[n_p : n_p + n_b], stacked[n_p + n_b :]
            )
            if programs.mode == "recompute":
                res = stacked[n_p:]
            best = max(best, sum(x.size * x.dtype.itemsize for x in jax.tree.leaves(res)))
        return best // len(g)

    def _regions_on(self, group: Group) -> list[Region]:
        regions = {n.region for n in self.dag.compute_nodes() if n.devices == group}
        return [self.lifted.regions[r] for r in sorted(regions)]

    def _subset(self, group: Group, params: Sequence[int]) -> dict[str, jax.Array]:
        names = self.lifted.param_names
        return {names[p]: self.params[group][names[p]] for p in params}

    def _takes_part(self, members: tuple[Group, ...], index: tuple[int, ...]) -> bool:
        if any(g in self.local for g in members):
            return True
        ins = self.plans.plans[members[0]][index[0]]
        return ins.op == SEND and ins.peer in self.local

    # ---- running a step -------------------------------------------------------------

    def run(self, batch_leaves: Sequence[np.ndarray]) -> None:
        """Dispatch every instruction of one step of this process."""
        self._stage_batch(batch_leaves)
        self.losses = []
        witnesses = self._witnesses = []
        i = 0
        try:
            for i, step in enumerate(self.steps):
                self._position = i
                out = step()
                if out is not None:
                    witnesses.append((i, out))
        except Exception as err:
            if not self._peers_of(i):
                raise
            raise PiperError(self._failure_message(i, f"failed: {err}")) from err

    def step(self, batch_leaves: Sequence[np.ndarray], timeout_s: float) -> float:
        """Run one step and return its loss, within `timeout_s` (see mpmd_runtime/watchdog.py)."""
        if jax.process_count() == 1:
            self.run(batch_leaves)
            return self.mean_loss()
        with StepWatchdog(timeout_s, lambda: self._stall_report(timeout_s)):
            self.run(batch_leaves)
            return self.mean_loss()

    def _stall_report(self, timeout_s: float) -> str:
        """The first unfinished instruction, read without blocking (watchdog thread)."""
        stuck = self._position
        for i, out in self._witnesses:
            if not all(x.is_deleted() or x.is_ready() for x in jax.tree.leaves(out)):
                stuck = min(stuck, i)
                break
        return self._failure_message(stuck, f"did not finish within {timeout_s:g} s")

    def wait(self) -> None:
        """Block until every instruction this process dispatched has finished. (A stalled
        peer is caught by the step watchdog, since the host may block in a collective.)"""
        leaves = [x for _, out in self._witnesses for x in jax.tree.leaves(out)]
        try:
            jax.block_until_ready([x for x in leaves if not x.is_deleted()])
        except Exception as err:  # a dispatched transfer or collective failed on the device
            index = self._first_failure()
            if index is None or not self._peers_of(index):
                raise
            raise PiperError(self._failure_message(index, f"failed: {err}")) from err

    def _first_failure(self) -> int | None:
        """The step position of the first dispatched instruction whose outputs failed."""
        for i, out in self._witnesses:
            try:
                jax.block_until_ready([x for x in jax.tree.leaves(out) if not x.is_deleted()])
            except Exception:
                return i
        return None

    def _peers_of(self, index: int) -> list[int]:
        """The other processes that instruction `index` of the step exchanges data with."""
        members, position = self.step_events[index]
        ins = self.plans.plans[members[0]][position[0]]
        groups = set(members) | ({ins.peer} if ins.op in (SEND, RECV) else set())
        return sorted(
            {d.process_index for g in groups for d in self.meshes[g].devices.flat}
            - {jax.process_index()}
        )

    def _failure_message(self, index: int, what: str, hint: str = "") -> str:
        members, position = self.step_events[index]
        ins = self.plans.plans[members[0]][position[0]]
        peers = ", ".join(f"process {p}" for p in self._peers_of(index)) or "no other process"
        return (
            f"process {jax.process_index()}: instruction '{ins}' on "
            f"{', '.join(group_str(g) for g in members)} {what}; it waits on {peers}, which "
            f"died or stalled: check that process's output{hint}"
        )

    def run_recorded(self, batch_leaves: Sequence[np.ndarray]) -> list[TimelineEvent]:
        """Run one step instruction by instruction, waiting for each to finish, and return
        when each ran (seconds from the start). For timelines and cost measurement only:
        it serialises the devices, so the step is slower than `run`."""
        self._stage_batch(batch_leaves)
        jax.block_until_ready(self.stores)
        self.losses = []
        events = []
        t0 = time.perf_counter()
        for step, (members, index) in zip(self.steps, self.step_events):
            start = time.perf_counter() - t0
            step()
            jax.block_until_ready((self.stores, self.acc, self.params, self.mailbox, self.reduced))
            end = time.perf_counter() - t0
            ins = self.plans.plans[members[0]][index[0]]
            if ins.op == FREE:
                continue
            kind = ins.pass_ if ins.op == RUN else ins.op
            for g in members:
                events.append(TimelineEvent(g, str(ins), kind, ins.microbatch, start, end))
        return events

    def mean_loss(self) -> float:
        """The step's loss (mean over microbatches and replicas), on every process."""
        self.wait()
        loss_group = self.loss_group
        value = np.float32(0.0)
        if loss_group in self.local:
            mean = self._mean_loss_program(self.losses)
            value = np.asarray(mean.addressable_shards[0].data, np.float32)
        if jax.process_count() == 1:
            return float(value)
        source = min(d.process_index for d in self.meshes[loss_group].devices.flat)
        try:
            out = multihost_utils.broadcast_one_to_all(
                value, is_source=jax.process_index() == source
            )
        except Exception as err:
            raise PiperError(
                f"process {jax.process_index()}: sharing the step's loss from process "
                f"{source} with all {jax.process_count()} processes failed ({err}); a peer "
                "died or stalled: check the other processes' output"
            ) from err
        return float(out)

    def gather_params(self) -> dict[str, np.ndarray]:
        """Every parameter's current value on the host of every process."""
        owner: dict[str, tuple[int, Group]] = {}
        for node in self.dag.of_kind(NodeKind.UPD):
            process = self._owner_process(node)
            for p in node.params:
                name = self.lifted.param_names[p]
                owner[name] = min(owner.get(name, (process, node.devices)), (process, node.devices))
        # every process holding part of the owning group reads it (ZeRO-3 shards are read
        # in one program of the whole group), in the same order on every process
        local = {n: self.host_param(g, n) for n, (_, g) in owner.items() if g in self.local}
        return self._share(
            {n: p for n, (p, _) in owner.items()}, local.__getitem__, self.param_avals
        )

    def optimizer_avals(self) -> dict[str, tuple[tuple[int, ...], Any]]:
        """{key path: (shape, dtype)} of `optimizer.init` of the whole model: the layout
        of `optimizer_state` (Note [portable optimizer state])."""
        return self._state_avals(self.lifted.param_names)

    def _state_avals(self, names: Sequence[str]) -> dict[str, tuple[tuple[int, ...], Any]]:
        shapes = {n: jax.ShapeDtypeStruct(*self.param_avals[n]) for n in names}
        leaves = jax.tree_util.tree_flatten_with_path(jax.eval_shape(self.optimizer.init, shapes))
        return {keystr(path): (leaf.shape, leaf.dtype) for path, leaf in leaves[0]}

    def optimizer_state(self) -> dict[str, np.ndarray]:
        """The optimizer state on the host of every process, in the single-device layout,
        keyed by key path (Note [portable optimizer state]). Refuses optimizers whose
        state does not split by parameter (e.g. optax.flatten keeps one vector per
        update), naming the leaf."""
        names, avals = self.lifted.param_names, self.optimizer_avals()
        owners: dict[str, int] = {}
        for node in self.dag.of_kind(NodeKind.UPD):  # the same checks on every process
            process = self._owner_process(node)
            for key, (shape, _) in self._state_avals([names[p] for p in node.params]).items():
                if key in avals and shape != avals[key][0]:
                    where = group_str(node.devices)
                    raise self._unportable(
                        key, f"is {list(shape)} on {where}, not {list(avals[key][0])}"
                    )
                owners[key] = min(owners.get(key, process), process)
        if owners.keys() != avals.keys():
            key = sorted(owners.keys() ^ avals.keys())[0]
            raise self._unportable(key, "is not held by the updates of the parameter groups")
        local: dict[str, np.ndarray] = {}
        for node in self.upd_nodes:
            g = node.devices
            state = opt_layout.to_full(
                self.opt_state[node.uid],
                self._node_shapes(node),
                self.zero[g],
                lambda x, g=g: self._host_value(g, x),
            )
            for key, value in state.items():
                if key in local and not np.array_equal(local[key], value):
                    raise self._unportable(key, "differs between the parameter groups")
                local[key] = value
        return self._share(owners, local.__getitem__, avals)

    def _unportable(self, key: str, what: str) -> PiperError:
        return PiperError(
            f"optimizer state leaf {key} {what}: this optimizer keeps state across "
            "parameters, so it cannot be saved in the single-device layout"
        )

    def _owner_process(self, node: Node) -> int:
        return min(d.process_index for d in self.meshes[node.devices].devices.flat)

    def _share(
        self,
        owners: Mapping[str, int],
        read: Callable[[str], np.ndarray],
        avals: Mapping[str, tuple[tuple[int, ...], Any]],
    ) -> dict[str, np.ndarray]:
        """{key: value} on every process: each value is read on the process that `owners`
        names and broadcast from there to the others."""
        out: dict[str, np.ndarray] = {}
        for process in sorted(set(owners.values())):
            keys = [k for k, p in owners.items() if p == process]
            mine = jax.process_index() == process
            values = {k: read(k) if mine else np.zeros(*avals[k]) for k in keys}
            if jax.process_count() > 1:
                values = multihost_utils.broadcast_one_to_all(values, is_source=mine)
            out.update({k: np.asarray(v) for k, v in values.items()})
        return out

    def load_state(
        self, params: Mapping[str, np.ndarray], opt_state: Mapping[str, np.ndarray]
    ) -> None:
        """Replace every parameter copy and the optimizer state with full-layout host values."""
        for g in self.local:
            for name in self.params[g]:
                value = np.asarray(params[name], self._param_dtype(name))
                self.params[g][name] = self._place_param(g, value)
        for node in self.upd_nodes:
            g = node.devices
            self.opt_state[node.uid] = opt_layout.from_full(
                opt_state,
                self.opt_state[node.uid],
                self._node_shapes(node),
                self.zero[g],
                self.meshes[g],
            )

    def _node_shapes(self, node: Node) -> dict[str, tuple[int, ...]]:
        return {
            self.lifted.param_names[p]: self._param_shape(self.lifted.param_names[p])
            for p in node.params
        }

    def _param_shape(self, name: str) -> tuple[int, ...]:
        return self.param_avals[name][0]

    def _param_dtype(self, name: str) -> Any:
        return self.param_avals[name][1]

    def _stage_batch(self, leaves: Sequence[np.ndarray]) -> None:
        m, r = self.num_microbatches, self.num_replicas
        for g in self.local:
            sharding = pg.stacked(self.meshes[g])
            needed = self.batch_leaves[g]
            split = {i: leaves[i].reshape((m, r, -1) + leaves[i].shape[1:]) for i in needed}
            for mb in range(m):
                self.stores[g][f"batch.{mb}"] = {
                    i: host_to_group(split[i][mb], sharding) for i in needed
                }

    # ---- binding instructions to closures -------------------------------------------

    def _bind(self, members: tuple[Group, ...], index: tuple[int, ...]) -> Step:
        g, i = members[0], index[0]
        ins = self.plans.plans[g][i]
        uid = self.plans.nodes[g][i]
        if ins.op == RUN:
            unit = self._overlap_unit(g, i)
            if unit and unit[0] != i:
                return lambda: None  # runs inside the fused program of its unit
            if len(unit) > 1:
                return self._bind_fused(g, unit)
            return self._bind_run(self._run_part(g, ins.pass_, ins.region, ins.microbatch))
        if ins.op == SEND:
            return self._bind_send(g, ins.buffer(), ins.peer)
        if ins.op == RECV:
            return self._bind_recv(g, ins.buffer())
        if ins.op == ALL_REDUCE and not self.dag.nodes[uid].params:
            return self._bind_norm(members)
        if ins.op == ALL_REDUCE:
            return self._bind_all_reduce(self.dag.nodes[uid], members)
        if ins.op == UPD:
            return self._bind_update(g, self.dag.nodes[uid])
        assert ins.op == FREE, ins
        store, label = self.stores[g], ins.buffer()
        return lambda: store.pop(label, None)

    # ---- compute: each pass is gather (inputs from the buffers) -> program -> scatter ----

    def _overlap_unit(self, g: Group, i: int) -> list[int]:
        """Plan positions of the overlap unit holding position i of g (see order.py)."""
        overlap = self.dag.nodes[self.plans.nodes[g][i]].overlap
        if overlap is None:
            return [i]
        start = i
        while start > 0 and self._overlap_at(g, start - 1) in (overlap, "free"):
            start -= 1
        unit = []
        for k in range(start, len(self.plans.plans[g])):
            uid = self.plans.nodes[g][k]
            if uid is None:
                continue
            if self.dag.nodes[uid].overlap != overlap:
                break
            unit.append(k)
        return unit

    def _overlap_at(self, g: Group, k: int) -> int | str | None:
        uid = self.plans.nodes[g][k]
        return "free" if uid is None else self.dag.nodes[uid].overlap

    def _bind_run(self, part: RunPart) -> Step:
        program = part.programs.jitted(part.program)

        def step() -> Any:
            args = part.gather()
            return part.scatter(args, program(*args))

        return step

    def _bind_fused(self, g: Group, unit: list[int]) -> Step:
        """An overlap unit as one XLA program, so XLA may interleave its passes. A BI and
        BW of one microbatch in the unit become that region's whole backward."""
        passes = [self.plans.plans[g][k] for k in unit]
        self.fused.append(f"{group_str(g)}: " + " + ".join(str(i) for i in passes))
        split = {(i.region, i.microbatch) for i in passes if i.pass_ == "BI"} & {
            (i.region, i.microbatch) for i in passes if i.pass_ == "BW"
        }
        parts = []
        for ins in passes:
            key = (ins.region, ins.microbatch)
            if key in split and ins.pass_ == "BW":
                continue
            pass_ = "B" if key in split else ins.pass_
            parts.append(self._run_part(g, pass_, ins.region, ins.microbatch))
        fns = [part.programs.mapped[part.program] for part in parts]
        cache: dict[tuple[int, ...], Callable] = {}

        def step() -> Any:
            args = [part.gather() for part in parts]
            sizes = tuple(len(a) for a in args)
            if sizes not in cache:
                offsets = [sum(sizes[:k]) for k in range(len(sizes))]
                donate = [o + d for o, (_, d) in zip(offsets, fns) if d is not None]

                def fused(*flat: Any) -> tuple:
                    return tuple(fn(*flat[o : o + n]) for (fn, _), o, n in zip(fns, offsets, sizes))

                cache[sizes] = jax.jit(fused, donate_argnums=tuple(donate))
            results = cache[sizes](*[x for a in args for x in a])
            return [part.scatter(a, out) for part, a, out in zip(parts, args, results)]

        return step

    def _run_part(self, g: Group, pass_: str, r: int, mb: int) -> RunPart:
        region = self.lifted.regions[r]
        programs, store = self._programs[(r, g)], self.stores[g]
        params, acc = self.params[g], self.acc[g]
        names = [self.lifted.param_names[p] for p in region.param_ids]
        res, cross = f"R{r}.{mb}", f"X{r}.{mb}"
        cot_inputs = self._cotangent_inputs(region, mb)
        recompute, gathered = programs.mode == "recompute", programs.zero == 3

        def cotangents() -> dict:
            return {c: store[k] for c, k in cot_inputs}

        def accumulated(args: tuple, new_acc: list) -> list:
            acc.update(zip(names, new_acc))
            return new_acc

        if pass_ == "F":
            acts = [(f"F{a.region}.{mb}", a.position) for a in region.act_inputs]
            label, batch = f"F{r}.{mb}", f"batch.{mb}"

            def gather() -> tuple:
                b = store.get(batch, {})
                return (
                    [params[n] for n in names],
                    [b[i] for i in region.batch_ids],
                    [store[k][pos] for k, pos in acts],
                )

            def scatter(args: tuple, out: Any) -> Any:
                if recompute:  # only the region inputs stay alive for the backward
                    store[label], store[res] = out, args[1:]
                else:
                    store[label], store[res] = out
                if region.loss_position is not None:
                    self.losses.append(store[label][region.loss_position])
                return store[label]

            return RunPart(programs, "F", gather, scatter)
        if pass_ == "B":
            label = f"{self.cotangent_pass.get(r, 'B')}{r}.{mb}"

            def gather() -> tuple:
                grads = [acc[n] for n in names]
                if recompute:
                    batch, acts = store.pop(res)
                    return ([params[n] for n in names], batch, acts, cotangents(), grads)
                if gathered:
                    return ([params[n] for n in names], store.pop(res), cotangents(), grads)
                return (store.pop(res), cotangents(), grads)

            def scatter(args: tuple, out: Any) -> Any:
                g_acts, new_acc = out
                store[label] = g_acts
                return accumulated(args, new_acc) or g_acts

            return RunPart(programs, "B", gather, scatter)
        if pass_ == "BI":
            label = f"BI{r}.{mb}"

            def scatter_bi(args: tuple, out: Any) -> Any:
                store[label], store[cross] = out
                return store[cross] or store[label]

            def gather_bi() -> tuple:
                shards = ([params[n] for n in names],) if gathered else ()
                return (*shards, store[res], cotangents())

            return RunPart(programs, "BI", gather_bi, scatter_bi)
        assert pass_ == "BW", pass_

        def gather_bw() -> tuple:
            shards = ([params[n] for n in names],) if gathered else ()
            return (*shards, store.pop(res), store.pop(cross), [acc[n] for n in names])

        return RunPart(programs, "BW", gather_bw, accumulated)

    def _cotangent_inputs(self, region: Region, mb: int) -> list[tuple[int, str]]:
        sources = pg.cotangent_sources(self.lifted, region)
        consumers = sorted({c for src in sources for c, _ in src})
        return [(c, f"{self.cotangent_pass.get(c, 'B')}{c}.{mb}") for c in consumers]

    def buffer_avals(self, label: str) -> list[Aval]:
        """Global shapes of a moved buffer, known statically on both sides of a transfer."""
        r = int(label.lstrip("FBIW").split(".")[0])
        region = self.lifted.regions[r]
        if label.startswith("F"):
            shapes = list(region.out_shapes)
        else:
            shapes = [
                self.lifted.regions[a.region].out_shapes[a.position]
                for a in region.act_inputs
                if self.lifted.regions[a.region].out_is_float(a.position)
            ]
        return [((self.num_replicas,) + tuple(s), d) for s, d in shapes]

    def _bind_send(self, g: Group, label: str, peer: Group) -> Step:
        transfer = make_transfer(self.meshes[g], self.meshes[peer], self.buffer_avals(label))
        store, mailbox, key = self.stores[g], self.mailbox, (label, peer)
        sending = g in self.local

        def step() -> None:
            out, witness = transfer(store[label] if sending else None)
            if out is not None:
                mailbox[key] = out
            return witness

        return step

    def _bind_recv(self, g: Group, label: str) -> Step:
        store, mailbox, key = self.stores[g], self.mailbox, (label, g)

        def step() -> None:
            store[label] = mailbox.pop(key)

        return step

    def _bind_all_reduce(self, node: Node, members: tuple[Group, ...]) -> Step:
        """Sum gradients over the member groups' devices. Full accumulators sum over every
        device into replicated gradients; ZeRO shards (already summed over each group's
        replicas) sum over groups, shard by shard, and stay sharded."""
        names = [self.lifted.param_names[p] for p in node.params]
        union = [d for g in members for d in self.meshes[g].devices.flat]
        mesh = pg.group_mesh(union)
        width = len(members[0])
        program = pg.all_reduce_program(mesh, groups=len(members) if node.zero else None)
        in_sharding = pg.stacked(mesh)
        local_members = [g for g in members if g in self.local]

        def out_sharding(g: Group) -> Any:
            return pg.stacked(self.meshes[g]) if node.zero else pg.replicated(self.meshes[g])

        if len(members) == 1:  # plain data parallelism: the accumulators are the input
            g = members[0]
            program = pg.all_reduce_program(self.meshes[g], groups=1 if node.zero else None)
            acc, reduced = self.acc[g], self.reduced[g]

            def step_one_group() -> list:
                totals = program([acc[n] for n in names])
                reduced.update(zip(names, totals))
                return totals

            return step_one_group

        def step() -> list:
            xs = []
            for n in names:
                shards = {}
                for g in local_members:
                    shards.update(shards_by_device(self.acc[g][n]))
                shape = (len(union),) + next(iter(shards.values())).shape[1:]
                xs.append(from_local_shards(shape, in_sharding, shards))
            totals = program(xs)
            for n, total in zip(names, totals):
                shards = shards_by_device(total)
                for g in local_members:
                    self.reduced[g][n] = from_local_shards(total.shape, out_sharding(g), shards)
            return totals

        assert not node.zero or all(len(g) == width for g in members)
        return step

    def _bind_norm(self, members: tuple[Group, ...]) -> Step:
        """The global squared gradient norm, on every group (see global_norm.py)."""
        union = [d for g in members for d in self.meshes[g].devices.flat]
        mesh = pg.group_mesh(union)
        program, in_sharding = pg.all_reduce_program(mesh), pg.stacked(mesh)
        local_members = [g for g in members if g in self.local]
        partial = {g: pg.square_norm_program(self.meshes[g]) for g in local_members}

        def grads_of(g: Group) -> list:
            return [self.reduced[g].get(n, self.acc[g][n]) for n in self.norm_params[g]]

        def step() -> list:
            shards = {}
            for g in local_members:
                shards.update(shards_by_device(partial[g](grads_of(g))))
            (total,) = program([from_local_shards((len(union),), in_sharding, shards)])
            for g in local_members:
                self.norm_total[g] = from_local_shards(
                    (), pg.replicated(self.meshes[g]), shards_by_device(total)
                )
            return [total]

        return step

    def _bind_update(self, g: Group, node: Node) -> Step:
        names = [self.lifted.param_names[p] for p in node.params]
        program, params, acc = self._update[g], self.params[g], self.acc[g]
        reduced, opt_state, uid = self.reduced[g], self.opt_state, node.uid
        norm_total, global_norm = self.norm_total, self.global_norm

        def step() -> None:
            grads = {n: reduced.pop(n) if n in reduced else acc[n] for n in names}
            extra = (norm_total[g],) if global_norm else ()
            new_params, opt_state[uid], zeros = program(
                {n: params[n] for n in names}, grads, opt_state[uid], *extra
            )
            params.update(new_params)
            acc.update(zeros)
            return new_params

        return step
