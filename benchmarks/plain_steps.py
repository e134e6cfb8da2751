"""The hand-written training steps benchmarks/pipeline_efficiency.py races piper-jax against.

Both train tests/helpers.StageMLP(2, width=W) with mlp_loss on a batch cut into m equal
microbatches (rows k*B/m .. (k+1)*B/m - 1 are microbatch k, as piper's split cuts it): the
loss is the mean of the microbatch losses, the gradient the mean of their gradients, then
one optax update. Each returns `step(batch) -> float`, the step's loss on the host (so a
call is synchronous).
  jit1_step: one `jax.jit` of the whole step on one device: a scan over the microbatches
    accumulating `jax.value_and_grad` of the plain model's loss, then the update.
  spmd_gpipe_step: GPipe written by hand as one SPMD program over a 1-D mesh "pp" of one
    device per stage (each may live in another process; every process calls `step`): the
    stages' block weights stacked on a leading axis sharded over "pp", `jax.shard_map`
    over it, a scan of m + p - 1 ticks in which stage s runs microbatch t - s and
    `ppermute`s its activation to stage s + 1, the loss on the last stage, `jax.grad` of
    the whole (all forwards, then all backwards), then the update.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
import optax
from flax import nnx
from jax.sharding import Mesh, NamedSharding
from jax.sharding import PartitionSpec as P

Step = Callable[[dict], float]


def _microbatched(batch: Any, m: int) -> Any:
    return jax.tree.map(lambda a: a.reshape((m, a.shape[0] // m) + a.shape[1:]), batch)


def jit1_step(
    model: nnx.Module, loss_fn: Callable, optimizer: optax.GradientTransformation, m: int
) -> Step:
    """The fair single-device baseline: the same per-microbatch math as the pipeline, in
    one compiled program, with no runtime between the microbatches."""
    graphdef, params, rest = nnx.split(model, nnx.Param, ...)
    state = [params, optimizer.init(params)]

    def loss_of(p: Any, mb: Any) -> jax.Array:
        return loss_fn(nnx.merge(graphdef, p, rest), mb)

    @jax.jit
    def train(params: Any, opt_state: Any, batch: Any) -> tuple:
        def accumulate(acc: Any, mb: Any) -> tuple:
            loss, grads = jax.value_and_grad(loss_of)(params, mb)
            return jax.tree.map(jnp.add, acc, grads), loss

        zeros = jax.tree.map(jnp.zeros_like, params)
        grads, losses = jax.lax.scan(accumulate, zeros, _microbatched(batch, m))
        grads = jax.tree.map(lambda g: g / m, grads)
        updates, opt_state = optimizer.update(grads, opt_state, params)
        return optax.apply_updates(params, updates), opt_state, jnp.mean(losses)

    def step(batch: dict) -> float:
        state[0], state[1], loss = train(state[0], state[1], batch)
        return float(loss)

    return step


def spmd_gpipe_step(model: nnx.Module, optimizer: optax.GradientTransformation, m: int) -> Step:
    """What a JAX user writes today for pipeline parallelism: one SPMD program, the stages
    on the devices of `jax.devices()` (one per stage, in any processes). `model` is a
    StageMLP; its computation is written out here (embed, residual tanh blocks, tied
    output), so the losses check that it matches."""
    devices = jax.devices()
    p = len(devices)
    if len(model.blocks) != p:
        raise ValueError(f"{len(model.blocks)} blocks for {p} devices: need one per device")
    mesh = Mesh(np.array(devices), ("pp",))
    specs = {"embed": P(), "kernel": P("pp"), "bias": P("pp")}
    host = {
        "embed": np.asarray(model.embed[...]),
        "kernel": np.stack([np.asarray(b.kernel[...]) for b in model.blocks]),
        "bias": np.stack([np.asarray(b.bias[...]) for b in model.blocks]),
    }
    params = {k: _global(v, NamedSharding(mesh, specs[k])) for k, v in host.items()}
    state = [params, jax.jit(optimizer.init)(params)]

    def pipeline_loss(params: dict, x: jax.Array, y: jax.Array) -> jax.Array:
        s = jax.lax.axis_index("pp")
        embed, kernel, bias = params["embed"], params["kernel"][0], params["bias"][0]

        def tick(received: jax.Array, t: jax.Array) -> tuple:
            first = x[jnp.minimum(t, m - 1)] @ embed  # stage 0's input, microbatch t
            h = jnp.where(s == 0, first, received)
            h = h + jnp.tanh(h @ kernel + bias)
            k = t - (p - 1)  # the last stage's microbatch
            err = h @ embed.T - y[jnp.clip(k, 0, m - 1)]
            loss = jnp.where((s == p - 1) & (k >= 0), jnp.mean(err**2), 0.0)
            sent = jax.lax.ppermute(h, "pp", [(i, i + 1) for i in range(p - 1)])
            return sent, loss

        start = jax.lax.pcast(jnp.zeros((x.shape[1], embed.shape[1])), "pp", to="varying")
        _, losses = jax.lax.scan(tick, start, jnp.arange(m + p - 1))
        return jax.lax.psum(jnp.sum(losses), "pp") / m

    sharded_loss = jax.shard_map(
        pipeline_loss, mesh=mesh, in_specs=(specs, P(), P()), out_specs=P()
    )

    @jax.jit
    def train(params: dict, opt_state: Any, x: jax.Array, y: jax.Array) -> tuple:
        loss, grads = jax.value_and_grad(sharded_loss)(params, x, y)
        updates, opt_state = optimizer.update(grads, opt_state, params)
        return optax.apply_updates(params, updates), opt_state, loss

    replicated = NamedSharding(mesh, P())

    def step(batch: dict) -> float:
        mbs = _microbatched(batch, m)
        x, y = (_global(np.asarray(mbs[k]), replicated) for k in ("x", "y"))
        state[0], state[1], loss = train(state[0], state[1], x, y)
        return float(loss.addressable_data(0))

    return step


def _global(value: np.ndarray, sharding: NamedSharding) -> jax.Array:
    """`value` (the same on every process) as one array over the sharding's devices."""
    return jax.make_array_from_callback(value.shape, sharding, lambda index: value[index])
