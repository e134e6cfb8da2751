"""The DESIGN.md oracle: every strategy trains exactly like single-device value_and_grad."""

from __future__ import annotations

import json

import optax
import pytest
from helpers import check_mlp_strategy, mlp_batches
from piper_jax.mpmd_runtime import binders

import piper_jax as piper
from piper_jax import schedules

OPT = optax.adam(1e-2)


def pipeline(num_stages: int, m: int, schedule, replicas: int = 1) -> list:
    directives = [piper.split({"PP": "*"}, num_microbatches=m)]
    for s in range(num_stages):
        devices = [s + k * num_stages for k in range(replicas)]
        directives.append(piper.place({"PP": s}, devices))
        if replicas > 1:
            directives.append(piper.replicate({"PP": s}, devices))
    return directives + schedule(num_stages, m)


STRATEGIES = {
    "no_directives": (2, lambda: []),
    "pp2_gpipe_m4": (2, lambda: pipeline(2, 4, schedules.gpipe)),
    "pp2_1f1b_m4": (2, lambda: pipeline(2, 4, schedules.one_f_one_b)),
    "dp2": (2, lambda: [piper.replicate({"PP": "*"}, [0, 1])]),
    "pp2_dp2_1f1b": (2, lambda: pipeline(2, 2, schedules.one_f_one_b, replicas=2)),
    "pp4_1f1b_m8": (4, lambda: pipeline(4, 8, schedules.one_f_one_b)),
}


@pytest.mark.parametrize("name", sorted(STRATEGIES))
def test_strategy_matches_single_device(name: str) -> None:
    num_stages, directives = STRATEGIES[name]
    check_mlp_strategy(directives(), OPT, num_stages)


def test_directives_from_reference_json(tmp_path) -> None:
    """A strategy in the reference Piper JSON format (place + replicate, as dp2.json, plus a
    split and a hand-written order) trains like the reference."""
    strategy = [
        {"op": "split", "filter": {"PP": "*"}, "dim_name": "MB", "num_microbatches": 2},
        {"op": "place", "filter": {"PP": 0}, "devices": [0, 1], "stream": "pp"},
        {"op": "replicate", "filter": {"PP": 0}, "devices": [0, 1], "reduce_stream": "dp"},
        {"op": "place", "filter": {"PP": 1}, "devices": [2, 3]},
        {"op": "replicate", "filter": {"PP": 1}, "devices": [2, 3]},
        {
            "op": "order",
            "filters": [
                [{"PP": 1, "MB": 0, "PASS": "F"}],
                [{"PP": 1, "MB": 0, "PASS": "B"}],
                [{"PP": 1, "MB": 1, "PASS": "F"}],
                [{"PP": 1, "MB": 1, "PASS": "B"}],
            ],
        },
    ]
    path = tmp_path / "strategy.json"
    path.write_text(json.dumps(strategy))
    step = check_mlp_strategy(piper.load_directives(path), OPT)
    plan = [str(i) for i in step.plans.plans[(2, 3)] if i.op == "RUN"]
    assert plan[:4] == ["F1.0", "B1.0", "F1.1", "B1.1"]


def test_global_norm_clip_on_pipeline_matches_single_device() -> None:
    # sgd, not adam: adam is nearly blind to a wrong clip factor (see test_zero.py)
    opt = optax.chain(optax.clip_by_global_norm(0.05), optax.sgd(0.5))
    check_mlp_strategy(pipeline(4, 4, schedules.one_f_one_b), opt, num_stages=4)


@pytest.mark.parametrize(
    "directives",
    [
        [piper.replicate({"PP": "*"}, [0, 1, 2, 3])],
        pipeline(2, 2, schedules.one_f_one_b, replicas=2),
        [piper.replicate({"PP": "*"}, [0, 1, 2, 3], shard_params=True)],
    ],
    ids=["dp4", "pp2_dp2", "zero3_dp4"],
)
@pytest.mark.parametrize("concat_max", [None, 50], ids=["one_sum", "mixed"])
def test_global_norm_clip_over_replicas(
    directives: list, concat_max: int | None, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Every replica holds the all-reduced gradients (or, under ZeRO, its shards): the
    norm counts each element once, summed over one concatenation or (with a small
    NORM_CONCAT_MAX) partly per gradient."""
    if concat_max is not None:
        monkeypatch.setattr(binders, "NORM_CONCAT_MAX", concat_max)
    opt = optax.chain(optax.clip_by_global_norm(0.05), optax.sgd(0.5))
    check_mlp_strategy(directives, opt)


def test_sgd_with_schedule_and_weight_decay() -> None:
    """A learning-rate schedule and decoupled weight decay, on PP=2 x DP=2."""
    opt = optax.adamw(optax.linear_schedule(1e-2, 1e-3, 3), weight_decay=0.1)
    check_mlp_strategy(pipeline(2, 2, schedules.gpipe, replicas=2), opt)


def test_gradient_buckets() -> None:
    """bucket_size cuts the all-reduce: one collective per bucket, the last region's
    gradients first, and the same training."""
    directives = [
        piper.split({"PP": "*"}, num_microbatches=2),
        piper.replicate({"PP": "*"}, [0, 1], bucket_size=0.001),
    ]  # ~1 KB
    step = check_mlp_strategy(directives, OPT)
    reduces = [n for n in step.dag.nodes.values() if n.kind.value == "ALL_REDUCE"]
    assert len(reduces) > 1
    names = [step.lifted.param_names[p] for p in min(reduces, key=lambda n: n.uid).params]
    assert any("blocks" in n and "1" in n for n in names)  # the last stage's block first
    with pytest.raises(piper.DirectiveError, match="bucket_size must be"):
        piper.replicate({"PP": "*"}, [0, 1], bucket_size=0)


def test_clip_threshold_above_proxy_scale_still_global() -> None:
    """A max_norm far above the optimizer check's proxies must still clip by the global
    norm across stages (the check once missed it and each stage clipped alone)."""
    opt = optax.chain(optax.clip_by_global_norm(100.0), optax.sgd(1e-3))
    batches = mlp_batches(3)
    for b in batches:
        b["y"] = b["y"] * 300.0  # gradient norm about 600: the clip is active
    check_mlp_strategy(pipeline(2, 2, schedules.one_f_one_b), opt, batches=batches)


def test_each_distinct_program_is_compiled_once() -> None:
    """Passes that differ only in their microbatch share one program: the number of
    programs of a pipeline does not grow with the number of microbatches."""

    def programs(m: int) -> int:
        step = check_mlp_strategy(pipeline(2, m, schedules.one_f_one_b), OPT)
        return len(step._executor._unit_programs)

    assert programs(8) == programs(2) <= 12
