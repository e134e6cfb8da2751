"""A step whose gradients are not finite (a NaN in the batch) does not update anything,
on any device group: compile(nonfinite="raise") raises naming the step, "skip" warns
and goes on, "ignore" applies it (and leaves out the global-norm collective)."""

from __future__ import annotations

import jax
import numpy as np
import optax
import pytest
from flax import nnx
from helpers import StageMLP, mlp_batches, mlp_loss, reference_run

import piper_jax as piper
from piper_jax import schedules

OPT = optax.adam(1e-2)

STRATEGIES = {
    "pp2_1f1b": lambda: (
        [piper.split({"PP": "*"}, num_microbatches=2)]
        + [piper.place({"PP": s}, [s]) for s in range(2)]
        + schedules.one_f_one_b(2, 2)
    ),
    "zero3_dp2": lambda: [piper.replicate({"PP": "*"}, [0, 1], shard_params=True)],
}


def poisoned() -> list[dict]:
    batches = mlp_batches(3)
    batches[1]["x"] = batches[1]["x"].copy()
    batches[1]["x"][3, 2] = np.nan
    return batches


def leaves(state) -> list[np.ndarray]:
    return [np.asarray(x) for x in jax.tree.leaves(state)]


@pytest.mark.parametrize("strategy", sorted(STRATEGIES))
def test_raise_names_the_step_and_keeps_the_state(strategy: str) -> None:
    batches = poisoned()
    step = piper.compile(mlp_loss, StageMLP(2), OPT, batches[0], STRATEGIES[strategy]())
    assert np.isfinite(step(batches[0])["grad_norm"])
    before = leaves(step.params())
    with pytest.raises(piper.NonFiniteError, match=r"step 2 .*loss nan.*update was skipped"):
        step(batches[1])
    for a, b in zip(leaves(step.params()), before):
        np.testing.assert_array_equal(a, b)


@pytest.mark.parametrize("strategy", sorted(STRATEGIES))
def test_skip_goes_on_as_if_the_batch_was_not_there(strategy: str) -> None:
    batches = poisoned()
    step = piper.compile(
        mlp_loss, StageMLP(2), OPT, batches[0], STRATEGIES[strategy](), nonfinite="skip"
    )
    step(batches[0])
    with pytest.warns(RuntimeWarning, match="step 2"):
        assert step(batches[1])["skipped"] == 1.0
    last = step(batches[2])["loss"]
    ref_losses, ref_params = reference_run(mlp_loss, StageMLP(2), OPT, [batches[0], batches[2]])
    np.testing.assert_allclose(last, ref_losses[-1], rtol=1e-5)
    for a, b in zip(leaves(step.params()), leaves(ref_params)):
        np.testing.assert_allclose(a, b, rtol=1e-4, atol=1e-6)


def test_ignore_applies_the_update_without_the_norm_collective() -> None:
    batches = poisoned()
    step = piper.compile(
        mlp_loss, StageMLP(2), OPT, batches[0], STRATEGIES["pp2_1f1b"](), nonfinite="ignore"
    )
    assert "gnorm" not in step.explain()
    step(batches[0])
    assert "grad_norm" not in step(batches[1])
    assert not all(np.isfinite(x).all() for x in leaves(step.params()))
    with pytest.raises(piper.PiperError, match="nonfinite='sometimes'"):
        piper.compile(mlp_loss, StageMLP(2), OPT, batches[0], [], nonfinite="sometimes")


@pytest.mark.parametrize("num_stages", [1, 2])
def test_grad_norm_metric_is_the_global_norm(num_stages: int) -> None:
    """The step reports its gradients' global norm, also where the norm runs inside the
    only update's program (one region: Note [reductions inside the update])."""
    batch = mlp_batches(1)[0]
    directives = [piper.replicate({"PP": "*"}, [0, 1])]
    step = piper.compile(mlp_loss, StageMLP(num_stages), OPT, batch, directives)
    grads = nnx.grad(mlp_loss)(StageMLP(num_stages), batch)
    want = float(optax.tree.norm(nnx.state(grads)))
    np.testing.assert_allclose(step(batch)["grad_norm"], want, rtol=1e-5)
