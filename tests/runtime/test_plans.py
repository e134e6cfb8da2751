"""Instruction strings, plan compilation, FREE placement and the deadlock dry run."""

from __future__ import annotations

import collections

import optax
import pytest
from helpers import StageMLP, deadlocked_steps, mlp_batches, mlp_loss
from piper_jax.mpmd_runtime import dry_run, parse, parse_step
from piper_jax.mpmd_runtime.instructions import Instruction
from piper_jax.mpmd_runtime.simulator import simulate

import piper_jax as piper
from piper_jax import schedules

INSTRUCTIONS = [
    "F1.3",
    "B0.0",
    "BW2.1",
    "UPD1",
    "SEND F1.3 -> d1,3",
    "RECV B2.0 <- d0",
    "ALL_REDUCE grad[0,2] d0,2",
    "ALL_REDUCE grad[0,2]/1 d0,2",
    "ALL_REDUCE gnorm d0,1,2,3",
    "REDUCE_SCATTER grad[B0.3] d0,2",
    "REDUCE_SCATTER grad[BW0.3]/2 d0,2",
    "ALL_GATHER param[F0.3] d0,2",
    "ALL_GATHER param[UPD0] d0,2",
    "FREE F1.3",
    "FREE batch.3",
    "FREE grad[0,2]",
]


@pytest.mark.parametrize("text", INSTRUCTIONS)
def test_instruction_round_trip(text: str) -> None:
    ins = parse(text)
    assert isinstance(ins, Instruction) and str(ins) == text and parse(str(ins)) == ins


def test_parse_rejects_garbage() -> None:
    with pytest.raises(ValueError, match="not an instruction"):
        parse("JUMP 3")


def test_fused_step_round_trip() -> None:
    text = "ALL_GATHER param[F0.3] d0,2 + F0.3"
    step = parse_step(text)
    assert str(step) == text and [i.op for i in step.instructions] == ["ALL_GATHER", "RUN"]
    assert step.instructions[0].label == step.instructions[1].label  # the pass it serves


def pp2_step(m: int = 4):
    directives = [
        piper.split({"PP": "*"}, num_microbatches=m),
        piper.place({"PP": 0}, [0]),
        piper.place({"PP": 1}, [1]),
        *piper.schedules.one_f_one_b(2, m),
    ]
    return piper.compile(mlp_loss, StageMLP(2), optax.sgd(0.1), mlp_batches(1)[0], directives)


def runs(step, group):
    return [str(i) for i in step.plans.plans[group] if i.op == "RUN"]


def test_1f1b_plans() -> None:
    step = pp2_step()
    assert runs(step, (0,)) == ["F0.0", "F0.1", "B0.0", "F0.2", "B0.1", "F0.3", "B0.2", "B0.3"]
    assert runs(step, (1,)) == ["F1.0", "B1.0", "F1.1", "B1.1", "F1.2", "B1.2", "F1.3", "B1.3"]
    plan1 = [str(i) for i in step.plans.plans[(1,)]]
    # each activation received on d1 is freed after its last reader, F1.i
    for i in range(4):
        assert plan1.index(f"FREE F0.{i}") > plan1.index(f"F1.{i}")
        assert plan1.index(f"RECV F0.{i} <- d0") < plan1.index(f"F1.{i}")
    assert "ALL_REDUCE" in step.explain() and "UPD0" in step.explain()


@pytest.mark.parametrize("shard_params", [False, True])
def test_one_group_without_orders_finishes_a_microbatch_before_the_next(
    shard_params: bool,
) -> None:
    """Gradient accumulation on one group: each microbatch's passes in turn, so one
    microbatch's residuals are alive at a time, not all m (a breadth-first order)."""
    directives = [
        piper.split({"PP": "*"}, num_microbatches=4),
        piper.replicate({"PP": "*"}, [0, 1], shard_params=shard_params),
    ]
    plans = piper.lower(mlp_loss, StageMLP(2), optax.sgd(0.1), mlp_batches(1)[0], directives).plans
    passes = [i.label for i in plans.plans[(0, 1)] if i.op == "RUN"]
    assert [str(p) for p in passes] == [f"{p}.{k}" for k in range(4) for p in "F0 F1 B1 B0".split()]
    assert max(simulate(plans, {"F": 1, "B": 2}).peak_activations.values()) == 2


def test_dry_run_reports_deadlock_with_marked_grid() -> None:
    step = pp2_step(2)
    with pytest.raises(piper.PlanError, match=r"plan deadlock(.|\n)*>> "):
        dry_run(deadlocked_steps(step))
    # the compiled plans themselves pass
    dry_run(step.plans.steps)


def lowered_pipeline(num_stages: int, m: int, device_of, orders: list) -> piper.Lowered:
    directives = [piper.split({"PP": "*"}, num_microbatches=m)]
    directives += [piper.place({"PP": s}, [device_of(s)]) for s in range(num_stages)]
    return piper.lower(
        mlp_loss,
        StageMLP(num_stages),
        optax.sgd(0.1),
        mlp_batches(1, batch_size=m)[0],
        directives + orders,
        num_devices=4,
    )


def issued(plans) -> list[str]:
    """Every step once, as text, in the global order in which processes issue them."""
    return [str(plans.steps[members[0]][index[0]]) for members, index in plans.order]


def test_a_stage_is_issued_its_backward_before_the_next_gradient_arrives() -> None:
    """A process blocks in a transfer it receives until its peer sends (XLA:CPU runs it
    on the calling thread): stage 0 must be issued B0.k before the transfer of stage 1's
    next gradient, B1.(k+1), or the two stages take turns (Note [issue order])."""
    m = 6
    order = issued(lowered_pipeline(2, m, lambda s: s, schedules.one_f_one_b(2, m)).plans)
    for k in range(m - 1):
        assert order.index(f"B0.{k}") < order.index(f"SEND B1.{k + 1} -> d0")


@pytest.mark.parametrize(
    "num_stages,device_of,orders",
    [
        (4, lambda s: s, schedules.one_f_one_b(4, 8)),
        (4, lambda s: s, schedules.zero_bubble_h1(4, 8)),
        (4, lambda s: s % 2, schedules.interleaved_1f1b(4, 8, 2)),
        (4, lambda s: min(s, 3 - s), schedules.dualpipev(2, 8)),
    ],
    ids=["1f1b", "zbh1", "interleaved", "dualpipev"],
)
def test_issue_order_is_valid(num_stages: int, device_of, orders: list) -> None:
    """Each group's steps in plan order, every step once, each RECV after its SEND."""
    plans = lowered_pipeline(num_stages, 8, device_of, orders).plans
    seen = {g: 0 for g in plans.steps}
    sent: collections.Counter = collections.Counter()
    for members, index in plans.order:
        for g, i in zip(members, index):
            assert i == seen[g]
            seen[g] += 1
        head = plans.steps[members[0]][index[0]].head
        if head.op == "SEND":
            sent[(head.value, members[0], tuple(head.peer))] += 1
        if head.op == "RECV":
            key = (head.value, tuple(head.peer), members[0])
            assert sent[key] > 0, f"{head} issued before its SEND"
            sent[key] -= 1
    assert seen == {g: len(s) for g, s in plans.steps.items()}


def test_reductions_within_a_group_run_in_its_update() -> None:
    """Note [reductions inside the update]: the all-reduces right before an update run in
    its program; a bucket with a backward after it, and a reduction over several groups,
    stay apart."""

    def steps(directives: list) -> dict:
        plans = piper.lower(
            mlp_loss, StageMLP(2), optax.sgd(0.1), mlp_batches(1)[0], directives, num_devices=8
        ).plans
        return {g: [str(s) for s in plans.steps[g] if s.head.op != "FREE"] for g in plans.steps}

    dp = steps([piper.replicate({"PP": "*"}, [0, 1])])[(0, 1)]
    assert dp[-2:] == ["ALL_REDUCE grad[0,1] d0,1 + ALL_REDUCE gnorm d0,1 + UPD0", "UPD1"]
    split = piper.split({"PP": "*"}, num_microbatches=2)
    buckets = steps([split, piper.replicate({"PP": "*"}, [0, 1], bucket_size=0.0005)])[(0, 1)]
    assert buckets[-5:-2] == ["ALL_REDUCE grad[1]/0 d0,1", "ALL_REDUCE grad[1]/1 d0,1", "B0.1"]
    assert buckets[-2].startswith("ALL_REDUCE grad[0]/2 d0,1 + ")
    assert buckets[-2].endswith(" + ALL_REDUCE gnorm d0,1 + UPD0")
    directives = [split]
    for s in range(2):
        directives += [piper.place({"PP": s}, [s, s + 2]), piper.replicate({"PP": s}, [s, s + 2])]
    pipeline = steps(directives + schedules.one_f_one_b(2, 2))[(0, 2)]
    assert pipeline[-4:] == [
        "ALL_REDUCE grad[0] d0,2",
        "ALL_REDUCE grad[0,1] d0,2,1,3",
        "ALL_REDUCE gnorm d0,2,1,3",
        "UPD0",
    ]
