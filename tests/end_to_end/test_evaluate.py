"""step.evaluate: the forward loss of the current parameters under the same placement,
with nothing updated."""

from __future__ import annotations

import jax
import numpy as np
import optax
import pytest
from helpers import StageMLP, mlp_batches, mlp_loss

import piper_jax as piper
from piper_jax import schedules


def pp2_dp2_zero3() -> list:
    directives = [piper.split({"PP": "*"}, num_microbatches=2)]
    for s in range(2):
        devices = [s, s + 2]
        directives += [
            piper.place({"PP": s}, devices),
            piper.replicate({"PP": s}, devices, shard_params=True),
        ]
    return directives + schedules.one_f_one_b(2, 2)


STRATEGIES = {
    "pp2_dp2_zero3": pp2_dp2_zero3,
    "zero3_dp4": lambda: [piper.replicate({"PP": "*"}, [0, 1, 2, 3], shard_params=True)],
}


@pytest.mark.parametrize("name", sorted(STRATEGIES))
def test_evaluate_is_the_plain_forward_loss(name: str) -> None:
    batches = mlp_batches(3)
    step = piper.compile(mlp_loss, StageMLP(2), optax.adam(1e-2), batches[0], STRATEGIES[name]())
    step(batches[0])
    params = [np.asarray(x) for x in jax.tree.leaves(step.params())]
    state = step._executor.optimizer_state()
    got = step.evaluate(batches[1])
    assert got == {"loss": pytest.approx(float(mlp_loss(step.model(), batches[1])), rel=1e-5)}
    assert "F1.0" in step._evaluator.plans.to_text()
    assert "B0" not in step._evaluator.plans.to_text()  # forward passes only
    for a, b in zip(jax.tree.leaves(step.params()), params):
        np.testing.assert_array_equal(np.asarray(a), b)
    for key, value in step._executor.optimizer_state().items():
        np.testing.assert_array_equal(value, state[key])
    # training goes on from where it was
    assert np.isfinite(step(batches[2])["loss"])
