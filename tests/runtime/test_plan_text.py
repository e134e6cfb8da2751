"""Plans as stable text: golden plans of small strategies, read back unchanged, and
every collective of PP2 x DP2 with ZeRO-2 named in explain()."""

from __future__ import annotations

import os
import re

import optax
import pytest
from helpers import StageMLP, mlp_batches, mlp_loss
from piper_jax.mpmd_runtime.plans import Plans

import piper_jax as piper
from piper_jax import schedules

GOLDEN = os.path.join(os.path.dirname(__file__), "golden")


def pp2_dp2(flags: dict) -> list:
    directives = [piper.split({"PP": "*"}, num_microbatches=2)]
    for s in range(2):
        directives += [
            piper.place({"PP": s}, [s, s + 2]),
            piper.replicate({"PP": s}, [s, s + 2], **flags),
        ]
    return directives + schedules.one_f_one_b(2, 2)


STRATEGIES = {
    "1f1b_p2_m4": lambda: (
        [piper.split({"PP": "*"}, num_microbatches=4)]
        + [piper.place({"PP": s}, [s]) for s in range(2)]
        + schedules.one_f_one_b(2, 4)
    ),
    "pp2_dp2": lambda: pp2_dp2({}),
    "zero3_dp2": lambda: [
        piper.split({"PP": "*"}, num_microbatches=2),
        piper.replicate({"PP": "*"}, [0, 1], shard_params=True),
    ],
}


def lowered(directives: list) -> piper.Lowered:
    return piper.lower(
        mlp_loss, StageMLP(2), optax.adam(1e-2), mlp_batches(1)[0], directives, num_devices=8
    )


@pytest.mark.parametrize("name", sorted(STRATEGIES))
def test_golden_plan_text(name: str) -> None:
    """The plans of a few small strategies, as checked in. After an intended change of
    the plan compiler, rewrite them with PIPER_UPDATE_GOLDEN=1 and read the diff."""
    text = lowered(STRATEGIES[name]()).plans.to_text()
    path = os.path.join(GOLDEN, f"{name}.txt")
    if os.environ.get("PIPER_UPDATE_GOLDEN"):
        with open(path, "w") as f:
            f.write(text)
    with open(path) as f:
        assert text == f.read()
    assert Plans.from_text(text).to_text() == text


def test_recompute_in_plan_text() -> None:
    directives = [*pp2_dp2({}), piper.recompute({"PP": 0}), piper.recompute({"PP": 1}, "dots")]
    text = lowered(directives).plans.to_text()
    assert "\nrecompute 0 1:dots\n" in text
    assert Plans.from_text(text).recompute == {0: "inputs", 1: "dots"}
    with pytest.raises(piper.PlanError, match=r"plan text line \d+: recompute '1:all'"):
        Plans.from_text(text.replace("1:dots", "1:all"))


def test_plan_text_errors_name_the_line() -> None:
    text = lowered(STRATEGIES["1f1b_p2_m4"]()).plans.to_text().replace("F0.1", "G0.1", 1)
    with pytest.raises(piper.PlanError, match=r"plan text line \d+: not an instruction: 'G0.1'"):
        Plans.from_text(text)
    with pytest.raises(piper.PlanError, match="not a plan text"):
        Plans.from_text("hello")


def test_explain_names_every_collective_of_pp2_dp2_zero2() -> None:
    """Each backward reduce-scatters its gradients (fused into its program), each update
    gathers its shards back, the tied embedding is summed across both groups."""
    text = lowered(pp2_dp2({"shard_grads": True})).explain()
    for s, group in ((0, "d0,2"), (1, "d1,3")):
        for mb in range(2):
            assert re.search(rf"B{s}\.{mb} \+ REDUCE_SCATTER grad\[B{s}\.{mb}\] {group}", text)
        assert f"UPD{s} + ALL_GATHER param[UPD{s}] {group}" in text
    assert "ALL_REDUCE grad[0,1] d0,2,1,3" in text
    assert "ALL_REDUCE gnorm d0,2,1,3" in text
