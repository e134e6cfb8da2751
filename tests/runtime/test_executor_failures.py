"""How the executor reports a failure that surfaces only when the host waits for the step.

Transfers and collectives fail asynchronously: a dead peer may show up in the dispatch loop
or only in `wait()`. Both must name the failing instruction and the peer, as a PiperError.
A real dead peer is tested with processes in tests/multiprocess; here the device error is
injected, so that the `wait()` path is taken every time."""

from __future__ import annotations

import jax
import optax
import pytest
from helpers import StageMLP, mlp_batches, mlp_loss

import piper_jax as piper


def _pipeline_step() -> piper.TrainStep:
    directives = [
        piper.split({"PP": "*"}, num_microbatches=2),
        piper.place({"PP": 0}, [0]),
        piper.place({"PP": 1}, [1]),
        *piper.schedules.one_f_one_b(2, 2),
    ]
    return piper.compile(mlp_loss, StageMLP(2), optax.sgd(0.1), mlp_batches(1)[0], directives)


def test_an_error_found_while_waiting_names_the_first_failed_instruction(monkeypatch) -> None:
    step = _pipeline_step()
    batch = mlp_batches(1)[0]
    step(batch)
    executor = step._executor
    failing = next(
        i
        for i, (members, position) in enumerate(executor.step_events)
        if executor.plans.steps[members[0]][position[0]].head.op == "SEND"
    )
    real_block = jax.block_until_ready

    def block(tree):
        failed = {
            id(x) for i, out in executor._witnesses if i == failing for x in jax.tree.leaves(out)
        }
        if any(id(x) in failed for x in jax.tree.leaves(tree)):
            raise RuntimeError("collective permute failed: connection closed by peer")
        return real_block(tree)

    monkeypatch.setattr(jax, "block_until_ready", block)
    monkeypatch.setattr(executor.failures, "peers_of", lambda index: [1])
    with pytest.raises(piper.PiperError) as info:
        step(batch)
    members, position = executor.step_events[failing]
    instruction = str(executor.plans.steps[members[0]][position[0]])
    assert f"instruction '{instruction}'" in str(info.value)
    assert "connection closed by peer" in str(info.value)


def test_a_local_error_found_while_waiting_is_raised_as_it_is(monkeypatch) -> None:
    """With no peer to blame, the device's own error is the clearest report."""
    step = _pipeline_step()
    batch = mlp_batches(1)[0]
    step(batch)

    def block(tree):
        raise RuntimeError("out of memory")

    monkeypatch.setattr(jax, "block_until_ready", block)
    with pytest.raises(RuntimeError, match="out of memory"):
        step(batch)
