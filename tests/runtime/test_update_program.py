"""The optimizer update reads each gradient accumulator once and writes fresh zeros for
the next step; it never copies an accumulator, a parameter or an optimizer moment (a
donated accumulator made XLA copy it before zeroing its buffer, and the non-finite guard,
written as a select between new and old state, made it copy every moment first)."""

from __future__ import annotations

import math
import re

import optax
import pytest
from helpers import StageMLP, mlp_batches, mlp_loss

import piper_jax as piper


@pytest.mark.parametrize(
    "optimizer, zero",
    [(optax.sgd(0.1), False), (optax.adam(0.1), False), (optax.adam(0.1), True)],
    ids=["sgd", "adam", "adam_zero2"],
)
def test_update_copies_no_weight_sized_buffer(
    optimizer: optax.GradientTransformation, zero: bool
) -> None:
    width = 64
    batch = mlp_batches(1)[0]
    directives = [piper.split({"PP": "*"}, num_microbatches=2)]
    if zero:
        directives.append(piper.replicate({"PP": "*"}, [0, 1], shard_grads=True))
    step = piper.compile(mlp_loss, StageMLP(2, width=width), optimizer, batch, directives)
    step(batch)
    texts = step._executor.program_texts()
    updates = {label: t for label, t in texts.items() if "UPD" in label}
    assert updates, sorted(texts)
    for label, text in updates.items():
        entry = text[text.index("\nENTRY") :]
        shapes = re.findall(r"= f32\[([\d,]*)\]\S* copy\(", entry)
        sizes = [math.prod(int(d) for d in shape.split(",") if d) for shape in shapes]
        assert not [n for n in sizes if n >= width * width // 2], (label, shapes)


@pytest.mark.parametrize("zero", [False, True], ids=["dp2", "dp2_zero2"])
def test_accumulators_keep_one_row_per_device_across_steps(zero: bool) -> None:
    """The fresh zeros an update writes lie as the accumulators did (a row, or a flat
    shard, per replica), not replicated: every device held every replica's gradients
    between the update and the next backward."""
    from piper_jax.mpmd_runtime import buffers as bf

    batch = mlp_batches(1)[0]
    replicate = piper.replicate({"PP": "*"}, [0, 1], shard_grads=zero)
    step = piper.compile(
        mlp_loss,
        StageMLP(2, width=16),
        optax.adam(0.1),
        batch,
        [piper.split({"PP": "*"}, num_microbatches=2), replicate],
    )
    step(batch)
    accs = [v for b, v in step._executor.rt.stores[(0, 1)].items() if b.kind is bf.Kind.ACC]
    assert accs
    for acc in accs:
        assert {s.data.shape[0] for s in acc.addressable_shards} == {1}, acc.sharding


@pytest.mark.parametrize("zero", [False, True], ids=["dp2", "dp2_zero2"])
def test_update_writes_zeros_over_the_accumulators_off_the_cpu(
    monkeypatch: pytest.MonkeyPatch, zero: bool
) -> None:
    """Off the CPU (Note [state keeps its buffers]) the update donates the accumulators it
    reads and zeroes them in place; training is unchanged."""
    from helpers import check_mlp_strategy
    from piper_jax.mpmd_runtime import buffers as bf
    from piper_jax.mpmd_runtime import executor

    monkeypatch.setattr(executor, "rewrites_state_in_place", lambda devices: True)
    directives = [
        piper.split({"PP": "*"}, num_microbatches=2),
        piper.replicate({"PP": "*"}, [0, 1], shard_grads=zero),
    ]
    step = check_mlp_strategy(directives, optax.adam(1e-2))
    ex = step._executor
    updates = []
    for i, unit in ex._units.items():
        members, index = ex.step_events[i]
        if any(ins.op == "UPD" for ins in ex.plans.steps[members[0]][index[0]].instructions):
            updates.append(unit)
    assert updates
    for unit in updates:
        assert [b for b in unit.donated if b.kind is bf.Kind.ACC], unit.donated
