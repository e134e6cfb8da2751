"""Staging a step's batch onto a group: one array per microbatch, each where the group's
programs read it, with one host-to-device copy per leaf on a group this process holds
(Note [staging a batch] in mpmd_runtime/transport.py)."""

import jax
import numpy as np
import pytest
from jax.sharding import Mesh
from piper_jax.mpmd_runtime import transport
from piper_jax.mpmd_runtime.programs import AXIS, stacked


def _leaves(m: int, width: int) -> list[np.ndarray]:
    """Two leaves of m microbatches, stacked over `width` replicas, every entry distinct."""
    tokens = np.arange(m * width * 3 * 2, dtype=np.int32).reshape(m, width, 3, 2)
    return [tokens, np.float32(0.5) * tokens[..., 0]]


@pytest.mark.parametrize(("m", "width"), [(4, 1), (4, 2), (3, 4), (1, 2)])
def test_each_microbatch_lands_whole_on_its_group(m: int, width: int) -> None:
    sharding = stacked(Mesh(np.array(jax.devices()[:width]), (AXIS,)))
    leaves = _leaves(m, width)
    staged = transport.microbatch_stager(sharding, m)(leaves)
    assert len(staged) == m
    for k, values in enumerate(staged):
        assert len(values) == len(leaves)
        for got, leaf in zip(values, leaves):
            assert got.sharding == sharding
            np.testing.assert_array_equal(np.asarray(got), leaf[k])


def test_a_local_group_takes_one_copy_per_leaf(monkeypatch: pytest.MonkeyPatch) -> None:
    copies = []
    put = transport.host_to_group
    monkeypatch.setattr(
        transport, "host_to_group", lambda value, sharding: copies.append(1) or put(value, sharding)
    )
    sharding = stacked(Mesh(np.array(jax.devices()[:2]), (AXIS,)))
    stage = transport.microbatch_stager(sharding, 8)
    stage(_leaves(8, 2))
    assert len(copies) == 2  # not 8 x 2
    assert stage([]) == [[]] * 8 and len(copies) == 2  # a group reading no batch leaf
