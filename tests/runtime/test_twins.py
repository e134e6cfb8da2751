"""Note [twin regions share programs]: a device group holding several identical stages
compiles each of their passes once, and still trains like single-device training."""

from __future__ import annotations

import re

import jax
import numpy as np
import optax
import pytest
from flax import nnx
from helpers import (
    DUALPIPEV_MLP4,
    StageMLP,
    check_mlp_strategy,
    mlp_batches,
    mlp_loss,
    reference_training,
)
from piper_jax.mpmd_runtime.same_programs import SamePrograms

import piper_jax as piper
from piper_jax import schedules

OPT = optax.adam(1e-2)


def programs_of_stages_1_and_2(step, group: str) -> list[str]:
    """The plan steps whose programs `group` compiled, with stages 1 and 2 both written
    "s" (each program is named after the first step that ran it, of either stage)."""
    texts = step._executor.program_texts(optimized=False)
    labels = [re.sub(r"\.\d+", "", label) for label in texts if label.startswith(group)]
    return sorted(re.sub(r"(F|B|BI|BW)[12]\b", r"\1s", label) for label in labels)


def assert_shared(programs: list[str]) -> None:
    """No two programs differ only in which of the twin stages 1 and 2 they run."""
    assert len(set(programs)) == len(programs), programs


def test_dualpipev_middle_stages_share_their_programs() -> None:
    step = check_mlp_strategy(DUALPIPEV_MLP4, OPT, num_stages=4)
    assert step._executor.rt.twins((1,)) == {1: 1, 2: 1}
    on_device_1 = programs_of_stages_1_and_2(step, "d1:")
    assert_shared(on_device_1)
    for passes in ("Fs", "Bs", "BIs", "BWs", "Fs + Bs"):
        assert f"d1: {passes}" in on_device_1, on_device_1
    assert {"d1: UPD1", "d1: UPD2"} <= set(on_device_1)  # one plan step per stage's update


def test_interleaved_stages_on_each_device_share_their_programs() -> None:
    # 6 stages, 3 on each device: 2 and 4 on device 0, 1 and 3 on device 1 are twins
    directives = (
        [piper.split({"PP": "*"}, num_microbatches=4)]
        + [piper.place({"PP": s}, [s % 2]) for s in range(6)]
        + schedules.interleaved_1f1b(6, 4, 2)
    )
    step = check_mlp_strategy(directives, OPT, num_stages=6)
    assert step._executor.rt.twins((0,)) == {0: 0, 2: 2, 4: 2}
    assert step._executor.rt.twins((1,)) == {1: 1, 3: 1, 5: 5}


def test_data_parallel_stages_share_programs_unless_their_forward_keeps_differently() -> None:
    replicated = [piper.replicate({"PP": "*"}, [0, 1])]
    step = check_mlp_strategy(replicated, OPT, num_stages=4)
    assert step._executor.rt.twins((0, 1)) == {0: 0, 1: 1, 2: 1, 3: 3}
    recomputed = replicated + [piper.recompute({"PP": 2})]
    batch = mlp_batches(1)[0]
    step = piper.compile(mlp_loss, StageMLP(4), OPT, batch, recomputed)
    assert step._executor.rt.twins((0, 1)) == {0: 0, 1: 1, 2: 2, 3: 3}


def test_zero3_gathers_and_reduce_scatters_of_twins_share_programs() -> None:
    directives = [
        piper.split({"PP": "*"}, num_microbatches=2),
        piper.replicate({"PP": "*"}, [0, 1], shard_params=True),
    ]
    step = check_mlp_strategy(directives, OPT, num_stages=4)
    programs = programs_of_stages_1_and_2(step, "d0,1:")
    assert_shared(programs)
    assert "d0,1: ALL_GATHER param[Fs] d0,1 + Fs" in programs, programs


@pytest.fixture
def resolved(monkeypatch: pytest.MonkeyPatch) -> list[tuple[str, bool]]:
    """Each `SamePrograms.resolve` of the test: (function name, whether it handed back
    an earlier function's program)."""
    calls: list[tuple[str, bool]] = []
    resolve = SamePrograms.resolve

    def spied(self, jitted, args, devices):
        got = resolve(self, jitted, args, devices)
        calls.append((jitted.__name__, got is not jitted))
        return got

    monkeypatch.setattr(SamePrograms, "resolve", spied)
    return calls


def test_identical_stages_share_their_update_and_optimizer_init(resolved) -> None:
    """Note [updates of identical stages]: stage 2's update and init run stage 1's
    programs, and its optimizer state keeps its own paths."""
    batches = mlp_batches(3)
    step = check_mlp_strategy(DUALPIPEV_MLP4, OPT, num_stages=4, batches=batches)
    # device 1's stages 1 and 2 share; device 0's stages 0 and 3 (the embedding's ends) differ
    assert sorted(resolved) == sorted(
        [("_init_whole", False)] * 3
        + [("_init_whole", True)]
        + [("UPD0", False), ("UPD1", False), ("UPD2", True), ("UPD3", False)]
    ), resolved
    _, _, state = reference_training(mlp_loss, StageMLP(4), OPT, batches)
    leaves = jax.tree_util.tree_flatten_with_path(state)[0]
    want = {jax.tree_util.keystr(path): np.asarray(v) for path, v in leaves}
    got = step._executor.optimizer_state()
    assert got.keys() == want.keys()
    for key in want:
        np.testing.assert_allclose(got[key], want[key], rtol=1e-4, atol=1e-6, err_msg=key)


def test_updates_of_stages_an_optimizer_treats_differently_stay_apart(resolved) -> None:
    """Stage 2's update freezes its block by name: not stage 1's program."""

    def labels(params: nnx.State) -> nnx.State:
        def label(path: tuple, _: object) -> str:
            return "frozen" if "['blocks'][2]" in jax.tree_util.keystr(path) else "trained"

        return jax.tree_util.tree_map_with_path(label, params)

    optimizer = optax.multi_transform({"trained": OPT, "frozen": optax.set_to_zero()}, labels)
    step = check_mlp_strategy(DUALPIPEV_MLP4, optimizer, num_stages=4)
    assert not [name for name, shared in resolved if shared and name.startswith("UPD")], resolved
    first = jax.tree.leaves(StageMLP(4).blocks[2])
    for before, after in zip(first, jax.tree.leaves(step.params()["blocks"][2])):
        np.testing.assert_array_equal(np.asarray(after), np.asarray(before))


@pytest.mark.parametrize("flags", [{}, {"shard_params": True}], ids=["dp", "zero3"])
def test_data_parallel_stages_share_their_update_out_of_one_gradient_bucket(
    resolved, flags: dict
) -> None:
    """Each update takes only its own gradients out of the all-reduced (or
    reduce-scattered) bucket of every region's, so the updates of identical stages are
    one program, and still train like single-device training."""
    check_mlp_strategy([piper.replicate({"PP": "*"}, [0, 1], **flags)], OPT, num_stages=4)
    updates = {name: shared for name, shared in resolved if name.startswith("UPD")}
    assert updates == {"UPD1": False, "UPD2": True, "UPD3": True}, resolved
