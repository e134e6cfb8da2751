"""The optimizer update of one parameter group (a UPD instruction) on its device group.

The optimizer sees the parameters as the model's own tree, cut to the group's leaves
(paths unchanged), so transforms that select parameters by path (`optax.masked`,
`multi_transform`, adamw's mask) treat every leaf as single-device training would.
Under ZeRO each replica updates its flat shards of those leaves (Note [ZeRO in
piper-jax]). With the non-finite guard, an update whose global gradient norm is not
finite leaves parameters and optimizer state as they were.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Any

import jax
import jax.numpy as jnp
import optax
from jax.sharding import Mesh
from jax.sharding import PartitionSpec as P
from piper_jax.ir.errors import PiperError
from piper_jax.mpmd_runtime import zero
from piper_jax.mpmd_runtime.global_norm import CARRIER, carrier_gradient
from piper_jax.mpmd_runtime.programs import AXIS, replicas, replicated, spmd, stack, unstack
from piper_jax.mpmd_runtime.same_programs import SamePrograms

# (parameter names, with carrier?) -> (treedef of the model's tree cut to those leaves
# (plus the carrier), the names in the tree's leaf order)
ParamTree = Callable[[Sequence[str], bool], tuple[Any, list[str]]]


class UpdateProgram:
    """init and update of one parameter group: plain (replicated) or ZeRO (shards).

      init(params)                             -> optimizer state leaves
      update(params, grads, state[, total_sq]) -> (params, state leaves)

    The optimizer state travels as its flat leaves (`state_tree` puts them back into
    optax's tree): its tree holds a flax Variable per moment, and flattening and rebuilding
    those in Python around every update cost more host time than dispatching it (~300
    Variables for a 12-layer GPT).

    `params` and `grads` are lists in `names` order. Plain: parameters and gradients
    whole (replicated, or split over tp or ep as `params` lie), and the state laid out
    like them. ZeRO level 2: parameters whole, gradients the replica's shards stacked
    over dp, and the update returns the updated shards; level 3: parameters are shards
    too.
    """

    def __init__(
        self,
        optimizer: optax.GradientTransformation,
        params: Sequence[tuple[str, jax.ShapeDtypeStruct]],
        mesh: Mesh,
        zero_level: int,
        param_tree: ParamTree,
        carrier: bool,
        guard: bool,
    ):
        """`params`: the group's parameters by name, as placed (with their shardings)."""
        self.optimizer, self.names, self.mesh = optimizer, [n for n, _ in params], mesh
        self.zero_level, self.carrier, self.guard = zero_level, carrier, guard
        self.treedef, self.tree_names = param_tree(self.names, carrier)
        if zero_level:
            params_spec = P(AXIS) if zero_level >= 3 else P()
            self._init = jax.jit(
                spmd(self._init_shards, mesh, (params_spec,), P(AXIS)), keep_unused=True
            )
            extra = (P(),) if carrier or guard else ()
            self._update = spmd(
                self._update_shards,
                mesh,
                (params_spec, P(AXIS), P(AXIS)) + extra,
                (P(AXIS), P(AXIS)),
            )
        else:
            self.param_layout = [p.sharding for _, p in params]
            self.state_layout = self._state_layout([p for _, p in params])
            self._init = jax.jit(
                self._init_whole, out_shardings=self.state_layout, keep_unused=True
            )
            self._update = self._update_whole
        self.state_treedef: Any = None  # known once init ran

    def init(self, params: list, same: SamePrograms | None = None) -> list[jax.Array]:
        """The optimizer state's leaves for `params`; with `same`, by the init program of
        earlier parameters of the same mesh where it is the same program (Note [updates
        of identical stages])."""
        if same is None:
            leaves, self.state_treedef = jax.tree.flatten(self._init(params))
            return leaves
        devices = tuple(d.id for d in self.mesh.devices.flat)
        init = same.resolve(self._init, [params], devices)
        # the shared program's outputs in this group's own tree (its paths)
        self.state_treedef = jax.tree.structure(jax.eval_shape(self._init, params))
        return jax.tree.leaves(init(params))

    def state_tree(self, leaves: Sequence[Any]) -> Any:
        return jax.tree.unflatten(self.state_treedef, leaves)

    def update(self, params: list, grads: list, state: list, *total_sq: Any) -> tuple:
        new_params, new_state = self._update(params, grads, self.state_tree(state), *total_sq)
        leaves, treedef = jax.tree.flatten(new_state)
        if treedef != self.state_treedef:  # while tracing: costs nothing per step
            raise PiperError(
                f"the optimizer's update returned its state as {treedef}, not as its init "
                f"made it ({self.state_treedef}): piper-jax needs the same structure"
            )
        return new_params, leaves

    def _tree(self, values: Sequence[jax.Array], carrier: jax.Array) -> Any:
        by_name = dict(zip(self.names, values))
        by_name[CARRIER] = carrier
        return jax.tree_util.tree_unflatten(self.treedef, [by_name[n] for n in self.tree_names])

    def _leaves(self, tree: Any) -> list[jax.Array]:
        by_name = dict(zip(self.tree_names, jax.tree_util.tree_leaves(tree)))
        return [by_name[n] for n in self.names]

    def _init_whole(self, params: list) -> Any:
        return self.optimizer.init(self._tree(params, jnp.zeros((), jnp.float32)))

    def _state_layout(self, params: list[jax.ShapeDtypeStruct]) -> Any:
        """Where the plain update keeps the optimizer state: each moment like its
        parameter, the rest replicated. Fixed here, not left to XLA, so that the state
        lies the same before and after every update and each update program compiles
        once: left to jit, moments came out of init uncommitted on one device and out of
        the first update split over tp also for whole parameters."""
        everywhere = replicated(self.mesh)
        try:
            return optax.tree_utils.tree_map_params(
                self.optimizer,
                lambda _, sharding: sharding,
                jax.eval_shape(self._init_whole, params),
                self._tree([p.sharding for p in params], everywhere),
                transform_non_params=lambda _: everywhere,
            )
        except Exception:  # noqa: BLE001 - an init that computes on its parameters
            # (optax.flatten) cannot run on the placeholders that find the moments
            return everywhere

    def _init_shards(self, params: list) -> Any:
        return stack(self._init_whole(self._own(params)))

    def _own(self, params: list) -> list:
        """This replica's shards of the parameters (inside shard_map)."""
        if self.zero_level >= 3:
            return [p[0] for p in params]
        return [zero.own_shard(p, replicas(self.mesh))[0] for p in params]

    def _step(self, params: list, grads: list, state: Any, total_sq: Any) -> tuple:
        def update(params: list, grads: list, state: Any) -> tuple:
            zero_ = jnp.zeros((), jnp.float32)
            grads = [g.astype(p.dtype) for p, g in zip(params, grads)]
            carrier = carrier_gradient(total_sq, grads) if self.carrier else zero_
            p_tree = self._tree(params, zero_)
            updates, new_state = self.optimizer.update(self._tree(grads, carrier), state, p_tree)
            return self._leaves(optax.apply_updates(p_tree, updates)), new_state

        if not self.guard:
            return update(params, grads, state)
        # a conditional, not a select between new and old values: selecting made XLA copy
        # every (donated) optimizer moment before updating it in place
        return jax.lax.cond(
            jnp.isfinite(total_sq), update, lambda p, g, s: (list(p), s), params, grads, state
        )

    def _update_whole(self, params: list, grads: list, state: Any, total_sq: Any = None) -> tuple:
        new, new_state = self._step(params, grads, state, total_sq)
        constrain = jax.lax.with_sharding_constraint
        return constrain(new, self.param_layout), constrain(new_state, self.state_layout)

    def _update_shards(self, params: list, grads: list, state: Any, total_sq: Any = None) -> tuple:
        shards = self._own(params)
        new, new_state = self._step(shards, [g[0] for g in grads], unstack(state), total_sq)
        return [s[None] for s in new], stack(new_state)
