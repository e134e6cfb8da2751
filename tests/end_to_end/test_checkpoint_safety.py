"""Damaged, incomplete and unwritable checkpoints: a PiperError naming the path (and the leaf
where one is at fault), the step's own state untouched, other checkpoints left alone."""

from __future__ import annotations

import errno
import glob
import os
import shutil

import jax
import numpy as np
import optax
import orbax.checkpoint as ocp
import pytest
from helpers import StageMLP, mlp_batches, mlp_loss

import piper_jax as piper

WIDTH = 64  # big enough that orbax writes the kernels to a data file of their own
BATCH = mlp_batches(1)[0]
# a leaf named in a refusal: which one depends on the order orbax wrote them in
LEAF = r"(parameter|optimizer state leaf) \S*\['(blocks|embed)'\]"


def _step(seed: int = 0) -> piper.TrainStep:
    from flax import nnx

    model = StageMLP(2, width=WIDTH, rngs=nnx.Rngs(seed))
    return piper.compile(mlp_loss, model, optax.adam(1e-2), BATCH, [])


@pytest.fixture(scope="module")
def saved(tmp_path_factory) -> str:
    """A checkpoint of one trained step, copied by each test before it damages it."""
    step = _step()
    step(BATCH)
    path = str(tmp_path_factory.mktemp("saved") / "ckpt")
    step.save(path)
    return path


@pytest.fixture(scope="module")
def fresh() -> piper.TrainStep:
    """The step the checkpoints are restored into (its state must survive every refusal)."""
    return _step(seed=3)


def _copy(saved: str, tmp_path) -> str:
    path = str(tmp_path / "ckpt")
    shutil.copytree(saved, path)
    return path


def _state(step: piper.TrainStep) -> list[np.ndarray]:
    return [np.asarray(x) for x in jax.tree.leaves(step.params())] + [
        np.asarray(v) for _, v in sorted(step._executor.optimizer_state().items())
    ]


def _assert_refused(step: piper.TrainStep, path: str, message: str) -> None:
    before = _state(step)
    with pytest.raises(piper.PiperError, match=message):
        step.restore(path)
    after = _state(step)
    assert len(after) == len(before)
    for a, b in zip(after, before):
        np.testing.assert_array_equal(a, b)


def _data_file(path: str) -> str:
    """The array data file holding the kernels (the largest one)."""
    files = glob.glob(os.path.join(path, "arrays", "**", "d", "*"), recursive=True)
    return max(files, key=os.path.getsize)


def test_damaged_data_is_refused_naming_the_leaf(saved, fresh, tmp_path) -> None:
    """64 bytes overwritten inside the data: where orbax notices (a broken compressed
    stream) or decodes other numbers without a word (caught by the checksum)."""
    path = _copy(saved, tmp_path)
    data = _data_file(path)
    with open(data, "r+b") as f:
        f.seek(os.path.getsize(data) // 3)
        f.write(b"\x7f" * 64)
    damaged = (
        f"{path}: the data of {LEAF}\\S* is missing or damaged|{LEAF}\\S* in {path} is damaged"
    )
    _assert_refused(fresh, path, damaged)


def test_data_that_decodes_to_other_numbers_fails_its_checksum(saved, fresh, tmp_path) -> None:
    """Well-formed arrays that are not the ones saved (here another checkpoint's)."""
    path = _copy(saved, tmp_path)
    fresh.save(tmp_path / "other")
    shutil.rmtree(os.path.join(path, "arrays"))
    shutil.copytree(tmp_path / "other" / "arrays", os.path.join(path, "arrays"))
    _assert_refused(fresh, path, LEAF + rf"\S* in {path} is damaged: its data has checksum")


def _garble(path: str) -> None:
    with open(os.path.join(path, "meta", "metadata"), "w") as f:
        f.write("{not json")


def _truncate(path: str) -> None:
    data = _data_file(path)
    with open(data, "r+b") as f:
        f.truncate(os.path.getsize(data) // 2)


INCOMPLETE = {
    "empty": (lambda p: [shutil.rmtree(p), os.mkdir(p)], r"its metadata .* is missing"),
    "no metadata": (lambda p: os.remove(os.path.join(p, "meta", "metadata")), "its metadata"),
    "garbled metadata": (_garble, "its metadata"),
    "metadata of something else": (
        lambda p: open(os.path.join(p, "meta", "metadata"), "w").write('{"format": 2}'),
        r"its metadata \(meta/\) is not a piper-jax record of leaves",
    ),
    "no arrays": (lambda p: shutil.rmtree(os.path.join(p, "arrays")), "its array data"),
    "no data file": (
        lambda p: os.remove(_data_file(p)),
        "the data of " + LEAF,
    ),
    "truncated data": (_truncate, "the data of " + LEAF),
}


@pytest.mark.parametrize("case", INCOMPLETE)
def test_incomplete_checkpoint_is_refused_saying_what_is_missing(
    case, saved, fresh, tmp_path
) -> None:
    path = _copy(saved, tmp_path)
    damage, what = INCOMPLETE[case]
    damage(path)
    _assert_refused(fresh, path, f"not a complete piper-jax checkpoint at {path}: {what}")


def test_an_intact_copy_still_restores(saved, fresh, tmp_path) -> None:
    """The refusals above come from the damage, not from restoring a copy."""
    fresh.restore(_copy(saved, tmp_path))
    reference = _step()
    reference(BATCH)
    for got, want in zip(_state(fresh), _state(reference)):
        np.testing.assert_allclose(got, want, rtol=1e-6)


@pytest.mark.parametrize(
    "where",
    ["metadata", "arrays"],
)
def test_save_onto_a_full_disk_cleans_up_and_names_the_cause(
    where, saved, fresh, tmp_path, monkeypatch
) -> None:
    other = _copy(saved, tmp_path)  # tmp_path/ckpt: another checkpoint beside the new one
    before = sorted(os.listdir(tmp_path))
    full = OSError(errno.ENOSPC, "No space left on device")

    async def no_space(*args, **kwargs):
        raise full

    if where == "metadata":
        monkeypatch.setattr(ocp.handlers.JsonCheckpointHandler, "_save_fn", no_space)
    else:
        monkeypatch.setattr(ocp.handlers.StandardCheckpointHandler, "async_save", no_space)
    target = str(tmp_path / "new")
    with pytest.raises(
        piper.PiperError, match=f"could not write the checkpoint {target}: .*No space left"
    ):
        fresh.save(target)
    assert sorted(os.listdir(tmp_path)) == before  # no new, no *.orbax-checkpoint-tmp*
    monkeypatch.undo()
    _assert_refused(fresh, target, "no checkpoint directory")
    fresh.restore(other)  # the other checkpoint is whole
