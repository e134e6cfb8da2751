"""pjit baselines: the same model, loss and optimizer as ONE `jax.jit` training step.

These are what piper-jax is measured against: plain SPMD data parallelism ("dp": params
and optimizer state replicated, batch sharded on axis 0) and fully sharded data
parallelism ("fsdp": params and optimizer state sharded too, XLA inserts the gathers and
reduce-scatters). Both run on a 1-D mesh ("data",) over the given devices.

    step = pjit_step(loss_fn, model, optax.adamw(1e-3), batch, jax.devices()[:4], "fsdp")
    step(batch)       # {"loss": float}
    step.params()     # nnx.State of host numpy arrays
    step.memory()     # {"params": bytes, "opt_state": bytes}, per device (max)
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Any

import jax
import numpy as np
import optax
from flax import nnx
from jax.sharding import Mesh, NamedSharding, PartitionSpec

from piper_jax.batching import check_batch_size
from piper_jax.directives.tensor import module_partition
from piper_jax.ir.errors import BatchError, DirectiveError
from piper_jax.ir.layout import TP
from piper_jax.param_tree import leaf_name

STRATEGIES = ("dp", "fsdp", "tp")
AXIS = "data"


def fsdp_spec(shape: Sequence[int], mesh_size: int) -> PartitionSpec:
    """Shard the largest axis divisible by `mesh_size` over the data axis; else replicate.

    Ties go to the first such axis; scalars and axes that do not divide stay replicated.
    """
    best = None
    for axis, size in enumerate(shape):
        if size % mesh_size == 0 and size >= mesh_size and (best is None or size > shape[best]):
            best = axis
    if best is None:
        return PartitionSpec()
    return PartitionSpec(*(AXIS if a == best else None for a in range(len(shape))))


def _batch_size(leaves: Sequence[Any], names: Sequence[str], num_devices: int, what: str) -> int:
    return check_batch_size(leaves, names, num_devices, what, "the devices of the data mesh")


class PjitStep:
    """One jitted training step over a 1-D data mesh; call it with a global batch."""

    def __init__(
        self,
        loss_fn: Callable[[nnx.Module, Any], jax.Array],
        model: nnx.Module,
        optimizer: optax.GradientTransformation,
        example_batch: Any,
        devices: Sequence[jax.Device],
        strategy: str,
        tensor_params: dict[str, str] | None = None,
    ):
        self.strategy = strategy
        n = 1 if strategy == "tp" else len(devices)  # the data-parallel width
        self.mesh = Mesh(np.asarray(devices).reshape(n, -1), (AXIS, TP))
        graphdef, params, rest = nnx.split(model, nnx.Param, ...)
        self._graphdef, self._rest = graphdef, rest
        param_leaves, self._param_treedef = jax.tree.flatten(params)
        batch_paths, self._batch_treedef = jax.tree_util.tree_flatten_with_path(example_batch)
        self._batch_names = [jax.tree_util.keystr(p) for p, _ in batch_paths]
        batch_leaves = [np.asarray(x) for _, x in batch_paths]
        self._batch_size = _batch_size(batch_leaves, self._batch_names, n, "example_batch")

        def sharding(x: Any, name: str = "") -> NamedSharding:
            spec = fsdp_spec(np.shape(x), n) if strategy == "fsdp" else PartitionSpec()
            if strategy == "tp":
                split = module_partition(name, np.ndim(x), tensor_params or {})
                spec = PartitionSpec(*split) if split else PartitionSpec()
            return NamedSharding(self.mesh, spec)

        names = [leaf_name(p) for p, _ in jax.tree_util.tree_flatten_with_path(params)[0]]
        param_sh = [sharding(x, name) for x, name in zip(param_leaves, names)]
        # the optimizer's copies of the parameters split as the parameters, the rest whole
        replicated = NamedSharding(self.mesh, PartitionSpec())
        opt_shapes = jax.eval_shape(optimizer.init, param_leaves)
        opt_sh = optax.tree_map_params(
            optimizer,
            lambda _, sh: sh,
            opt_shapes,
            param_sh,
            transform_non_params=lambda _: replicated,
        )
        batch_sh = [NamedSharding(self.mesh, PartitionSpec(AXIS)) for _ in batch_leaves]
        self._batch_sh = batch_sh
        treedefs = (self._param_treedef, self._batch_treedef)

        def step(p_leaves: list, opt_state: Any, b_leaves: list) -> tuple:
            def loss_of(p: list) -> jax.Array:
                m = nnx.merge(graphdef, jax.tree.unflatten(treedefs[0], p), rest)
                return loss_fn(m, jax.tree.unflatten(treedefs[1], b_leaves))

            loss, grads = jax.value_and_grad(loss_of)(p_leaves)
            updates, opt_state = optimizer.update(grads, opt_state, p_leaves)
            return optax.apply_updates(p_leaves, updates), opt_state, loss

        jitted = jax.jit(
            step,
            in_shardings=(param_sh, opt_sh, batch_sh),
            out_shardings=(param_sh, opt_sh, replicated),
            donate_argnums=(0, 1),
        )
        # A copy: the step donates its params, and must not consume the model's arrays.
        self._params = jax.device_put(param_leaves, param_sh, may_alias=False)
        self._opt_state = jax.jit(optimizer.init, out_shardings=opt_sh)(self._params)
        self._compiled = jitted.lower(
            self._params, self._opt_state, self._put_batch(batch_leaves)
        ).compile()

    def _put_batch(self, leaves: list[np.ndarray]) -> list[jax.Array]:
        return jax.device_put(leaves, self._batch_sh)

    def __call__(self, batch: Any) -> dict[str, float]:
        """One training step on the global `batch` (numpy or jax arrays)."""
        leaves, treedef = jax.tree.flatten(batch)
        if treedef != self._batch_treedef:
            raise BatchError(
                f"batch structure {treedef} differs from the example batch's {self._batch_treedef}"
            )
        size = _batch_size(leaves, self._batch_names, self.mesh.shape[AXIS], "batch")
        if size != self._batch_size:
            raise BatchError(
                f"batch size {size} differs from the compiled example batch's "
                f"{self._batch_size}; build the step again for a new batch size"
            )
        self._params, self._opt_state, loss = self._compiled(
            self._params, self._opt_state, self._put_batch(leaves)
        )
        return {"loss": float(loss)}

    def params(self) -> nnx.State:
        """The current parameters, gathered to host numpy, as an nnx.State."""
        leaves = [np.asarray(x) for x in jax.device_get(self._params)]
        return jax.tree.unflatten(self._param_treedef, leaves)

    def model(self) -> nnx.Module:
        """An nnx model holding the current parameters."""
        return nnx.merge(self._graphdef, self.params(), self._rest)

    def memory(self) -> dict[str, int]:
        """Bytes of parameters and optimizer state on the fullest device of the mesh."""

        def per_device(tree: Any) -> int:
            arrays = [x for x in jax.tree.leaves(tree) if isinstance(x, jax.Array)]
            return max(
                sum(s.data.nbytes for a in arrays for s in a.addressable_shards if s.device == d)
                for d in self.mesh.devices.flat
            )

        return {"params": per_device(self._params), "opt_state": per_device(self._opt_state)}


def pjit_step(
    loss_fn: Callable[[nnx.Module, Any], jax.Array],
    model: nnx.Module,
    optimizer: optax.GradientTransformation,
    example_batch: Any,
    devices: Sequence[jax.Device] | None = None,
    strategy: str = "dp",
    tensor_params: dict[str, str] | None = None,
) -> PjitStep:
    """Build and compile a one-program SPMD training step: the baseline piper-jax is timed against.

    Args:
      loss_fn: loss_fn(model, batch) -> scalar, a mean over the batch.
      model: a flax.nnx.Module (its nnx.Param leaves are trained; the rest is constant).
      optimizer: an optax transformation.
      example_batch: a global batch (pytree of arrays with a leading batch axis); the
        step is compiled for its shapes.
      devices: the devices of the 1-D data mesh; default `jax.devices()`.
      strategy: "dp" (params and optimizer state replicated), "fsdp" (each leaf
        sharded on its largest axis divisible by the device count, else replicated);
        the batch is sharded on axis 0 in both; or "tp" (every device one tensor-parallel
        shard: the leaves `tensor_params` names split Megatron-style, as `shard_tensor`
        splits them, the rest and the batch whole).
      tensor_params: for "tp", module name -> "colwise" or "rowwise".

    Returns:
      A PjitStep: step(batch) -> {"loss": float}; .params(); .memory().
    """
    if strategy not in STRATEGIES:
        raise DirectiveError(
            f"pjit_step: unknown strategy {strategy!r}; use one of {', '.join(STRATEGIES)}"
        )
    devices = list(jax.devices() if devices is None else devices)
    if not devices:
        raise DirectiveError("pjit_step: devices is empty; pass at least one jax device")
    return PjitStep(loss_fn, model, optimizer, example_batch, devices, strategy, tensor_params)
