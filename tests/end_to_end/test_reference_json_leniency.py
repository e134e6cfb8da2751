"""Strategy files in the reference Piper's exact shape (its harness's empty-filter split, its
`device` alias and stream fields) train equal to the single-device reference."""

from __future__ import annotations

import json

import optax
from helpers import check_mlp_strategy

import piper_jax as piper


def _as_reference_file(tmp_path, entries: list) -> list:
    path = tmp_path / "schedule.json"
    path.write_text(json.dumps(entries, indent=1))
    return piper.load_directives(path)


def test_schedule_file_with_the_harness_split_trains_like_the_reference(tmp_path) -> None:
    """Placement, 1F1B orders as the reference writes them, then the harness's split."""
    orders = [
        {"op": "order", "filters": [[dict(f) for f in group] for group in order.filters]}
        for order in piper.schedules.one_f_one_b(2, 4)
    ]
    entries = [
        {"op": "place", "filter": {"PP": 0}, "device": [0], "stream": "pp_stream"},
        {"op": "place", "filter": {"PP": 1}, "devices": [1], "stream": "pp_stream"},
        *orders,
        {"op": "split", "filter": {}, "dim_name": "MB", "num_microbatches": 4},
    ]
    step = check_mlp_strategy(_as_reference_file(tmp_path, entries), optax.adam(3e-2))
    assert {n.microbatch for n in step.dag.compute_nodes()} == {0, 1, 2, 3}
    assert {n.devices for n in step.dag.compute_nodes()} == {(0,), (1,)}


def test_data_parallel_file_with_stream_fields_trains_like_the_reference(tmp_path) -> None:
    """The reference's base-schedules/dp2.json, for both stages, with its reduce_stream."""
    entries = []
    for stage, devices in ((0, [0, 1]), (1, [2, 3])):
        entries += [
            {"op": "place", "filter": {"PP": stage}, "devices": devices},
            {
                "op": "replicate",
                "filter": {"PP": stage},
                "device": devices,
                "reduce_stream": "dp_stream",
                "gather_stream": "dp_stream",
            },
        ]
    entries.append({"op": "split", "filter": {}, "dim_name": "MB", "num_microbatches": 2})
    check_mlp_strategy(_as_reference_file(tmp_path, entries), optax.sgd(0.1))


def test_dualpipev_file_as_the_reference_builds_it_trains_like_the_reference(tmp_path) -> None:
    """DualPipeV on 2 ranks as the reference's builder writes it: V placement, overlap
    groups of a forward beside a whole B, zero-bubble BI/BW for other microbatches of the
    same stages, and the harness's empty-filter split last."""
    orders = [
        {"op": "order", "filters": [[dict(f) for f in group] for group in order.filters]}
        for order in piper.schedules.dualpipev(2, 4)
    ]
    passes = {f["PASS"] for o in orders for g in o["filters"] for f in g}
    assert passes == {"F", "B", "BI", "BW"}
    entries = [
        {"op": "place", "filter": {"PP": s}, "devices": [min(s, 3 - s)], "stream": "pp_stream"}
        for s in range(4)
    ]
    entries += orders + [{"op": "split", "filter": {}, "dim_name": "MB", "num_microbatches": 4}]
    step = check_mlp_strategy(_as_reference_file(tmp_path, entries), optax.adam(3e-2), 4)
    stage3 = {(n.pass_, n.microbatch) for n in step.dag.compute_nodes() if n.region == 3}
    assert ("BI", 0) in stage3 and ("B", 1) in stage3  # both kinds on one stage


def test_per_microbatch_backward_split_trains_like_the_reference(tmp_path) -> None:
    """Stage 1 runs a whole B for microbatch 0 and BI then BW for microbatch 1."""
    order = [
        [{"PP": 1, "MB": 0, "PASS": "F"}],
        [{"PP": 1, "MB": 0, "PASS": "B"}],
        [{"PP": 1, "MB": 1, "PASS": "F"}],
        [{"PP": 1, "MB": 1, "PASS": "BI"}],
        [{"PP": 1, "MB": 1, "PASS": "BW"}],
    ]
    entries = [
        {"op": "split", "filter": {}, "dim_name": "MB", "num_microbatches": 2},
        {"op": "place", "filter": {"PP": 0}, "devices": [0]},
        {"op": "place", "filter": {"PP": 1}, "devices": [1]},
        {"op": "order", "filters": order},
    ]
    step = check_mlp_strategy(_as_reference_file(tmp_path, entries), optax.adam(3e-2))
    runs = [str(i) for i in step.plans.plans[(1,)] if i.op == "RUN"]
    assert runs == ["F1.0", "B1.0", "F1.1", "BI1.1", "BW1.1"]
