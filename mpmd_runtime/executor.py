"""The MPMD executor of one process: binds every step of its own device groups to a
closure once, then runs a training step as a flat loop over them in the plans' global
order.

The loop never blocks the host: every closure only dispatches (jitted programs,
transfers, dict moves), and JAX's asynchronous dispatch runs ahead of the devices. A
process skips the steps of groups it holds no device of; a group may span processes
(its programs then run multi-controller SPMD on every process that holds part).
"""

from __future__ import annotations

import collections
import dataclasses
import functools
import re
import time
import weakref
from collections.abc import Callable, Mapping, Sequence
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
import optax
from jax.experimental import multihost_utils
from jax.sharding import NamedSharding
from jax.sharding import PartitionSpec as P
from piper_jax.ir.errors import PiperError
from piper_jax.ir.layout import EP, group_str
from piper_jax.ir.lift import LiftedLoss, Region
from piper_jax.mpmd_runtime import binders, state
from piper_jax.mpmd_runtime import buffers as bf
from piper_jax.mpmd_runtime import programs as pg
from piper_jax.mpmd_runtime.compile_ahead import UnitCall, abstract, compile_ahead, default_workers
from piper_jax.mpmd_runtime.exchanges import exchange_sets
from piper_jax.mpmd_runtime.instructions import (
    ALL_GATHER,
    ALL_REDUCE,
    ALL_TO_ALL,
    FREE,
    GNORM,
    RECV,
    REDUCE_SCATTER,
    RUN,
    SEND,
    UPD,
    Instruction,
    Label,
    Step,
)
from piper_jax.mpmd_runtime.plans import Plans
from piper_jax.mpmd_runtime.replay import Event
from piper_jax.mpmd_runtime.same_programs import SamePrograms
from piper_jax.mpmd_runtime.simulator import TimelineEvent
from piper_jax.mpmd_runtime.transport import Aval, is_local, microbatch_stager
from piper_jax.mpmd_runtime.twins import twin_regions
from piper_jax.mpmd_runtime.updates import ParamTree, UpdateProgram
from piper_jax.mpmd_runtime.watchdog import FailureReport, StepWatchdog

Group = tuple[int, ...]
Closure = Callable[[], Any]


class Runtime:
    """What the binders need: the plans' facts, this process's meshes and stores, and
    the programs of its groups (built on first use, once)."""

    def __init__(
        self,
        plans: Plans,
        lifts: Mapping[Group, LiftedLoss],
        optimizer: optax.GradientTransformation,
        devices: Sequence[jax.Device],
        param_avals: Mapping[str, tuple[tuple[int, ...], Any]],
        param_tree: ParamTree,
        num_microbatches: int,
        carrier: bool,
        stores: dict[Group, dict[bf.Buffer, Any]] | None = None,
    ):
        self.plans, self.lifts, self.optimizer = plans, dict(lifts), optimizer
        self.param_avals, self.param_tree, self.carrier = dict(param_avals), param_tree, carrier
        self.param_index = {n: i for i, n in enumerate(param_avals)}
        self.num_microbatches = num_microbatches
        any_lift = next(iter(self.lifts.values()))
        self.ctx = plans.context(any_lift)
        self.groups: list[Group] = sorted(plans.steps)
        self.meshes = {
            g: pg.group_mesh([devices[i] for i in g], plans.meshes[g].axes) for g in self.groups
        }
        self.local = {
            g for g in self.groups if any(is_local(d) for d in self.meshes[g].devices.flat)
        }
        self.stores: dict[Group, dict[bf.Buffer, Any]] = stores or {g: {} for g in self.groups}
        self.mailbox: dict[tuple[str, Group], Any] = {}
        self._programs: dict[tuple[int, Group], pg.RegionPrograms] = {}
        self._updates: dict[tuple[int, Group], UpdateProgram] = {}
        self._twins: dict[Group, dict[int, int]] = {}
        # updates and optimizer inits of identical stages: Note [updates of identical stages]
        self.same_programs = SamePrograms()
        self.loss_seed = 1.0 / (num_microbatches * pg.replicas(self.meshes[self.loss_group]))

    @functools.cached_property
    def updates_held(self) -> collections.Counter:
        """How many parameter updates each group runs."""
        return collections.Counter(
            g for g, plan in self.plans.plans.items() for i in plan if i.op == UPD
        )

    @functools.cached_property
    def loss_group(self) -> Group:
        loss_region = next(iter(self.lifts.values())).loss_region
        return next(
            g
            for g, plan in self.plans.plans.items()
            for i in plan
            if i.op == RUN and i.pass_ == "F" and i.region == loss_region
        )

    def param_sharding(self, g: Group, name: str, stacked: bool = False) -> Any:
        """How a parameter (or, `stacked`, its per-replica accumulator) of group g lies on
        its mesh: split over `tp` or `ep` where `shard_tensor` or `shard` says so, else
        whole."""
        p = self.param_index[name]
        spec = self.plans.tensor.get(g, {}).get(p, ())
        return NamedSharding(self.meshes[g], P(*(((pg.AXIS,) if stacked else ()) + spec)))

    def placed_param(self, g: Group, name: str) -> jax.ShapeDtypeStruct:
        """A parameter as group g holds it whole (without ZeRO-3)."""
        shape, dtype = self.param_avals[name]
        return jax.ShapeDtypeStruct(shape, dtype, sharding=self.param_sharding(g, name))

    def acc_sharding(self, g: Group, name: str) -> Any:
        """How group g holds a parameter's gradient accumulator: a row per replica, split
        like the parameter, or under ZeRO-2/3 the replica's flat shard."""
        if self.ctx.zero_level[g] >= 2:
            return pg.stacked(self.meshes[g])
        return self.param_sharding(g, name, stacked=True)

    def param_shape(self, name: str) -> tuple[int, ...]:
        return self.param_avals[name][0]

    def param_dtype(self, name: str) -> Any:
        return self.param_avals[name][1]

    def experts(self, g: Group) -> int | None:
        """How many experts g's expert regions hold split over its `ep` axis (None: g
        holds no experts)."""
        names = self.lifts[g].param_names
        specs = self.plans.tensor.get(g, {})
        split = [p for p, spec in specs.items() if spec[0] == EP]
        return self.param_shape(names[split[0]])[0] if split else None

    def holds_experts(self, region: Region, g: Group) -> bool:
        specs = self.plans.tensor.get(g, {})
        return any(specs.get(p, (None,))[0] == EP for p in region.param_ids)

    def programs(self, region: int, g: Group) -> pg.RegionPrograms:
        """The programs of `region`'s passes on g: its first twin's (Note [twin regions
        share programs] in twins.py), which record their VJP's residuals once for all."""
        first = self.twins(g).get(region, region)
        if first != region:
            return self.programs(first, g)
        if (region, g) not in self._programs:
            lifted = self.lifts[g]
            self._programs[(region, g)] = pg.RegionPrograms(
                lifted.regions[region],
                lifted,
                self.meshes[g],
                self.loss_seed,
                self.ctx.recompute.get(region, ""),
                self.experts(g),
                self.holds_experts(lifted.regions[region], g),
            )
        return self._programs[(region, g)]

    def update_program(self, region: int, g: Group) -> UpdateProgram:
        if (region, g) not in self._updates:
            names = self.ctx.names(self.ctx.param_sets[f"UPD{region}"])
            self._updates[(region, g)] = UpdateProgram(
                self.optimizer,
                [(n, self.placed_param(g, n)) for n in names],
                self.meshes[g],
                self.ctx.zero_level[g],
                self.param_tree,
                self.carrier,
                guard=self.ctx.global_norm,
            )
        return self._updates[(region, g)]

    def buffer_avals(self, value: str, g: Group) -> list[Aval]:
        """Global shapes of a moved buffer on group g, stacked over g's replicas."""
        width = pg.replicas(self.meshes[g])
        return [((width,) + s, d) for s, d in bf.value_avals(self.lifts[g], value)]

    def regions_on(self, g: Group) -> list[int]:
        return sorted({i.region for i in self.plans.plans[g] if i.op == RUN})

    def twins(self, g: Group) -> dict[int, int]:
        """Each region g runs, mapped to its first twin (Note [twin regions share
        programs] in twins.py)."""
        if g not in self._twins:
            self._twins[g] = twin_regions(
                self.lifts[g],
                self.regions_on(g),
                self.ctx.recompute,
                self.plans.tensor.get(g, {}),
                lambda region: self.holds_experts(region, g),
            )
        return self._twins[g]


class Executor:
    """Runs the plans of this process's device groups, step after step."""

    def __init__(
        self,
        plans: Plans,
        lifts: Mapping[Group, LiftedLoss],
        optimizer: optax.GradientTransformation,
        devices: Sequence[jax.Device],
        init_params: Sequence[Any],
        param_tree: ParamTree,
        num_microbatches: int,
        carrier: bool = False,
        random_leaf: int | None = None,
        state_of: Executor | None = None,
    ):
        """`random_leaf`: the batch leaf the executor fills with each microbatch's and
        replica's random counter (step, microbatch, replica) instead of reading it from
        the batch (Note [random keys of a step] in piper_jax/rng.py). `state_of`: run on
        the parameters of another executor of the same groups (the forward-only plans of
        `TrainStep.evaluate`) instead of holding its own."""
        lifted = next(iter(lifts.values()))
        self.param_avals = {
            name: (tuple(np.shape(v)), np.asarray(v).dtype)
            for name, v in zip(lifted.param_names, init_params)
        }
        self.rt = rt = Runtime(
            plans,
            lifts,
            optimizer,
            devices,
            self.param_avals,
            param_tree,
            num_microbatches,
            carrier,
            stores=None if state_of is None else state_of.rt.stores,
        )
        self.plans, self.lifted, self.devices = plans, lifted, list(devices)
        if state_of is None:
            state.init_state(rt, dict(zip(lifted.param_names, init_params)))
        self.batch_leaves = {
            g: sorted({b for r in rt.regions_on(g) for b in rt.lifts[g].regions[r].batch_ids})
            for g in rt.local
        }
        self._stagers = {  # Note [staging a batch]
            g: microbatch_stager(pg.stacked(rt.meshes[g]), num_microbatches) for g in rt.local
        }
        self.random_leaf, self.steps_done = random_leaf, 0
        self.losses: list[jax.Array] = []
        self.grad_norm: jax.Array | None = None
        self._lockstep = _runs_in_lockstep(rt.meshes.values())
        self._in_flight: dict[Group, collections.deque] = collections.defaultdict(collections.deque)
        self._unit_programs: dict[tuple, Callable] = {}
        self._unit_args: dict[tuple, tuple[str, Any]] = {}  # key -> (step, argument avals)
        self._last_read: dict[Group, dict[bf.Buffer, int]] = {}
        self.step_events: list[Event] = [e for e in plans.order if self._takes_part(e)]
        # SENDs run as one program (Note [transfers that meet together]), by position in
        # `steps`: the first one's list of all, each later one's empty list
        self.exchanges = self._exchanges()
        self._units: dict[int, UnitCall] = {}  # by position in `steps`
        self._rewrite_in_place = rewrites_state_in_place(devices)
        self.steps: list[Closure] = [self._bind(i, e) for i, e in enumerate(self.step_events)]
        # the fused steps of several-device groups on XLA:CPU, by position: their group
        self._bounded = {
            i: unit.group
            for i, unit in self._units.items()
            if jax.default_backend() == "cpu" and rt.meshes[unit.group].size > 1
        }
        self.compile_workers = default_workers()  # Note [compiling ahead]
        self.compiled_ahead: int | None = None  # programs compiled ahead, after the first step
        self.failures = FailureReport(plans, rt.meshes, self.step_events, self.exchanges)
        self._witnesses: list[tuple[int, Witness]] = []
        self._position = 0
        self._mean_loss = jax.jit(
            lambda xs: jnp.mean(jnp.stack(xs)),
            out_shardings=pg.replicated(rt.meshes[rt.loss_group]),
        )

    def _takes_part(self, event: Event) -> bool:
        members, index = event
        if any(g in self.rt.local for g in members):
            return True
        head = self.plans.steps[members[0]][index[0]].head
        return head.op == SEND and tuple(head.peer) in self.rt.local

    def _exchanges(self) -> dict[int, list[int]]:
        processes = {
            g: frozenset(d.process_index for d in mesh.devices.flat)
            for g, mesh in self.rt.meshes.items()
        }
        local = {event: i for i, event in enumerate(self.step_events)}
        out: dict[int, list[int]] = {}
        for run in exchange_sets(self.plans.order, self.plans.steps, processes):
            positions = [local[self.plans.order[k]] for k in run if self.plans.order[k] in local]
            if positions:  # this process takes part in all of them or none
                out[positions[0]] = positions
                out.update({p: [] for p in positions[1:]})
        return out

    # ---- binding steps to closures --------------------------------------------------

    def _bind(self, position: int, event: Event) -> Closure:
        members, index = event
        g = members[0]
        step = self.plans.steps[g][index[0]]
        head = step.head
        if position in self.exchanges:
            return self._bind_exchange(self.exchanges[position])
        if len(members) > 1:
            closure = binders.bind_cross_reduce(self.rt, members, head)
        elif head.op in binders.EXCHANGES:
            closure = binders.EXCHANGES[head.op](self.rt, g, head)
        else:
            closure, self._units[position] = self._bind_unit(g, index[0], step)
        loss_group = self.rt.loss_group
        if (
            loss_group in members
            and loss_group in self.rt.local
            and any(i.op == ALL_REDUCE and i.value == GNORM for i in step.instructions)
        ):
            return self._keeping_grad_norm(closure, self.rt.stores[loss_group])
        return closure

    def _bind_exchange(self, positions: list[int]) -> Closure:
        """The first SEND of an exchange runs them all; the later ones nothing."""
        if not positions:
            return lambda: None
        sends = []
        for p in positions:
            (g,), (i,) = self.step_events[p]
            sends.append((g, self.plans.steps[g][i].head))
        return binders.bind_sends(self.rt, sends)

    def _keeping_grad_norm(self, closure: Closure, store: dict) -> Closure:
        """`closure`, then keep the squared global gradient norm it wrote, for metrics."""

        def run() -> Any:
            out = closure()
            self.grad_norm = store[bf.value(GNORM)]
            return out

        return run

    def _bind_unit(self, g: Group, position: int, step: Step) -> tuple[Closure, UnitCall]:
        """A step of one or more pieces as one jitted program (see Note [buffers of a
        device group]): its inputs are what its pieces read and no earlier piece wrote;
        it returns what later steps read and all state it wrote. Steps that differ only
        in their microbatches share one program (compiled once). Returns the closure and
        how it calls its program (for Note [compiling ahead])."""
        pieces = binders.step_pieces(self.rt, g, step.instructions)
        produced: dict[bf.Buffer, None] = {}
        inputs: list[bf.Buffer] = []
        consumed: set[bf.Buffer] = set()
        for piece in pieces:
            inputs += [b for b in piece.access.reads if b not in produced and b not in inputs]
            consumed |= piece.access.consumes
            produced.update(dict.fromkeys(piece.access.writes))
        last_read = self._last_reads(g)
        for_metrics = {bf.value(GNORM)}  # read by the step's metrics (_keeping_grad_norm)
        outputs = [
            b
            for b in produced
            if b.kind is not bf.Kind.VALUE or last_read.get(b, -1) > position or b in for_metrics
        ]
        # state read for the last time is donated: its buffers become the new state's
        donated = [b for b in inputs if b in consumed and b.kind in bf.PERSISTENT]
        if self._rewrite_in_place:  # Note [state keeps its buffers]
            donated += [b for b in inputs if b in produced and b.kind is bf.Kind.ACC]
            donated = list(dict.fromkeys(donated))
        kept = [b for b in inputs if b not in donated]
        key = _signature(g, step, pieces, self._twin_names(g), donated, kept, outputs)
        # Note [updates of identical stages]: one of several updates of the group
        same = self.rt.same_programs if _updates(step) and self.rt.updates_held[g] > 1 else None
        # ... which takes only the gradients it reads out of a bucket of several regions'
        picks = _kept_picks(pieces, kept) if same is not None else {}
        if key not in self._unit_programs:

            def program(donated_values: list, kept_values: list) -> list:
                env = dict(zip(donated, donated_values)) | dict(zip(kept, kept_values))
                env.update((b, dict(zip(positions, env[b]))) for b, positions in picks.items())
                for piece in pieces:
                    env.update(piece.fn(env))
                return [env[b] for b in outputs]

            program.__name__ = _program_name(step)
            self._unit_programs[key] = jax.jit(
                program, donate_argnums=(0,), keep_unused=same is not None
            )
        jitted = self._unit_programs[key]
        consumed_values = [b for b in kept if b in consumed]  # residuals: dropped after use
        store, losses = self.rt.stores[g], self.losses

        unit_args, programs = self._unit_args, self._unit_programs
        label = f"{group_str(g)}: {step}"

        def kept_values() -> list:
            if not picks:
                return [store[b] for b in kept]
            return [store[b] if b not in picks else [store[b][i] for i in picks[b]] for b in kept]

        def run() -> Any:
            args = ([store.pop(b) for b in donated], kept_values())
            if key not in unit_args:  # once per program, for `program_texts`
                unit_args[key] = (label, jax.tree.map(abstract, args))
                if same is not None:
                    programs[key] = same.resolve(programs[key], args, g)
            values = programs[key](*args)
            for b in consumed_values:
                store.pop(b, None)
            for b, v in zip(outputs, values):
                if b.kind is bf.Kind.LOSS:
                    losses.append(v)
                else:
                    store[b] = v
            return values

        return run, UnitCall(key, g, donated, kept, outputs, jitted, same, picks)

    def _twin_names(self, g: Group) -> Callable[[Instruction], Label | None]:
        """For a step's signature: the label of an instruction's pass as run by its
        region's first twin on g (Note [twin regions share programs]); None where the
        instruction is not named after a pass that twins share (an update, a transfer, a
        reduction over several regions, an all-to-all, a reduce-scatter of a bucket of a
        region's gradients). The gather and reduce-scatter serving a ZeRO pass move all
        of that region's parameters, by their shapes alone."""
        twins, param_sets = self.rt.twins(g), self.rt.ctx.param_sets

        def twin_name(ins: Instruction) -> Label | None:
            label = ins.label
            if label is None or ins.op not in (RUN, ALL_GATHER, REDUCE_SCATTER):
                return None
            if ins.op == REDUCE_SCATTER and ins.value in param_sets:  # a bucket
                return None
            return dataclasses.replace(label, region=twins.get(label.region, label.region))

        return twin_name

    def program_texts(self, optimized: bool = True) -> dict[str, str]:
        """The optimized HLO of every distinct program that has run, by the first plan
        step that ran it ("d0,1: F0.0 + B1.1"): to check what XLA made of a step, e.g.
        where it scheduled a collective; with `optimized=False`, the StableHLO piper-jax
        hands XLA, to check what it asked for."""
        texts = {}
        for key, (label, args) in self._unit_args.items():
            lowered = self._unit_programs[key].lower(*args)
            texts[label] = lowered.compile().as_text() if optimized else lowered.as_text()
        return texts

    def _last_reads(self, g: Group) -> dict[bf.Buffer, int]:
        """The last step of g that reads each buffer (values are written once)."""
        if g not in self._last_read:
            last: dict[bf.Buffer, int] = {}
            for i, step in enumerate(self.plans.steps[g]):
                for ins in step.instructions:
                    if ins.op != FREE:
                        last.update(dict.fromkeys(bf.access(ins, g, self.rt.ctx).reads, i))
            self._last_read[g] = last
        return self._last_read[g]

    # ---- running a step -------------------------------------------------------------

    def run(self, batch_leaves: Sequence[np.ndarray]) -> None:
        """Dispatch every step of this process for one training step."""
        self.losses.clear()  # first: the new batch and losses may take their buffers
        self.grad_norm = None
        self._stage_batch(batch_leaves)
        self._compile_ahead()
        witnesses = self._witnesses = []
        lockstep, bounded, in_flight = self._lockstep, self._bounded, self._in_flight
        i = 0
        try:
            for i, closure in enumerate(self.steps):
                self._position = i
                out = closure()
                if out is not None:
                    witness = _witness(out, weak=i in self._units)
                    witnesses.append((i, witness))
                    if lockstep:
                        jax.block_until_ready(out)
                    elif i in bounded:  # Note [in-process collectives ahead on XLA:CPU]
                        queue = in_flight[bounded[i]]
                        queue.append(witness)
                        if len(queue) > MAX_IN_FLIGHT:
                            _wait_for_oldest(queue)
        except Exception as err:
            if not self.failures.peers_of(i):
                raise
            raise PiperError(self.failures.message(i, f"failed: {err}")) from err

    def _compile_ahead(self) -> None:
        """Before the first step only (Note [compiling ahead])."""
        if self.compiled_ahead is None:
            self.compiled_ahead = compile_ahead(
                self.rt, self.plans, self.step_events, self._units, self.compile_workers
            )

    def step(self, batch_leaves: Sequence[np.ndarray], timeout_s: float) -> dict[str, float]:
        """Run one step and return its loss (and global gradient norm when the step
        computes it), within `timeout_s` (see mpmd_runtime/watchdog.py)."""
        if jax.process_count() == 1:
            self.run(batch_leaves)
            return self.metrics()
        with StepWatchdog(timeout_s, lambda: self._stall_report(timeout_s)):
            self.run(batch_leaves)
            return self.metrics()

    def _stall_report(self, timeout_s: float) -> str:
        return self.failures.stall_message(self._position, self._witnessed(), timeout_s)

    def _witnessed(self) -> list[tuple[int, list[jax.Array]]]:
        """Every dispatched step's outputs that are still alive, by step position."""
        return [(i, _alive(w)) for i, w in self._witnesses]

    def wait(self) -> None:
        """Block until every instruction this process dispatched has finished. (A stalled
        peer is caught by the step watchdog, since the host may block in a collective.)"""
        try:
            jax.block_until_ready([x for _, alive in self._witnessed() for x in alive])
        except Exception as err:  # a dispatched transfer or collective failed on the device
            index = self.failures.first_failure(self._witnessed())
            if index is None or not self.failures.peers_of(index):
                raise
            raise PiperError(self.failures.message(index, f"failed: {err}")) from err

    def metrics(self) -> dict[str, float]:
        """The step's loss (mean over microbatches and replicas) and, when computed, its
        global gradient norm (before clipping), on every process."""
        self.wait()
        rt = self.rt
        values = np.zeros(2, np.float32)
        values[1] = np.nan
        if rt.loss_group in rt.local:
            mean = self._mean_loss(self.losses)
            values[0] = np.asarray(mean.addressable_shards[0].data, np.float32)
            if self.grad_norm is not None:
                values[1] = np.sqrt(np.asarray(self.grad_norm.addressable_shards[0].data))
        if jax.process_count() > 1:
            values = self._share_from_loss_group(values)
        out = {"loss": float(values[0])}
        if rt.ctx.global_norm:
            out["grad_norm"] = float(values[1])
        return out

    def _share_from_loss_group(self, values: np.ndarray) -> np.ndarray:
        source = min(d.process_index for d in self.rt.meshes[self.rt.loss_group].devices.flat)
        try:
            return np.asarray(
                multihost_utils.broadcast_one_to_all(
                    values, is_source=jax.process_index() == source
                )
            )
        except Exception as err:
            raise PiperError(
                f"process {jax.process_index()}: sharing the step's loss from process "
                f"{source} with all {jax.process_count()} processes failed ({err}); a peer "
                "died or stalled: check the other processes' output"
            ) from err

    def _stage_batch(self, leaves: Sequence[np.ndarray]) -> None:
        """Every local group's batch leaves, per microbatch, stacked over its replicas;
        counts the step (the random counter's first entry)."""
        m = self.rt.num_microbatches
        for g in self.rt.local:
            width = pg.replicas(self.rt.meshes[g])
            needed = self.batch_leaves[g]
            split = [
                random_counters(self.steps_done, m, width)
                if i == self.random_leaf
                else leaves[i].reshape((m, width, -1) + leaves[i].shape[1:])
                for i in needed
            ]
            for mb, values in enumerate(self._stagers[g](split)):
                self.rt.stores[g][bf.batch(mb)] = dict(zip(needed, values))
        self.steps_done += 1

    def run_recorded(self, batch_leaves: Sequence[np.ndarray]) -> list[TimelineEvent]:
        """Run one step step by step, waiting for each to finish, and return when each
        ran (seconds from the start). For timelines and cost measurement only: it
        serialises the devices, so the step is slower than `run`.

        Each process records its own groups' steps. A transfer between processes runs at
        its SEND on both sides: a process that only receives records it as its group's
        RECV (the time its own devices spent on it), and no second RECV for the step that
        then takes the value from the mailbox. The SENDs of an exchange share its time
        in equal parts, in order (the simulator runs them one after the other)."""
        self._stage_batch(batch_leaves)
        self._compile_ahead()
        self._block_all()
        self.losses.clear()
        events: list[TimelineEvent] = []
        t0 = time.perf_counter()
        for position, closure in enumerate(self.steps):
            start = time.perf_counter() - t0
            out = closure()
            jax.block_until_ready(out)  # a transfer's witness: done on this process's side
            self._block_all()
            end = time.perf_counter() - t0
            parts = self.exchanges.get(position, [position])
            for k, p in enumerate(parts):
                share = (end - start) / len(parts)
                self._record(
                    events, self.step_events[p], start + k * share, start + (k + 1) * share
                )
        self.losses.clear()
        return events

    def _record(self, events: list[TimelineEvent], event: Event, start: float, end: float) -> None:
        """Add what step `event` ran on this process's groups from `start` to `end`."""
        members, index = event
        step = self.plans.steps[members[0]][index[0]]
        head = step.head
        if head.op == FREE or (head.op == RECV and tuple(head.peer) not in self.rt.local):
            return
        if head.op == SEND and members[0] not in self.rt.local:  # only receiving here
            receiver = tuple(head.peer)
            text = str(Instruction(RECV, head.value, members[0]))
            events.append(TimelineEvent(receiver, text, RECV, head.microbatch, start, end))
            return
        kind = head.pass_ if head.op == RUN else head.op
        for g in members:
            if g in self.rt.local:
                events.append(TimelineEvent(g, str(step), kind, head.microbatch, start, end))

    def host_costs(self, batch_leaves: Sequence[np.ndarray]) -> tuple[float, float]:
        """From one real step (which trains): the host's CPU seconds to issue a step that
        launches work (the median over this process's), and its seconds per step outside
        the plans: staging the batch before them and sharing the loss after (Note [the
        host issues the steps] in mpmd_runtime/simulator.py)."""
        issue_cpu: list[float] = []
        first_issue: list[float] = []

        def timed(closure: Closure) -> Closure:
            def run() -> Any:
                if not first_issue:
                    first_issue.append(time.perf_counter())
                cpu = time.thread_time()
                out = closure()
                if out is not None:
                    issue_cpu.append(time.thread_time() - cpu)
                return out

            return run

        steps, self.steps = self.steps, [timed(c) for c in self.steps]
        try:
            t0 = time.perf_counter()
            self.run(batch_leaves)
            self.wait()
            self._block_all()
            t1 = time.perf_counter()
            self.metrics()
            t2 = time.perf_counter()
        finally:
            self.steps = steps
        staging = (first_issue[0] if first_issue else t1) - t0
        return float(np.median(issue_cpu)) if issue_cpu else 0.0, staging + t2 - t1

    def _block_all(self) -> None:
        values = [list(store.values()) for store in self.rt.stores.values()]
        jax.block_until_ready((values, list(self.rt.mailbox.values())))

    # ---- state, for params(), checkpoints and memory --------------------------------

    def gather_params(self) -> dict[str, np.ndarray]:
        return state.gather_params(self.rt)

    def optimizer_avals(self) -> dict[str, tuple[tuple[int, ...], Any]]:
        return state.optimizer_avals(self.rt)

    def optimizer_state(self) -> dict[str, np.ndarray]:
        return state.optimizer_state(self.rt)

    def load_state(
        self, params: Mapping[str, np.ndarray], opt_state: Mapping[str, np.ndarray]
    ) -> None:
        state.load_state(self.rt, params, opt_state)

    def memory(self) -> dict[int, dict[str, int]]:
        return state.memory(self.rt, self.devices)

    def residual_bytes(self, g: Group) -> int:
        """Per device of g: bytes of the largest residual set one F of g leaves for its
        backward (its VJP residuals without parameters and what is computed from them
        alone, or its inputs under recompute)."""
        if g not in self.rt.local:
            return 0
        best = 0
        width = pg.replicas(self.rt.meshes[g])
        for r in self.rt.regions_on(g):
            programs = self.rt.programs(r, g)
            region = programs.region
            n_p, n_b = len(region.param_ids), len(region.batch_ids)
            shapes = [jax.ShapeDtypeStruct(s, d) for s, d in region.in_shapes]
            stacked = [jax.ShapeDtypeStruct((width,) + s.shape, s.dtype) for s in shapes]
            _, res = jax.eval_shape(
                programs.forward, shapes[:n_p], stacked[n_p : n_p + n_b], stacked[n_p + n_b :]
            )
            best = max(best, sum(x.size * x.dtype.itemsize for x in jax.tree.leaves(res)))
        return best // width


_MICROBATCH = re.compile(r"\.(\d+)")


# Note [state keeps its buffers]
# XLA:GPU runs a program as CUDA graphs recorded for the addresses of its buffers and
# updates a graph whenever one of them moved. An update writes fresh zeros into the
# gradient accumulators it read; kept apart, those zeros landed elsewhere each step, and
# every program that reads or writes an accumulator had its graphs updated on every step:
# on one H200, 6 ms of host time per step for a 12-layer GPT (more than launching the
# graphs), on the critical path at the start of a step. So off the CPU the update writes
# its zeros over the accumulators it read (donated), as every other program writes its
# state in place. On XLA:CPU, which has no graphs to update, that made XLA copy each
# accumulator first (three passes over it), so there the zeros are fresh.


# Note [in-process collectives ahead on XLA:CPU]
# XLA:CPU runs the devices' parts of a program with collectives on a pool of threads;
# with more than about 32 such programs of one device group dispatched and runnable at
# once, the parts of different programs took every thread while each waited for a
# partner part, and XLA aborted the process after 40 s (seen with ZeRO-3 over 2 devices
# and 64 microbatches, whose gathers all read only parameters and the batch). So the
# executor keeps at most MAX_IN_FLIGHT programs of each such group unfinished, waiting
# for the oldest before dispatching more: far enough ahead to keep the devices busy.
MAX_IN_FLIGHT = 16


# What tells when a dispatched step finished: its outputs. A fused step's are only
# referenced weakly: holding them kept every activation and residual of a step alive after
# its FREE, until the next step (1F1B held all its microbatches' residuals, as GPipe
# does); an output that was freed or donated was read by a later step, whose outputs
# tell when both finished. A transfer's or a reduction's are held: nothing else reads
# some of them, and a failed one must be found and named (mpmd_runtime/watchdog.py).
Witness = list[Any]  # jax.Array or weakref.ref to one


def _witness(out: Any, weak: bool) -> Witness:
    leaves = jax.tree.leaves(out)
    return [weakref.ref(x) for x in leaves] if weak else leaves


def _alive(witness: Witness) -> list[jax.Array]:
    arrays = (x() if isinstance(x, weakref.ref) else x for x in witness)
    return [x for x in arrays if x is not None and not x.is_deleted()]


def _wait_for_oldest(queue: collections.deque) -> None:
    """Block until the oldest step of `queue` (their witnesses, oldest first) finished;
    where none of its outputs is alive, until the next one that has some does."""
    while queue:
        alive = _alive(queue.popleft())
        if alive:
            jax.block_until_ready(alive)
            return


def _runs_in_lockstep(meshes: Any) -> bool:
    """Note [in-process collectives on XLA:CPU across processes]
    XLA:CPU runs the programs a process dispatched as their inputs become ready, on a
    small pool of threads, in no fixed order per device. In a run of several processes,
    a program with collectives among several devices (an all-to-all over ep, a ZeRO
    reduce-scatter) can then wait for a thread held by a transfer to another process,
    which waits for this process: a hang (seen on 2 cores with all-to-alls, also when
    only those programs were waited for, and a gloo timeout in a reduce-scatter). There,
    every instruction is waited for before the next is dispatched, which the plans'
    lockstep order makes safe. Runs whose groups are all single devices, and every run
    in one process or on GPU, dispatch ahead."""
    return (
        jax.process_count() > 1
        and jax.default_backend() == "cpu"
        and any(mesh.size > 1 for mesh in meshes)
    )


def _signature(
    g: Group,
    step: Step,
    pieces: Sequence[binders.Piece],
    twin_name: Callable[[Instruction], Label | None],
    *buffers: Sequence[bf.Buffer],
) -> tuple:
    """What a fused step computes, up to its microbatches (renumbered in order of
    appearance) and up to which of twin regions its passes run (`twin_name`, Note [twin
    regions share programs] in twins.py): steps with one signature can run one compiled
    program. Buffers count by where the step's pieces first read or write them, not by
    name, so that `buffers` (its inputs and outputs) line up between such steps."""
    seen: dict[str, int] = {}

    def renumbered(text: str) -> str:
        return _MICROBATCH.sub(lambda m: f".#{seen.setdefault(m.group(1), len(seen))}", text)

    instructions = []
    for ins in step.instructions:
        twin = twin_name(ins)
        text = str(ins) if twin is None else str(ins).replace(str(ins.label), str(twin), 1)
        instructions.append(renumbered(text))
    role: dict[bf.Buffer, tuple] = {}
    wiring = []
    for k, piece in enumerate(pieces):
        for side, group in (("r", piece.access.reads), ("w", piece.access.writes)):
            for j, b in enumerate(group):
                role.setdefault(b, (b.kind.value, k, side, j))
        wiring.append(
            (
                tuple(role[b] for b in piece.access.reads),
                tuple(role[b] for b in piece.access.writes),
                tuple(sorted(role[b] for b in piece.access.consumes if b in role)),
            )
        )
    keyed = (tuple(instructions), tuple(wiring))
    return (g, *keyed, *(tuple(role[b] for b in group) for group in buffers))


def rewrites_state_in_place(devices: Sequence[jax.Device]) -> bool:
    """Note [state keeps its buffers]."""
    return devices[0].platform != "cpu"


_SHORT = {ALL_REDUCE: "AR", REDUCE_SCATTER: "RS", ALL_GATHER: "AG", ALL_TO_ALL: "A2A"}
_NAME_LENGTH = 60  # JAX's compilation cache names its files after the program


def _updates(step: Step) -> bool:
    return any(i.op == UPD for i in step.instructions)


def _kept_picks(
    pieces: Sequence[binders.Piece], kept: Sequence[bf.Buffer]
) -> dict[bf.Buffer, tuple[int, ...]]:
    """The positions a step reads of each kept list-valued buffer that all its readers
    read only part of (`Piece.picks`)."""
    out = {}
    for b in kept:
        readers = [p for p in pieces if b in p.access.reads]
        if readers and all(b in p.picks for p in readers):
            out[b] = tuple(sorted({i for p in readers for i in p.picks[b]}))
    return out


def _program_name(step: Step) -> str:
    """A fused step's program name, its instructions without microbatches or operands
    ("F0_B0_AR_UPD0" for "F0.3 + B0.3 + ALL_REDUCE gnorm d0 + UPD0"): what XLA's dumps and
    the profiler's trace call the program."""
    parts = [
        _MICROBATCH.sub("", str(i.label)) if i.op == RUN else _SHORT.get(i.op, f"{i.op}{i.value}")
        for i in step.instructions
    ]
    name = re.sub(r"\W+", "_", "_".join(parts)).strip("_")
    return name if len(name) <= _NAME_LENGTH else name[: _NAME_LENGTH - 4] + "_etc"


def random_counters(step: int, num_microbatches: int, width: int) -> np.ndarray:
    """(microbatches, replicas, 3) random counters (step, microbatch, replica) of one step
    on a group of `width` replicas (Note [random keys of a step] in piper_jax/rng.py)."""
    out = np.zeros((num_microbatches, width, 3), np.uint32)
    out[..., 0] = step
    out[..., 1] = np.arange(num_microbatches)[:, None]
    out[..., 2] = np.arange(width)[None, :]
    return out
