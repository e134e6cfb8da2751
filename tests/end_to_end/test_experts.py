"""Expert parallelism (shard) on the test MLP's toy expert layers: the experts split over
an `ep` axis, alone and composed with pipelines, data parallelism and ZeRO, trained equal
to single-device training; the reference JSON; bad input refused."""

from __future__ import annotations

import json

import optax
import pytest
from helpers import StageMLP, check_mlp_strategy, mlp_batches, mlp_loss
from piper_jax.ir.dag import EdgeKind, NodeKind
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


def test_tokens_move_only_at_the_all_to_all_nodes() -> None:
    """shard puts an ALL_TO_ALL on every data edge into an expert pass (dispatch) and out
    of it (combine), forward and backward; each runs fused just before its reader, and
    XLA makes each one all-to-all in that program (left to itself, it moves the
    backward's tokens in three), with none in other programs (tokens are not gathered)."""
    step = check_mlp_strategy(stages_on([[0, 1], [2, 3]], ep=2, m=1), OPT, 2, experts=EXPERTS)
    dag = step.dag
    passes = [n for n in dag.compute_nodes() if n.param_layout.holds_experts]
    assert sorted(n.compute_label() for n in passes) == ["B1.0", "B4.0", "F1.0", "F4.0"]

    def others(uids: list[int], region: int) -> list:  # other passes, or all-to-alls
        nodes = [dag.nodes[u] for u in uids]
        compute = [x for x in nodes if x.kind is NodeKind.COMPUTE and x.region != region]
        return compute + [x for x in nodes if x.kind is NodeKind.ALL_TO_ALL]

    for n in passes:
        ins = others(dag.preds(n.uid, EdgeKind.DATA), n.region)
        outs = others(dag.succs(n.uid, EdgeKind.DATA), n.region)
        assert [(r.kind, r.value[:9]) for r in ins] == [(NodeKind.ALL_TO_ALL, "dispatch[")]
        assert outs and {(r.kind, r.value[:8]) for r in outs} == {(NodeKind.ALL_TO_ALL, "combine[")}
    for steps in step.plans.steps.values():
        for s in steps:
            for i, ins in enumerate(s.instructions):
                if ins.op == "ALL_TO_ALL":
                    assert str(s.instructions[i + 1]) == ins.value.split(">")[1][:-1], s
    texts = step._executor.program_texts()
    moves = {label: t.count("all-to-all(") for label, t in texts.items()}
    assert all(n == 1 for label, n in moves.items() if "ALL_TO_ALL" in label), moves
    assert not any(n for label, n in moves.items() if "ALL_TO_ALL" not in label), moves
    assert sum("ALL_TO_ALL" in label for label in moves) == 8, moves


@pytest.mark.parametrize(
    "zero",
    [
        {"shard_grads": True, "bucket_size": 0.001, "reduce_stream": "rs"},
        {"shard_params": True},
    ],
    ids=["shard_grads", "shard_params"],
)
def test_reference_json_pp2_dp2_ep2_trains_like_the_reference(tmp_path, zero: dict) -> None:
    """The reference's ops, as its files write them: place, replicate (one stage plain,
    one with ZeRO's fields), shard with its stream, and the empty split filter."""
    entries = [{"op": "split", "filter": {}, "dim_name": "MB", "num_microbatches": 2}]
    for s, devices in enumerate(([0, 1, 2, 3], [4, 5, 6, 7])):
        replicate = {"op": "replicate", "filter": {"PP": s}, "devices": devices}
        if s:
            replicate |= zero
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


def test_two_ep_widths_on_one_group_are_refused() -> None:
    """One group's replicas cannot be dp=2 x ep=2 for one expert region and dp=1 x ep=4
    for another: the ep and dp runs would overlap."""
    group = [0, 1, 2, 3]
    directives = [piper.place({"PP": "*"}, group), piper.replicate({"PP": "*"}, group)]
    directives += [
        piper.shard({"PP": 0, "EP": "*"}, [0, 1]),
        piper.shard({"PP": 1, "EP": "*"}, group),
    ]
    with pytest.raises(piper.DirectiveError, match=r"dp=2 x ep=2 .* dp=1 x ep=4 by shard"):
        compile_experts(directives)
