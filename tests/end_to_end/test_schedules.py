"""Advanced schedules and recompute train exactly like single-device value_and_grad."""

from __future__ import annotations

import re

import optax
import pytest
from helpers import StageMLP, check_mlp_strategy, mlp_batches, mlp_loss

import piper_jax as piper
from piper_jax import schedules

OPT = optax.adam(1e-2)


def placed(num_stages: int, device_of) -> list:
    return [piper.place({"PP": s}, [device_of(s)]) for s in range(num_stages)]


def split(m: int) -> list:
    return [piper.split({"PP": "*"}, num_microbatches=m)]


def dualpipev_placement(ranks: int) -> list:
    return placed(2 * ranks, lambda s: min(s, 2 * ranks - 1 - s))


STRATEGIES = {
    "interleaved_4stages_2devices": (
        4,
        lambda: split(4) + placed(4, lambda s: s % 2) + schedules.interleaved_1f1b(4, 4, 2),
    ),
    "zero_bubble_h1_p2_m4": (
        2,
        lambda: split(4) + placed(2, lambda s: s) + schedules.zero_bubble_h1(2, 4),
    ),
    "dualpipev_2ranks_m4": (
        4,
        lambda: split(4) + dualpipev_placement(2) + schedules.dualpipev(2, 4),
    ),
    "dualpipev_4ranks_m8": (
        8,
        lambda: split(8) + dualpipev_placement(4) + schedules.dualpipev(4, 8),
    ),
    "recompute_1f1b": (
        2,
        lambda: (
            split(4)
            + placed(2, lambda s: s)
            + [piper.recompute({"PP": 0})]
            + schedules.one_f_one_b(2, 4)
        ),
    ),
    "recompute_dp2": (
        2,
        lambda: [piper.replicate({"PP": "*"}, [0, 1]), piper.recompute({"PP": "*"})],
    ),
    "recompute_dots_1f1b": (
        2,
        lambda: (
            split(4)
            + placed(2, lambda s: s)
            + [piper.recompute({"PP": 1}, keep="dots")]
            + schedules.one_f_one_b(2, 4)
        ),
    ),
}


@pytest.mark.parametrize("name", sorted(STRATEGIES))
def test_schedule_matches_single_device(name: str) -> None:
    num_stages, directives = STRATEGIES[name]
    check_mlp_strategy(directives(), OPT, num_stages)


def test_dualpipev_overlap_groups_put_forward_and_backward_side_by_side() -> None:
    step = piper.compile(
        mlp_loss,
        StageMLP(4),
        OPT,
        mlp_batches(1)[0],
        split(4) + dualpipev_placement(2) + schedules.dualpipev(2, 4),
    )
    # rank 0's main loop: F of stage 0 with the whole backward of stage 3, one XLA program;
    # stage 3's first backward is zero-bubble (BI now, BW later): both kinds on one stage
    assert re.search(r"; F0\.\d \+ B3\.\d;", step.explain())
    runs = [str(i) for i in step.plans.plans[(0,)] if i.op == "RUN"]
    assert runs.index("BI3.0") < runs.index("BW3.0") < runs.index("F0.3")
    assert "B3.1" in runs and "BI3.1" not in runs


def test_dualpipev_needs_enough_microbatches() -> None:
    with pytest.raises(piper.DirectiveError, match=r"num_microbatches \(3\).*at least.*\(4\)"):
        schedules.dualpipev(2, 3)


def test_interleaved_needs_divisible_stages() -> None:
    with pytest.raises(piper.DirectiveError, match="multiples of num_devices"):
        schedules.interleaved_1f1b(3, 4, 2)


def test_recompute_and_backward_split_conflict() -> None:
    with pytest.raises(piper.DirectiveError, match="both recomputed and split"):
        piper.compile(
            mlp_loss,
            StageMLP(2),
            OPT,
            mlp_batches(1)[0],
            split(2)
            + placed(2, lambda s: s)
            + [piper.recompute({"PP": 0})]
            + schedules.zero_bubble_h1(2, 2),
        )
