"""Bad input a user can give gets a PiperError that names the culprit."""

from __future__ import annotations

import json

import optax
import pytest
from helpers import StageMLP, check_mlp_strategy, mlp_batches, mlp_loss

import piper_jax as piper
from piper_jax import schedules

OPT = optax.sgd(0.1)


def compile_mlp(directives, batch=None, stages: int = 2):
    batch = batch or mlp_batches(1)[0]
    return piper.compile(mlp_loss, StageMLP(stages), OPT, batch, directives)


def test_filter_matching_no_region() -> None:
    with pytest.raises(piper.DirectiveError, match=r"place \{PP:7\}: filter matches no region"):
        compile_mlp([piper.place({"PP": 0}, [0]), piper.place({"PP": 7}, [1])])


def test_device_index_out_of_range() -> None:
    with pytest.raises(piper.DirectiveError, match="device index 8 is out of range.*8 devices"):
        compile_mlp([piper.place({"PP": 0}, [0]), piper.place({"PP": 1}, [8])])


def test_batch_not_divisible_by_microbatches() -> None:
    batch = mlp_batches(1, batch_size=6)[0]
    with pytest.raises(piper.BatchError, match="batch size 6.*not divisible.*= 4"):
        compile_mlp([piper.split({"PP": "*"}, num_microbatches=4)], batch)


def test_step_batch_of_wrong_size() -> None:
    step = compile_mlp([])
    with pytest.raises(piper.BatchError, match="batch size 8 differs.*16"):
        step(mlp_batches(1, batch_size=8)[0])


def test_order_cycle() -> None:
    cyc = piper.order([[{"PP": 0, "PASS": "B"}], [{"PP": 0, "PASS": "F"}]])
    with pytest.raises(piper.DirectiveError, match=r"directive 0 \(order\) makes a cycle.*B0.0"):
        compile_mlp([cyc])


def test_order_cycle_with_an_overlap_group_is_named_as_a_cycle() -> None:
    """The order that closes a cycle is named also when an order holds an overlap group
    (two filters in one group); it was refused as "F1.0 is in two overlap groups"."""

    def at(stage: int, mb: int, pass_: str) -> dict:
        return {"PP": stage, "MB": mb, "PASS": pass_}

    # with d0's order: F1.1 -> B1.0 -> B0.0 -> F0.1 -> F1.1
    directives = [
        piper.split({"PP": "*"}, num_microbatches=2),
        piper.place({"PP": 0}, [0]),
        piper.place({"PP": 1}, [1]),
        piper.order([[at(0, 0, "B")], [at(0, 1, "F")]]),
        piper.order([[at(1, 0, "F"), at(1, 1, "F")], [at(1, 0, "B")]]),
    ]
    with pytest.raises(piper.DirectiveError, match=r"directive 4 \(order\) makes a cycle"):
        compile_mlp(directives, mlp_batches(1, batch_size=4)[0])


def test_order_across_devices() -> None:
    bad = piper.order([[{"PP": 0, "PASS": "F"}], [{"PP": 1, "PASS": "F"}]])
    with pytest.raises(piper.DirectiveError, match="one device group"):
        compile_mlp([piper.place({"PP": 0}, [0]), piper.place({"PP": 1}, [1]), bad])


def test_region_left_unplaced() -> None:
    with pytest.raises(piper.DirectiveError, match=r"region \{'PP': 1\}.*not placed.*place"):
        compile_mlp([piper.place({"PP": 0}, [0])])


def test_place_on_two_devices_without_replicate() -> None:
    with pytest.raises(piper.DirectiveError, match="without replicate"):
        compile_mlp([piper.place({"PP": "*"}, [0, 1])])


def test_unknown_op_in_json(tmp_path) -> None:
    path = tmp_path / "bad.json"
    path.write_text(
        json.dumps(
            [
                {"op": "place", "filter": {"PP": 0}, "devices": [0]},
                {"op": "teleport", "filter": {"PP": 1}},
            ]
        )
    )
    with pytest.raises(piper.DirectiveError, match="directive 1: unknown op 'teleport'"):
        piper.load_directives(path)


def test_bad_filter_value() -> None:
    with pytest.raises(piper.DirectiveError, match="filter value for 'PP'"):
        piper.place({"PP": -1}, [0])


def test_schedule_with_too_few_stages_placed() -> None:
    """A schedule naming a stage that does not exist is refused naming the group."""
    with pytest.raises(piper.DirectiveError, match="group 0 .*PP:2.*matches no node"):
        compile_mlp(
            [
                piper.split({"PP": "*"}, num_microbatches=2),
                piper.place({"PP": 0}, [0]),
                piper.place({"PP": 1}, [1]),
                *schedules.one_f_one_b(3, 2),
            ]
        )


def test_mixed_zero_settings_on_one_group_refused() -> None:
    with pytest.raises(piper.DirectiveError, match="mixes ZeRO settings"):
        compile_mlp(
            [
                piper.replicate({"PP": 0}, [0, 1], shard_grads=True),
                piper.replicate({"PP": 1}, [0, 1]),
            ]
        )


def test_per_tensor_optimizer_refused_under_zero() -> None:
    """LAMB scales each tensor by its own norm: flat ZeRO shards would change that."""
    with pytest.raises(piper.PiperError, match="couples parameters"):
        piper.compile(
            mlp_loss,
            StageMLP(2),
            optax.lamb(1e-3),
            mlp_batches(1)[0],
            [piper.replicate({"PP": "*"}, [0, 1], shard_grads=True)],
        )


def test_global_norm_clip_across_stages_is_supported() -> None:
    opt = optax.chain(optax.clip_by_global_norm(0.01), optax.adam(1e-2))
    step = piper.compile(
        mlp_loss,
        StageMLP(2),
        opt,
        mlp_batches(1)[0],
        [piper.place({"PP": 0}, [0]), piper.place({"PP": 1}, [1])],
    )
    # one more ALL_REDUCE, over every device, with no parameters: the squared norms
    assert "ALL_REDUCE" in step.explain() and "d0,1" in step.explain()


def test_all_errors_are_value_errors() -> None:
    assert issubclass(piper.PiperError, ValueError)
    for cls in (piper.DirectiveError, piper.BatchError, piper.PlanError, piper.AnnotationError):
        assert issubclass(cls, piper.PiperError)


def test_overlap_group_needing_itself_through_another_group_refused() -> None:
    """Passes in one order group run as one program once all its inputs exist: B0.0 needs
    F0.0's output by way of F1.0 and B1.0 on d1, so the two cannot share a program (this
    used to crash at the first step, and through another device, hang)."""
    together = piper.order([[{"PP": 0, "MB": 0, "PASS": "F"}, {"PP": 0, "MB": 0, "PASS": "B"}]])
    with pytest.raises(piper.DirectiveError, match="B0.0 needs F0.0's output by way of"):
        compile_mlp(
            [
                piper.split({"PP": "*"}, num_microbatches=2),
                piper.place({"PP": 0}, [0]),
                piper.place({"PP": 1}, [1]),
                together,
            ]
        )


def test_overlap_group_of_dependent_passes_on_one_device_runs_as_one_program() -> None:
    """F0.0 and F1.0 on one device: the group's program runs them in data order."""
    together = piper.order([[{"PP": 0, "MB": 0, "PASS": "F"}, {"PP": 1, "MB": 0, "PASS": "F"}]])
    step = check_mlp_strategy([piper.split({"PP": "*"}, num_microbatches=2), together], OPT)
    assert "F0.0 + F1.0" in step.explain()


def test_batch_with_other_trailing_shape_or_dtype() -> None:
    step = compile_mlp([])
    batch = mlp_batches(1)[0]
    with pytest.raises(piper.BatchError, match=r"batch leaf \['x'\] is float32\[16, 5\]"):
        step({"x": batch["x"][:, :5], "y": batch["y"]})
    with pytest.raises(piper.BatchError, match="float64"):
        step({"x": batch["x"].astype("float64"), "y": batch["y"]})


def test_devices_must_be_jax_devices() -> None:
    with pytest.raises(piper.DirectiveError, match="jax.Device objects"):
        piper.compile(mlp_loss, StageMLP(2), OPT, mlp_batches(1)[0], [], devices=[0, 1])
    import jax

    with pytest.raises(piper.DirectiveError, match="names a device twice"):
        piper.compile(
            mlp_loss, StageMLP(2), OPT, mlp_batches(1)[0], [], devices=[jax.devices()[0]] * 2
        )


def test_model_with_mutable_state_refused() -> None:
    """BatchNorm's running statistics change in training: refused (dropout is fine)."""
    from flax import nnx

    class Normed(StageMLP):
        def __init__(self) -> None:
            super().__init__(2)
            self.norm = nnx.BatchNorm(8, rngs=nnx.Rngs(1))

        def __call__(self, x):
            return super().__call__(self.norm(x))

    with pytest.raises(piper.AnnotationError, match="changes state other than its nnx.Param"):
        piper.compile(mlp_loss, Normed(), OPT, mlp_batches(1)[0], [])
