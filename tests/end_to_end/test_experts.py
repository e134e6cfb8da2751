"""Expert parallelism (shard) on the test MLP's toy expert layers: the experts split over
an `ep` axis, alone and composed with pipelines, data parallelism and ZeRO, trained equal
to single-device training; the reference JSON; bad input refused."""

from __future__ import annotations

import json

import optax
import pytest
from helpers import StageMLP, check_mlp_strategy, mlp_batches, mlp_loss
from piper_jax.mpmd_runtime import buffers as bf

import piper_jax as piper
from piper_jax import schedules

OPT = optax.adam(1e-2)
EXPERTS = 4


def stages_on(groups: list[list[int]], ep: int, m: int = 2, **replicate: bool) -> list:
    """Stage s replicated over groups[s], its experts split over the first `ep` devices
    of it, under 1F1B."""
    directives = [piper.split({"PP": "*"}, num_microbatches=m)]
    for s, devices in enumerate(groups):
        directives += [
            piper.place({"PP": s}, devices),
            piper.replicate({"PP": s}, devices, **replicate),
            piper.shard({"PP": s, "EP": "*"}, devices[:ep]),
        ]
    return directives + schedules.one_f_one_b(len(groups), m)


CASES = {
    "ep2": (1, lambda: stages_on([[0, 1]], ep=2, m=1)),
    "ep4": (1, lambda: stages_on([[0, 1, 2, 3]], ep=4, m=1)),
    "pp2_ep2": (2, lambda: stages_on([[0, 1], [2, 3]], ep=2)),
    "pp2_dp2_ep2_zero1": (
        2,
        lambda: stages_on([[0, 1, 2, 3], [4, 5, 6, 7]], ep=2, shard_grads=True),
    ),
    "pp2_dp2_ep2_zero3": (
        2,
        lambda: stages_on([[0, 1, 2, 3], [4, 5, 6, 7]], ep=2, shard_params=True),
    ),
}


@pytest.mark.parametrize("name", sorted(CASES))
def test_experts_split_over_ep_train_like_one_device(name: str) -> None:
    stages, directives = CASES[name]
    step = check_mlp_strategy(directives(), OPT, stages, experts=EXPERTS)
    text = step.explain()
    assert "ep=" in text and "split over ep" in text
    assert "come (dispatch) and go (combine) by all-to-all over ep" in text
    if "zero3" in name:
        return  # ZeRO-3 holds every parameter as flat shards over dp
    # each device holds only its own experts
    group = min(step.plans.meshes)
    ep = step.plans.meshes[group].axis_size("ep")
    experts = step._executor.rt.stores[group][bf.param("['experts'][0]")]
    assert {s.data.shape[0] for s in experts.addressable_shards} == {EXPERTS // ep}


def test_expert_programs_hold_the_all_to_all() -> None:
    """Tokens go to their experts' devices and back by all-to-all, not by gathering."""
    step = check_mlp_strategy(stages_on([[0, 1]], ep=2, m=1), OPT, 1, experts=EXPERTS)
    texts = step._executor.program_texts()
    assert any("all-to-all" in t for t in texts.values()), sorted(texts)


def test_reference_json_pp2_dp2_ep2_trains_like_the_reference(tmp_path) -> None:
    """The reference's ops, as its files write them: place, replicate (one stage with
    ZeRO's fields), shard with its stream, and the empty split filter."""
    entries = [{"op": "split", "filter": {}, "dim_name": "MB", "num_microbatches": 2}]
    for s, devices in enumerate(([0, 1, 2, 3], [4, 5, 6, 7])):
        replicate = {"op": "replicate", "filter": {"PP": s}, "devices": devices}
        if s:
            replicate |= {"shard_grads": True, "bucket_size": 0.001, "reduce_stream": "rs"}
        entries += [
            {"op": "place", "filter": {"PP": s}, "devices": devices},
            replicate,
            {"op": "shard", "filter": {"PP": s, "EP": "*"}, "devices": devices[2:], "stream": "ep"},
        ]
    path = tmp_path / "pp2_dp2_ep2.json"
    path.write_text(json.dumps(entries))
    directives = piper.load_directives(str(path)) + schedules.one_f_one_b(2, 2)
    check_mlp_strategy(directives, OPT, 2, experts=EXPERTS)


def compile_experts(directives: list, experts: int = EXPERTS) -> None:
    piper.compile(mlp_loss, StageMLP(2, experts=experts), OPT, mlp_batches(1)[0], directives)


def test_shard_on_a_region_without_experts_is_refused() -> None:
    directives = [piper.place({"PP": "*"}, [0, 1]), piper.replicate({"PP": "*"}, [0, 1])]
    with pytest.raises(piper.DirectiveError, match=r"shard \{PP:0\}.*hold no experts"):
        compile_experts(directives + [piper.shard({"PP": 0}, [0, 1])])


def test_devices_not_dividing_the_experts_are_refused() -> None:
    directives = [piper.place({"PP": "*"}, [0, 1, 2]), piper.replicate({"PP": "*"}, [0, 1, 2])]
    with pytest.raises(piper.DirectiveError, match=r"4 experts cannot be split over 3 devices"):
        compile_experts(directives + [piper.shard({"EP": "*"}, [0, 1, 2])])


def test_ep_devices_across_data_parallel_runs_are_refused() -> None:
    """[1, 2] straddles the two ep runs [0, 1] and [2, 3] of the group."""
    directives = [
        piper.place({"PP": "*"}, [0, 1, 2, 3]),
        piper.replicate({"PP": "*"}, [0, 1, 2, 3]),
    ]
    with pytest.raises(piper.DirectiveError, match=r"not a run of consecutive devices"):
        compile_experts(directives + [piper.shard({"EP": "*"}, [1, 2])])


def test_ep_group_split_another_way_is_refused() -> None:
    """One group cannot be dp x tp for one region and dp x ep for another."""
    directives = [
        piper.place({"PP": "*"}, [0, 1]),
        piper.shard_tensor({"PP": 1}, [0, 1], params={"blocks/1": "colwise"}),
        piper.shard({"EP": "*"}, [0, 1]),
    ]
    with pytest.raises(piper.DirectiveError, match=r"one device group has one layout|split in"):
        compile_experts(directives)
