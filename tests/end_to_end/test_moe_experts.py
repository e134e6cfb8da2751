"""The example MoE transformer under expert parallelism, trained equal to single-device
training (same routing, same capacity, the auxiliary loss included): EP=2 and EP=4
alone, PP=2 x EP=2, PP=2 x DP=2 x EP=2 under 1F1B, and the paper's PP=2 x DP=2 x EP=2
under DualPipeV with ZeRO-1, where in the fused forward-and-backward programs one
microbatch's all-to-all is scheduled among the other's compute. (PP=2 x EP=2 across two
processes: tests/multiprocess.)"""

from __future__ import annotations

import os
import re
import sys

import optax
import pytest
from flax import nnx
from helpers import assert_matches_reference, token_batches

import piper_jax as piper
from piper_jax import schedules

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
sys.path.insert(0, os.path.join(ROOT, "examples"))

from moe import MoEConfig, MoETransformer, loss_fn  # noqa: E402

OPT = optax.adamw(1e-2, eps=1e-4)
SEQ_LEN, BATCH = 8, 16


def stages_on(groups: list[list[int]], ep: int, stage_group: list[int], **replicate: bool):
    """Stage s on groups[stage_group[s]], replicated over it, its experts split over
    the first `ep` devices of that group."""
    directives = []
    for s, g in enumerate(stage_group):
        devices = groups[g]
        directives += [
            piper.place({"PP": s}, devices),
            piper.replicate({"PP": s}, devices, **replicate),
            piper.shard({"PP": s, "EP": "*"}, devices[:ep]),
        ]
    return directives


def split(m: int) -> list:
    return [piper.split({"PP": "*"}, num_microbatches=m)]


DP2 = [[0, 1, 2, 3], [4, 5, 6, 7]]
CASES = {
    "ep2": (1, lambda: stages_on([[0, 1]], 2, [0])),
    "ep4": (1, lambda: stages_on([[0, 1, 2, 3]], 4, [0])),
    "pp2_ep2": (
        2,
        lambda: split(2) + stages_on([[0, 1], [2, 3]], 2, [0, 1]) + schedules.one_f_one_b(2, 2),
    ),
    "pp2_dp2_ep2_1f1b": (
        2,
        lambda: split(4) + stages_on(DP2, 2, [0, 1]) + schedules.one_f_one_b(2, 4),
    ),
    "pp2_dp2_ep2_dualpipev_zero1": (
        4,
        lambda: (
            split(4) + stages_on(DP2, 2, [0, 1, 1, 0], shard_grads=True) + schedules.dualpipev(2, 4)
        ),
    ),
}


def config(stages: int) -> MoEConfig:
    return MoEConfig(d_model=16, n_heads=2, n_layers=stages, num_stages=stages, d_expert=32)


@pytest.mark.parametrize("name", sorted(CASES))
def test_moe_under_expert_parallelism_trains_like_one_device(name: str) -> None:
    stages, directives = CASES[name]
    cfg = config(stages)

    def make() -> MoETransformer:
        return MoETransformer(cfg, rngs=nnx.Rngs(0))

    batches = token_batches(3, cfg.vocab_size, SEQ_LEN, batch_size=BATCH)
    step = piper.compile(loss_fn, make(), OPT, batches[0], directives())
    assert "ep=" in step.explain()
    assert_matches_reference(step, loss_fn, make, OPT, batches)
    if "dualpipev" in name:
        check_all_to_all_among_other_compute(step._executor.program_texts())


def check_all_to_all_among_other_compute(texts: dict[str, str]) -> None:
    """In a fused overlap unit ("F.. + B.."), XLA's schedule of the entry computation puts
    an all-to-all after some of the unit's compute and before more of it: while one
    microbatch's tokens move, the other microbatch's work has not all run."""
    fused = {k: t for k, t in texts.items() if re.search(r"F\d+\.\d+ \+ B", k)}
    assert fused, sorted(texts)
    placed = []
    for label, text in fused.items():
        entry = text[text.index("\nENTRY") :]
        ops = [line for line in entry.splitlines() if " = " in line]
        a2a = [i for i, line in enumerate(ops) if "all-to-all(" in line]
        compute = [i for i, line in enumerate(ops) if "fusion(" in line or " dot(" in line]
        if a2a and compute:
            placed.append((label, compute[0] < a2a[0], a2a[-1] < compute[-1], len(a2a)))
    assert placed, "no fused unit holds an all-to-all"
    assert any(before and after for _, before, after, _ in placed), placed


def test_evaluation_under_expert_parallelism_equals_the_plain_model() -> None:
    """The held-out loss of PP=2 x EP=2 (forward-only plans, their own all-to-alls)
    equals the plain model's on one device."""
    cfg = config(2)
    directives = split(2) + stages_on([[0, 1], [2, 3]], 2, [0, 1]) + schedules.one_f_one_b(2, 2)
    batch = token_batches(1, cfg.vocab_size, SEQ_LEN, batch_size=BATCH)[0]
    step = piper.compile(loss_fn, MoETransformer(cfg, rngs=nnx.Rngs(0)), OPT, batch, directives)
    plain = loss_fn(MoETransformer(cfg, rngs=nnx.Rngs(0)), batch)
    assert step.evaluate(batch)["loss"] == pytest.approx(float(plain), rel=1e-5)
