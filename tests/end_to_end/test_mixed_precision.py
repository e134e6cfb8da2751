"""Mixed precision: bf16 computation, fp32 parameters, fp32 gradient accumulation across
microbatches, equal to the same mixed-precision training on one device to a bf16
tolerance."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import optax
from flax import nnx
from helpers import mlp_batches, mlp_loss, reference_run
from piper_jax.mpmd_runtime import buffers as bf

import piper_jax as piper
from piper_jax import schedules


class MixedMLP(nnx.Module):
    """Two stages of bf16 linear layers over fp32 parameters."""

    def __init__(self, width: int = 32) -> None:
        rngs = nnx.Rngs(0)
        kw = dict(dtype=jnp.bfloat16, param_dtype=jnp.float32, rngs=rngs)
        self.inp = nnx.Linear(8, width, **kw)
        self.blocks = nnx.List([nnx.Linear(width, width, **kw) for _ in range(2)])
        self.out = nnx.Linear(width, 8, **kw)

    def __call__(self, x: jax.Array) -> jax.Array:
        h = self.inp(x)
        for s, block in enumerate(self.blocks):
            with piper.annotate("PP", s):
                h = h + jnp.tanh(block(h))
        return self.out(h).astype(jnp.float32)


def test_bf16_compute_with_fp32_accumulation_matches_one_device() -> None:
    opt = optax.adam(1e-2)
    batches = mlp_batches(3, batch_size=32)
    directives = [piper.split({"PP": "*"}, num_microbatches=4)]
    for s in range(2):
        directives += [piper.place({"PP": s}, [s, s + 2]), piper.replicate({"PP": s}, [s, s + 2])]
    directives += schedules.one_f_one_b(2, 4)
    step = piper.compile(mlp_loss, MixedMLP(), opt, batches[0], directives)
    accumulators = [
        v
        for store in step._executor.rt.stores.values()
        for b, v in store.items()
        if b.kind is bf.Kind.ACC
    ]
    assert accumulators and all(v.dtype == jnp.float32 for v in accumulators)
    # activations cross stages in bf16, the model's compute dtype
    assert [d for _, d in step._executor.rt.buffer_avals("F0.0", (0, 2))] == [jnp.bfloat16]
    ref_losses, ref_params = reference_run(mlp_loss, MixedMLP(), opt, batches)
    losses = [step(b)["loss"] for b in batches]
    np.testing.assert_allclose(losses, ref_losses, rtol=2e-2)
    for got, want in zip(jax.tree.leaves(step.params()), jax.tree.leaves(ref_params)):
        assert np.asarray(got).dtype == np.float32
        np.testing.assert_allclose(np.asarray(got), np.asarray(want), rtol=0, atol=2e-2)


def test_the_forward_keeps_no_bf16_copy_of_the_weights() -> None:
    """Note [residuals from parameters alone]: a bf16 layer over fp32 parameters casts its
    kernel every forward, and `jax.vjp` keeps that bf16 kernel for the input gradient; F
    keeps only activations, the backward casts the kernel again."""
    width, rows, m = 256, 32, 4
    directives = [piper.split({"PP": "*"}, num_microbatches=m)]
    directives += [piper.place({"PP": s}, [s]) for s in range(2)]
    directives += schedules.one_f_one_b(2, m)
    batch = mlp_batches(1, batch_size=rows)[0]
    step = piper.compile(mlp_loss, MixedMLP(width), optax.adam(1e-2), batch, directives)
    step(batch)
    kernel_bf16 = width * width * 2
    activations = (rows // m) * width * 2
    for g in [(0,), (1,)]:
        kept = step._executor.residual_bytes(g)
        assert activations <= kept < kernel_bf16 / 4, (g, kept)
