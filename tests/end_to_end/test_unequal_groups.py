"""Stages on device groups of different sizes: a transfer between a group of 2 replicas
and a group of 1 moves each receiving replica exactly the batch rows it needs; the tied
embedding's gradients are summed across groups of different widths and layouts."""

from __future__ import annotations

import optax
import pytest
from helpers import check_mlp_strategy
from piper_jax.mpmd_runtime.transport import transfer_rounds

import piper_jax as piper
from piper_jax import schedules

OPT = optax.adam(1e-2)


def stages(groups: list[list[int]], m: int, zero: dict | None = None) -> list:
    """Stage s on groups[s], replicated (with `zero` flags on stage 0) where it has
    several devices, under 1F1B."""
    directives = [piper.split({"PP": "*"}, num_microbatches=m)]
    for s, devices in enumerate(groups):
        directives.append(piper.place({"PP": s}, devices))
        if len(devices) > 1:
            flags = (zero or {}) if s == 0 else {}
            directives.append(piper.replicate({"PP": s}, devices, **flags))
    return directives + schedules.one_f_one_b(len(groups), m)


CASES = {
    "2_to_1": ([[0, 1], [2]], None),
    "1_to_2": ([[0], [1, 2]], None),
    "2_to_1_to_2": ([[0, 1], [2], [3, 4]], None),
    "4_to_2": ([[0, 1, 2, 3], [4, 5]], None),
    "zero3_on_the_wider": ([[0, 1], [2]], {"shard_params": True}),
    "zero2_on_the_wider": ([[0, 1], [2]], {"shard_grads": True}),
}


@pytest.mark.parametrize("name", sorted(CASES))
def test_unequal_groups_match_single_device(name: str) -> None:
    groups, zero = CASES[name]
    step = check_mlp_strategy(stages(groups, 2, zero), OPT, num_stages=len(groups))
    text = step.explain()
    for devices in groups:
        assert f"d{','.join(map(str, devices))}[dp={len(devices)}]" in text


def test_transfer_rounds_move_every_row_once() -> None:
    """2 replicas of 6 rows -> 3 replicas of 4 rows: pieces of gcd(6, 4) = 2 rows, no
    replica sending or receiving twice in a round."""
    piece, rounds = transfer_rounds(6, 4, [0, 1, 2])
    assert piece == 2
    moved = sorted((s * 6 + so, d * 4 + do) for r in rounds for s, so, d, do in r)
    assert moved == [(k, k) for k in range(0, 12, 2)]
    for moves in rounds:
        assert len({s for s, *_ in moves}) == len(moves) == len({d for _, _, d, _ in moves})


def test_value_without_a_batch_axis_cannot_change_width() -> None:
    """A region output that does not scale with the batch cannot be split between groups
    of different widths: refused naming the value."""
    import jax.numpy as jnp
    from flax import nnx
    from helpers import mlp_batches

    class Summed(nnx.Module):
        def __init__(self) -> None:
            self.w = nnx.Linear(8, 8, rngs=nnx.Rngs(0))

        def __call__(self, x):
            with piper.annotate("PP", 0):
                total = jnp.sum(self.w(x), axis=0)  # no batch axis left
            with piper.annotate("PP", 1):
                return total * 2.0

    def loss(model, batch):
        return jnp.mean(model(batch["x"]) ** 2)

    with pytest.raises(piper.DirectiveError, match=r"F0\.0 .*no batch axis"):
        piper.compile(
            loss,
            Summed(),
            OPT,
            mlp_batches(1)[0],
            [
                piper.place({"PP": 0}, [0, 1]),
                piper.replicate({"PP": 0}, [0, 1]),
                piper.place({"PP": 1}, [2]),
            ],
        )
