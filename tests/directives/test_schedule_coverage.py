"""A schedule builder's orders must cover the split and the placed stages; a hand-written
order may cover part of the work."""

from __future__ import annotations

import optax
import pytest
from helpers import StageMLP, mlp_batches, mlp_loss
from piper_jax.directives.coverage import built_by

import piper_jax as piper
from piper_jax import schedules


def compile_pp(num_stages: int, m: int, orders: list):
    directives = [piper.split({"PP": "*"}, num_microbatches=m)]
    directives += [piper.place({"PP": s}, [s]) for s in range(num_stages)]
    batch = mlp_batches(1, batch_size=m)[0]
    return piper.compile(mlp_loss, StageMLP(num_stages), optax.sgd(0.1), batch, directives + orders)


def test_builder_for_fewer_stages_is_refused() -> None:
    with pytest.raises(
        piper.DirectiveError,
        match=r"schedule one_f_one_b\(1, 4\) orders PP 0 for MB 0\.\.3, but the DAG has "
        r"PP 0\.\.1 for MB 0\.\.3: 8 passes would run in no set order \(\{PP:1,MB:0,PASS:F\}",
    ):
        compile_pp(2, 4, schedules.one_f_one_b(1, 4))


def test_builder_for_fewer_microbatches_is_refused() -> None:
    with pytest.raises(
        piper.DirectiveError,
        match=r"schedule one_f_one_b\(2, 2\) orders PP 0\.\.1 for MB 0\.\.1, but the DAG has "
        r"PP 0\.\.1 for MB 0\.\.3: 8 passes .*\{PP:0,MB:2,PASS:F\}.*split's microbatches",
    ):
        compile_pp(2, 4, schedules.one_f_one_b(2, 2))


def test_zero_bubble_builder_is_checked_on_its_split_passes() -> None:
    """F and B of microbatches 2-3 on both stages are left: 8 passes (the backward is
    split into BI and BW only where an order names them, so theirs stays whole)."""
    with pytest.raises(piper.DirectiveError, match=r"zero_bubble_h1\(2, 2\) .*: 8 passes"):
        compile_pp(2, 4, schedules.zero_bubble_h1(2, 2))


def test_hand_written_partial_order_is_legal() -> None:
    partial = piper.order([[{"PP": 0, "MB": 0, "PASS": "F"}], [{"PP": 0, "MB": 1, "PASS": "F"}]])
    assert built_by(partial) is None
    compile_pp(2, 4, [partial])


def test_builder_completed_by_hand_is_legal() -> None:
    """Stage 1's passes are left by the builder but ordered by a hand-written order."""
    rest = piper.order([[{"PP": 1, "MB": i, "PASS": p}] for i in range(4) for p in ("F", "B")])
    compile_pp(2, 4, schedules.one_f_one_b(1, 4) + [rest])


def test_loaded_schedule_is_hand_written(tmp_path) -> None:
    """A builder's orders written to JSON and loaded back are plain orders."""
    path = tmp_path / "s.json"
    piper.dump_directives(schedules.one_f_one_b(2, 2), path)
    loaded = piper.load_directives(path)
    assert all(built_by(o) is None for o in loaded)
    compile_pp(2, 4, loaded)
