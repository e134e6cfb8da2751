"""The MPMD executor of one process: binds every plan instruction to a closure once, then
runs a step as a flat loop over them in the dry run's global order.

The loop never blocks the host: every closure only dispatches (jitted programs,
device_put, dict moves), and JAX's asynchronous dispatch runs ahead of the devices.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Any

import jax
import numpy as np
import optax
from piper_jax.ir.dag import NodeKind, TrainingDAG
from piper_jax.ir.lift import LiftedLoss
from piper_jax.mpmd_runtime import programs as pg
from piper_jax.mpmd_runtime.instructions import ALL_REDUCE, FREE, RECV, RUN, SEND, UPD
from piper_jax.mpmd_runtime.plans import Group, Plans

Step = Callable[[], None]


class Executor:
    """Holds the parameters, optimizer state and buffers of every local device group."""

    def __init__(
        self,
        dag: TrainingDAG,
        plans: Plans,
        lifted: LiftedLoss,
        optimizer: optax.GradientTransformation,
        devices: Sequence[jax.Device],
        init_params: Sequence[Any],
        num_microbatches: int,
    ):
        self.dag, self.plans, self.lifted = dag, plans, lifted
        self.groups: list[Group] = sorted(plans.plans)
        self.meshes = {g: pg.group_mesh([devices[i] for i in g]) for g in self.groups}
        self.num_microbatches = num_microbatches
        self.num_replicas = len(self.groups[0])
        names = lifted.param_names
        self.upd_nodes = list(dag.of_kind(NodeKind.UPD))
        self.params: dict[Group, dict[str, jax.Array]] = {g: {} for g in self.groups}
        for node in self.upd_nodes:
            sharding = pg.replicated(self.meshes[node.devices])
            for p in node.params:
                self.params[node.devices][names[p]] = jax.device_put(init_params[p], sharding)
        self.opt_state = {
            node.uid: jax.jit(
                optimizer.init, out_shardings=pg.replicated(self.meshes[node.devices])
            )(self._subset(node.devices, node.params))
            for node in self.upd_nodes
        }
        self.acc = {g: pg.zeros_program(self.meshes[g])(self.params[g]) for g in self.groups}
        self.reduced: dict[Group, dict[str, jax.Array]] = {g: {} for g in self.groups}
        self.stores: dict[Group, dict[str, Any]] = {g: {} for g in self.groups}
        self.mailbox: dict[tuple[str, Group], Any] = {}
        self.losses: list[jax.Array] = []
        self.batch_leaves = {
            g: sorted({b for r in self._regions_on(g) for b in r.batch_ids}) for g in self.groups
        }
        loss_seed = 1.0 / (num_microbatches * self.num_replicas)
        self._forward = {}
        self._backward = {}
        for g in self.groups:
            for region in self._regions_on(g):
                key = (region.index, g)
                self._forward[key] = pg.forward_program(region, lifted, self.meshes[g])
                self._backward[key] = pg.backward_program(region, lifted, self.meshes[g], loss_seed)
        self._update = {g: pg.update_program(optimizer, self.meshes[g]) for g in self.groups}
        self.steps: list[Step] = [self._bind(members, index) for members, index in plans.order]

    def _regions_on(self, group: Group) -> list:
        regions = {n.region for n in self.dag.compute_nodes() if n.devices == group}
        return [self.lifted.regions[r] for r in sorted(regions)]

    def _subset(self, group: Group, params: Sequence[int]) -> dict[str, jax.Array]:
        names = self.lifted.param_names
        return {names[p]: self.params[group][names[p]] for p in params}

    # ---- running a step -------------------------------------------------------------

    def run(self, batch_leaves: Sequence[np.ndarray]) -> list[jax.Array]:
        """Run every instruction of one step; returns the per-microbatch loss arrays."""
        self._stage_batch(batch_leaves)
        self.losses = []
        for step in self.steps:
            step()
        return self.losses

    def _stage_batch(self, leaves: Sequence[np.ndarray]) -> None:
        m, r = self.num_microbatches, self.num_replicas
        for g in self.groups:
            sharding = pg.stacked(self.meshes[g])
            needed = self.batch_leaves[g]
            if not needed:
                continue
            split = {i: leaves[i].reshape((m, r, -1) + leaves[i].shape[1:]) for i in needed}
            for mb in range(m):
                self.stores[g][f"batch.{mb}"] = {
                    i: jax.device_put(split[i][mb], sharding) for i in needed
                }

    # ---- binding instructions to closures -------------------------------------------

    def _bind(self, members: tuple[Group, ...], index: tuple[int, ...]) -> Step:
        g, i = members[0], index[0]
        ins = self.plans.plans[g][i]
        uid = self.plans.nodes[g][i]
        if ins.op == RUN:
            if ins.pass_ == "F":
                return self._bind_forward(g, ins.region, ins.microbatch)
            return self._bind_backward(g, ins.region, ins.microbatch)
        if ins.op == SEND:
            return self._bind_send(g, ins.buffer(), ins.peer)
        if ins.op == RECV:
            return self._bind_recv(g, ins.buffer())
        if ins.op == ALL_REDUCE:
            return self._bind_all_reduce(self.dag.nodes[uid], members)
        if ins.op == UPD:
            return self._bind_update(g, self.dag.nodes[uid])
        assert ins.op == FREE, ins
        store, label = self.stores[g], ins.buffer()
        return lambda: store.pop(label, None)

    def _bind_forward(self, g: Group, r: int, mb: int) -> Step:
        region = self.lifted.regions[r]
        program, store, params = self._forward[(r, g)], self.stores[g], self.params[g]
        names = [self.lifted.param_names[p] for p in region.param_ids]
        acts = [(f"F{a.region}.{mb}", a.position) for a in region.act_inputs]
        label, res, batch = f"F{r}.{mb}", f"R{r}.{mb}", f"batch.{mb}"
        loss_pos = region.loss_position

        def step() -> None:
            b = store.get(batch, {})
            outs, vjp = program(
                [params[n] for n in names],
                [b[i] for i in region.batch_ids],
                [store[k][pos] for k, pos in acts],
            )
            store[label], store[res] = outs, vjp
            if loss_pos is not None:
                self.losses.append(outs[loss_pos])

        return step

    def _bind_backward(self, g: Group, r: int, mb: int) -> Step:
        region = self.lifted.regions[r]
        program, store, acc = self._backward[(r, g)], self.stores[g], self.acc[g]
        names = [self.lifted.param_names[p] for p in region.param_ids]
        sources = pg.cotangent_sources(self.lifted, region)
        consumers = sorted({c for src in sources for c, _ in src})
        label, res = f"B{r}.{mb}", f"R{r}.{mb}"

        def step() -> None:
            cots = {c: store[f"B{c}.{mb}"] for c in consumers}
            g_acts, new_acc = program(store.pop(res), cots, [acc[n] for n in names])
            store[label] = g_acts
            acc.update(zip(names, new_acc))

        return step

    def _bind_send(self, g: Group, label: str, peer: Group) -> Step:
        store, sharding = self.stores[g], pg.stacked(self.meshes[peer])
        mailbox, key = self.mailbox, (label, peer)

        def step() -> None:
            mailbox[key] = jax.device_put(store[label], sharding)

        return step

    def _bind_recv(self, g: Group, label: str) -> Step:
        store, mailbox, key = self.stores[g], self.mailbox, (label, g)

        def step() -> None:
            store[label] = mailbox.pop(key)

        return step

    def _bind_all_reduce(self, node: Any, members: tuple[Group, ...]) -> Step:
        names = [self.lifted.param_names[p] for p in node.params]
        union_devices = [d for g in members for d in self.meshes[g].devices.flat]
        mesh = pg.group_mesh(union_devices)
        program = pg.all_reduce_program(mesh)
        in_sharding = pg.stacked(mesh)

        def step() -> None:
            xs = []
            for n in names:
                shards = {
                    s.device: s.data for g in members for s in self.acc[g][n].addressable_shards
                }
                shape = (len(union_devices),) + shards[union_devices[0]].shape[1:]
                xs.append(
                    jax.make_array_from_single_device_arrays(
                        shape, in_sharding, [shards[d] for d in union_devices]
                    )
                )
            for n, total in zip(names, program(xs)):
                shards = {s.device: s.data for s in total.addressable_shards}
                for g in members:
                    mesh_g = self.meshes[g]
                    self.reduced[g][n] = jax.make_array_from_single_device_arrays(
                        total.shape, pg.replicated(mesh_g), [shards[d] for d in mesh_g.devices.flat]
                    )

        return step

    def _bind_update(self, g: Group, node: Any) -> Step:
        names = [self.lifted.param_names[p] for p in node.params]
        program, params, acc, reduced = (
            self._update[g],
            self.params[g],
            self.acc[g],
            self.reduced[g],
        )
        opt_state, uid = self.opt_state, node.uid

        def step() -> None:
            grads = {n: reduced.pop(n) if n in reduced else acc[n] for n in names}
            new_params, opt_state[uid], zeros = program(
                {n: params[n] for n in names}, grads, opt_state[uid]
            )
            params.update(new_params)
            acc.update(zeros)

        return step
