"""Note [twin regions share programs]: a device group holding several identical stages
compiles each of their passes once, and still trains like single-device training."""

from __future__ import annotations

import re

import optax
from helpers import StageMLP, check_mlp_strategy, mlp_batches, mlp_loss

import piper_jax as piper
from piper_jax import schedules

OPT = optax.adam(1e-2)


def labels_of_group(step, group: str) -> list[str]:
    """The plan steps (up to microbatch) whose programs group `group` compiled."""
    texts = step._executor.program_texts(optimized=False)
    return sorted(re.sub(r"\.\d+", "", label) for label in texts if label.startswith(group))


def test_dualpipev_middle_stages_share_their_programs() -> None:
    # stages 1 and 2 (the middle of StageMLP(4)) both lie on device 1 in DualPipeV's V
    directives = (
        [piper.split({"PP": "*"}, num_microbatches=4)]
        + [piper.place({"PP": s}, [min(s, 3 - s)]) for s in range(4)]
        + schedules.dualpipev(2, 4)
    )
    step = check_mlp_strategy(directives, OPT, num_stages=4)
    assert step._executor.rt.twins((1,)) == {1: 1, 2: 1}
    on_device_1 = labels_of_group(step, "d1:")
    # each program is named after the first step that ran it, of stage 1 or of stage 2:
    # no two programs differ only in which of the two they run
    as_either = [re.sub(r"(F|B|BI|BW)[12]\b", r"\1s", label) for label in on_device_1]
    assert len(set(as_either)) == len(as_either), on_device_1
    for passes in ("Fs", "Bs", "BIs", "BWs", "Fs + Bs"):
        assert f"d1: {passes}" in as_either, on_device_1
    assert {"d1: UPD1", "d1: UPD2"} <= set(on_device_1)  # updates: one per stage


def test_data_parallel_stages_share_programs_unless_their_forward_keeps_differently() -> None:
    replicated = [piper.replicate({"PP": "*"}, [0, 1])]
    step = check_mlp_strategy(replicated, OPT, num_stages=4)
    assert step._executor.rt.twins((0, 1)) == {0: 0, 1: 1, 2: 1, 3: 3}
    recomputed = replicated + [piper.recompute({"PP": 2})]
    batch = mlp_batches(1)[0]
    step = piper.compile(mlp_loss, StageMLP(4), OPT, batch, recomputed)
    assert step._executor.rt.twins((0, 1)) == {0: 0, 1: 1, 2: 2, 3: 3}
