"""ZeRO's gathers and reduce-scatters: one collective per parameter for large parameters
within a process, one over their concatenation for small ones or across processes (Note
[one collective for many parameters]), the same values either way, padding included."""

from __future__ import annotations

from types import SimpleNamespace

import jax
import numpy as np
import pytest
from jax.sharding import PartitionSpec as P
from piper_jax.ir import jax_compat as jc
from piper_jax.mpmd_runtime import zero
from piper_jax.mpmd_runtime.programs import group_mesh, spmd

R = 4
SHAPES = [(5,), (3, 7), (2, 2, 2), (1,)]  # none a multiple of R: every shard is padded


def primitives(fn, *args) -> dict[str, int]:
    """How often each primitive occurs in `fn`'s jaxpr, at any depth."""
    counts: dict[str, int] = {}
    for top in jax.make_jaxpr(fn)(*args).jaxpr.eqns:
        for eqn in [top, *jc.nested_eqns(top)]:
            counts[eqn.primitive.name] = counts.get(eqn.primitive.name, 0) + 1
    return counts


@pytest.mark.parametrize("own", [True, False], ids=["per_parameter", "concatenated"])
def test_gather_and_scatter_match_the_layout(own: bool) -> None:
    mesh = group_mesh(jax.devices()[:R])
    rng = np.random.default_rng(0)
    full = [rng.normal(size=s).astype(np.float32) for s in SHAPES]
    # per replica, its own gradients: replica r holds (r + 1) * full
    grads = [np.stack([(r + 1) * f for r in range(R)]) for f in full]
    shards = [zero.to_shards(f, R) for f in full]  # (R, k): row r is replica r's shard

    gather = spmd(lambda rows: zero.gather_all(rows, SHAPES, own), mesh, (P(zero.AXIS),), P())
    scatter = spmd(
        lambda gs: zero.scatter_all([g[0] for g in gs], R, own),
        mesh,
        (P(zero.AXIS),),
        P(zero.AXIS),
    )
    for got, want in zip(jax.jit(gather)(shards), full):
        np.testing.assert_array_equal(np.asarray(got), want)
    total = sum(range(1, R + 1))
    for got, f in zip(jax.jit(scatter)(grads), full):
        np.testing.assert_allclose(np.asarray(got), zero.to_shards(total * f, R), rtol=1e-6)

    gathers = primitives(gather, shards)["all_gather"]
    scatters = primitives(scatter, grads)["reduce_scatter"]
    assert (gathers, scatters) == ((len(SHAPES),) * 2 if own else (1, 1))


def test_own_collectives_follow_the_mean_size_within_a_process() -> None:
    """A GPT of width 32 averages 1,136 elements a parameter (one collective is faster),
    width 128 averages 15,886 (one each is as fast or faster, and compiles in 2.3-2.9 s
    against 4.3 s); over
    devices of two processes every collective is a round trip, so they share one."""
    local = jax.devices()[:R]
    two_processes = [SimpleNamespace(process_index=i % 2) for i in range(R)]
    large = [(128, 512), (512, 128), (128,), (512,)]
    assert not zero.own_collectives([(32, 32)] * 3 + [(32,)] * 9, local)
    assert zero.own_collectives(large, local)
    assert zero.own_collectives([(64, 64)], local)
    assert not zero.own_collectives(large, two_processes)
