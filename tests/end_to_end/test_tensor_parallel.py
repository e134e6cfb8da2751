"""Tensor parallelism inside a stage (shard_tensor): the example GPT's attention and MLP
split Megatron-style, trained equal to single-device training alone and composed with
pipelines, data parallelism and resharding to a stage without it."""

from __future__ import annotations

import json
import os
import sys

import optax
import pytest
from flax import nnx
from helpers import assert_matches_reference, check_mlp_strategy, token_batches
from piper_jax.mpmd_runtime import buffers as bf

import piper_jax as piper

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
sys.path.insert(0, os.path.join(ROOT, "examples"))

from gpt import GPT, GPTConfig, loss_fn  # noqa: E402

MEGATRON = {"qkv": "colwise", "attn/out": "rowwise", "fc": "colwise", "proj": "rowwise"}
OPT = optax.adamw(1e-2, eps=1e-4)


def stage_groups(groups: list[list[int]], tp: int, replicated: bool = False) -> list:
    """Stage s on groups[s], split over tp-sized runs of it (1: not split), under 1F1B."""
    directives = [piper.split({"PP": "*"}, num_microbatches=2)]
    for s, devices in enumerate(groups):
        directives.append(piper.place({"PP": s}, devices))
        if replicated:
            directives.append(piper.replicate({"PP": s}, devices))
        if tp > 1 and len(devices) >= tp:
            directives.append(piper.shard_tensor({"PP": s}, devices[:tp], params=MEGATRON))
    return directives + piper.schedules.one_f_one_b(len(groups), 2)


CASES = {
    "tp2": (1, lambda: [piper.shard_tensor({"PP": "*"}, [0, 1], params=MEGATRON)]),
    "tp2_dp2": (
        1,
        lambda: [
            piper.replicate({"PP": "*"}, [0, 1, 2, 3]),
            piper.shard_tensor({"PP": "*"}, [0, 1], params=MEGATRON),
        ],
    ),
    "pp2_tp2": (2, lambda: stage_groups([[0, 1], [2, 3]], tp=2)),
    "pp2_tp2_to_tp1": (2, lambda: stage_groups([[0, 1], [2]], tp=2)),
    "pp2_dp2_tp2": (2, lambda: stage_groups([[0, 1, 2, 3], [4, 5, 6, 7]], 2, replicated=True)),
}


@pytest.mark.parametrize("name", sorted(CASES))
def test_tensor_parallel_gpt_matches_single_device(name: str) -> None:
    stages, directives = CASES[name]
    config = GPTConfig(seq_len=16, d_model=32, n_heads=2, n_layers=2, num_stages=stages)
    batches = token_batches(3, config.vocab_size, config.seq_len)

    def make() -> GPT:
        return GPT(config, rngs=nnx.Rngs(0))

    step = piper.compile(loss_fn, make(), OPT, batches[0], directives())
    assert "tp=2" in step.explain()
    assert_matches_reference(step, loss_fn, make, OPT, batches)
    # the split parameters are held split: each device keeps half of a colwise kernel
    store = step._executor.rt.stores[min(step.plans.meshes)]
    kernel = store[bf.param("['blocks'][0]['fc']['kernel']")]
    assert {s.data.shape for s in kernel.addressable_shards} == {(32, 64)}


def test_reference_json_with_shard_tensor_trains_like_the_reference(tmp_path) -> None:
    """The reference's op, on the test MLP: blocks 0 and 1 split column- then row-wise."""
    entries = [
        {
            "op": "shard_tensor",
            "filter": {},
            "devices": [0, 1],
            "stream": "tp_stream",
            "params": {"blocks/0": "colwise", "blocks/1": "rowwise"},
        },
        {"op": "split", "filter": {}, "dim_name": "MB", "num_microbatches": 2},
    ]
    path = tmp_path / "tp.json"
    path.write_text(json.dumps(entries))
    step = check_mlp_strategy(piper.load_directives(path), optax.adam(1e-2))
    assert "tp=2" in step.explain()


def test_general_rules_split_any_parameter() -> None:
    """A rule by path pattern: the tied embedding split along its second dimension."""
    directives = [piper.shard_tensor({"PP": "*"}, [0, 1], rules={r"\['embed'\]": [None, "tp"]})]
    step = check_mlp_strategy(directives, optax.adam(1e-2))
    assert "1 params split over tp" in step.explain()


def mlp_compile(directive: piper.ShardTensor | list) -> None:
    from helpers import StageMLP, mlp_batches, mlp_loss

    directives = directive if isinstance(directive, list) else [directive]
    piper.compile(mlp_loss, StageMLP(2), optax.sgd(0.1), mlp_batches(1)[0], directives)


def test_bad_shard_tensor_is_refused() -> None:
    with pytest.raises(piper.DirectiveError, match="module 'fc9', which holds no parameter"):
        mlp_compile(piper.shard_tensor({}, [0, 1], params={"fc9": "colwise"}))
    with pytest.raises(piper.DirectiveError, match=r"cannot be split 3 ways.*size 16"):
        mlp_compile(piper.shard_tensor({}, [0, 1, 2], params={"blocks/0": "colwise"}))
    with pytest.raises(
        piper.DirectiveError, match=r"colwise splits the kernel .*'scale' of rank 1"
    ):
        normed = GPTConfig(seq_len=16, d_model=32, n_heads=2, n_layers=2, num_stages=1)
        batch = token_batches(1, normed.vocab_size, normed.seq_len)[0]
        piper.compile(
            loss_fn,
            GPT(normed, rngs=nnx.Rngs(0)),
            OPT,
            batch,
            [piper.shard_tensor({}, [0, 1], params={"ln1": "colwise"})],
        )
    with pytest.raises(piper.DirectiveError, match=r"partitions 1 dimensions.*\[8, 16\]"):
        mlp_compile(piper.shard_tensor({}, [0, 1], rules={"embed": ["tp"]}))
    with pytest.raises(piper.DirectiveError, match="ZeRO and tensor parallelism do not combine"):
        mlp_compile(
            [
                piper.replicate({}, [0, 1, 2, 3], shard_params=True),
                piper.shard_tensor({}, [0, 1], params={"blocks/0": "colwise"}),
            ]
        )
    with pytest.raises(piper.DirectiveError, match="not a run of consecutive devices"):
        mlp_compile(
            [
                piper.replicate({}, [0, 1, 2, 3]),
                piper.shard_tensor({}, [1, 2], params={"blocks/0": "colwise"}),
            ]
        )
    with pytest.raises(piper.DirectiveError, match="colwise.*or 'rowwise'"):
        piper.shard_tensor({}, [0, 1], params={"fc": "diagonal"})
