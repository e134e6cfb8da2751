"""Back-to-back cross-process SENDs as one exchange: which the executor picks (on plans,
no programs) and what one exchange program moves (on local devices)."""

from __future__ import annotations

from types import SimpleNamespace

import jax
import numpy as np
import optax
import pytest
from helpers import StageMLP, mlp_batches, mlp_loss
from piper_jax.mpmd_runtime import parse_step
from piper_jax.mpmd_runtime.exchanges import exchange_sets
from piper_jax.mpmd_runtime.programs import group_mesh, stacked
from piper_jax.mpmd_runtime.replay import replay, unit_cost
from piper_jax.mpmd_runtime.transport import TransferSpec, _lanes, make_exchange
from piper_jax.mpmd_runtime.watchdog import FailureReport

import piper_jax as piper
from piper_jax import schedules


def one_process_per_device(groups) -> dict:
    return {g: frozenset(g) for g in groups}


def labels(plans, run: list[int]) -> set[str]:
    return {str(plans.steps[plans.order[k][0][0]][plans.order[k][1][0]]) for k in run}


@pytest.mark.parametrize(
    "builder,gradient", [(schedules.one_f_one_b, "B1"), (schedules.zero_bubble_h1, "BI1")]
)
def test_each_gradient_meets_the_next_activation(builder, gradient) -> None:
    """1F1B's and ZB-H1's steady state: the gradient of microbatch k going back and the
    activation of k + 1 going forward meet as one exchange; in ZB-H1 across stage 1's
    deferred weight gradient of k - 1 (Note [meeting before local work])."""
    m = 8
    directives = [piper.split({"PP": "*"}, num_microbatches=m)]
    directives += [piper.place({"PP": s}, [s]) for s in range(2)]
    directives += builder(2, m)
    plans = piper.lower(
        mlp_loss, StageMLP(2), optax.sgd(0.1), mlp_batches(1)[0], directives, 2
    ).plans
    runs = exchange_sets(plans.order, plans.steps, one_process_per_device(plans.steps))
    assert [labels(plans, run) for run in runs] == [
        {f"SEND {gradient}.{k} -> d0", f"SEND F0.{k + 1} -> d1"} for k in range(1, m - 1)
    ]
    between = {str(plans.steps[g[0]][i[0]]) for g, i in plans.order[runs[0][0] : runs[0][1]]}
    assert ("BW1.0" in between) == (gradient == "BI1")
    # both stages in one process: nothing to meet for
    one = {g: frozenset({0}) for g in plans.steps}
    assert exchange_sets(plans.order, plans.steps, one) == []


SCHEDULES = {  # (stages, device of stage s, order directives), 2 devices, m=8
    "one_f_one_b": (2, lambda s: s, schedules.one_f_one_b(2, 8)),
    "zero_bubble_h1": (2, lambda s: s, schedules.zero_bubble_h1(2, 8)),
    "gpipe": (2, lambda s: s, schedules.gpipe(2, 8)),
    "interleaved_1f1b": (4, lambda s: s % 2, schedules.interleaved_1f1b(4, 8, 2)),
    "dualpipev": (4, lambda s: min(s, 3 - s), schedules.dualpipev(2, 8)),
}


@pytest.mark.parametrize("schedule", list(SCHEDULES))
def test_a_lone_transfer_is_issued_after_the_receivers_work_due_with_it(schedule) -> None:
    """Note [issue order]: a SEND that meets no other comes after every step starting at
    the same replayed time, so the receiving process queues its ready work before it
    blocks in the transfer (stage 1's first forward before the second activation's
    transfer), and the steady state's SENDs still meet in pairs."""
    stages, device, orders = SCHEDULES[schedule]
    directives = [piper.split({"PP": "*"}, num_microbatches=8)]
    directives += [piper.place({"PP": s}, [device(s)]) for s in range(stages)]
    plans = piper.lower(
        mlp_loss, StageMLP(stages), optax.sgd(0.1), mlp_batches(1)[0], directives + orders, 2
    ).plans
    start = replay(plans.steps, unit_cost).start
    runs = exchange_sets(plans.order, plans.steps, one_process_per_device(plans.steps))
    paired = {k for run in runs for k in run}
    steps = [plans.steps[g[0]][i[0]] for g, i in plans.order]
    starts = [start[g[0]][i[0]] for g, i in plans.order]
    lone = [s.head.op == "SEND" and k not in paired for k, s in enumerate(steps)]
    assert any(lone)
    for k in filter(lone.__getitem__, range(len(steps))):
        due = [steps[j] for j in range(k + 1, len(steps)) if starts[j] == starts[k] and not lone[j]]
        assert not due, f"{steps[k]} issued before {due}"
    if stages == 2:
        at = {str(s): k for k, s in enumerate(steps)}
        assert at["F1.0"] < at["SEND F0.1 -> d1"]
    if schedule in ("one_f_one_b", "zero_bubble_h1"):  # every steady-state pair meets
        assert len(runs) == 6


def synthetic(*rows: tuple[tuple[int, ...], str]) -> tuple[list, dict]:
    """An order of one-instruction steps, each (group, step text), numbered per group."""
    steps: dict[tuple[int, ...], list] = {}
    order = []
    for g, text in rows:
        steps.setdefault(g, []).append(parse_step(text))
        order.append(((g,), (len(steps[g]) - 1,)))
    for g in [(0,), (1,), (2,)]:
        steps.setdefault(g, [])
    return order, steps


FORWARD = ((0,), "SEND F0.1 -> d1")
BACKWARD = ((1,), "SEND B1.0 -> d0")


@pytest.mark.parametrize(
    "between,fused",
    [
        ([], True),
        ([((0,), "FREE F0.0"), ((1,), "RECV F0.1 <- d0")], True),  # host steps only
        ([((2,), "F2.0")], True),  # another process's step
        # work of a process that only receives later: it runs after the meeting
        ([((0,), "F0.2")], True),
        ([((1,), "B1.1")], False),  # work of the later SEND's sender
        ([((0,), "F0.2"), ((1,), "B1.1")], False),
        ([((1,), "RECV B1.0 <- d2")], False),  # rewrites what the later SEND sends
        ([((1,), "FREE B1.0")], False),
        ([((0,), "SEND F0.2 -> d2")], False),  # a meeting with another process
    ],
)
def test_what_may_stand_between_two_sends_of_one_exchange(between, fused) -> None:
    """Note [meeting before local work]: FORWARD (process 0 to 1), then BACKWARD
    (1 to 0) may meet as one exchange at FORWARD's place unless what stands between
    changes BACKWARD's value or its sender's arrival, or is another meeting."""
    order, steps = synthetic(FORWARD, *between, BACKWARD)
    runs = exchange_sets(order, steps, one_process_per_device(steps))
    assert runs == ([[0, len(between) + 1]] if fused else [])


def test_sends_between_other_processes_start_a_new_exchange() -> None:
    order, steps = synthetic(FORWARD, ((1,), "SEND B1.0 -> d2"), ((2,), "SEND F2.0 -> d1"))
    assert exchange_sets(order, steps, one_process_per_device(steps)) == [[1, 2]]


def test_local_sends_never_join_an_exchange() -> None:
    order, steps = synthetic(FORWARD, BACKWARD)
    assert exchange_sets(order, steps, {g: frozenset({0}) for g in steps}) == []


def _received(exchange, xs) -> list:
    received, witness = exchange(xs)
    jax.block_until_ready(witness)
    return [None if r is None else [np.asarray(a) for a in r] for r in received]


def test_an_exchange_moves_both_directions_in_one_ppermute() -> None:
    """Two stages of two replicas each (stage s on devices s and s + 2): the activation
    going forward and the gradient going back share one lane; leaves of other shapes and
    a transfer to fewer replicas move on their own."""
    d = jax.devices()
    stage0, stage1, merged = group_mesh([d[0], d[2]]), group_mesh([d[1], d[3]]), group_mesh([d[1]])
    act = [((2, 4, 8), np.float32), ((2, 4, 3), np.float32)]
    grad = [((2, 4, 8), np.float32)]
    specs = [
        TransferSpec(stage0, stage1, act, act),
        TransferSpec(stage1, stage0, grad, grad),
        TransferSpec(stage0, merged, grad, [((1, 8, 8), np.float32)]),
    ]
    union = [d[0], d[2], d[1], d[3]]
    lanes = _lanes(specs, union)
    assert sorted(lane.members for lane in lanes) == [[(0, 0), (1, 0)], [(0, 1)], [(2, 0)]]
    rng = np.random.default_rng(0)
    values = [[rng.normal(size=s).astype(t) for s, t in spec.src_avals] for spec in specs]
    xs = [[jax.device_put(v, stacked(spec.src)) for v in vs] for spec, vs in zip(specs, values)]
    received = _received(make_exchange(specs), xs)
    np.testing.assert_array_equal(received[0][0], values[0][0])
    np.testing.assert_array_equal(received[0][1], values[0][1])
    np.testing.assert_array_equal(received[1][0], values[1][0])
    np.testing.assert_array_equal(received[2][0], values[2][0].reshape(1, 8, 8))


def test_a_failed_exchange_is_named_by_all_its_sends() -> None:
    order, steps = synthetic(FORWARD, BACKWARD)
    report = FailureReport(SimpleNamespace(steps=steps), {}, order, {0: [0, 1], 1: []})
    report.peers_of = lambda index: [1]
    assert "instruction 'SEND F0.1 -> d1 + SEND B1.0 -> d0' on d0" in report.message(0, "failed")
