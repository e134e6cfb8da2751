"""Annotations: repeated tags, exits out of order, hidden regions, filters matching nothing
(annotate_module is tested with the models of tests/end_to_end/test_real_models.py)."""

from __future__ import annotations

import inspect

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from flax import nnx
from helpers import StageMLP, mlp_batches, mlp_loss
from piper_jax.ir import AnnotationError, lift

import piper_jax as piper
from piper_jax.annotate import reset_annotation_counters

X = np.ones((2, 4), np.float32)


def lift_fn(fn):
    reset_annotation_counters()
    return lift(lambda p, b: fn(*b), [], [jnp.asarray(X)], [], ["x"])


def line_of(text: str, fn) -> int:
    lines, start = inspect.getsourcelines(fn)
    return start + next(i for i, line in enumerate(lines) if text in line)


def test_tag_nested_in_itself_is_refused() -> None:
    def fn(x):
        with piper.annotate("PP"):
            with piper.annotate("PP"):
                x = jnp.sin(x)
        return jnp.sum(x)

    line = line_of('with piper.annotate("PP"):\n', fn) + 1
    with pytest.raises(
        AnnotationError,
        match=rf"annotate\('PP', 1\) at .*test_annotations.py:{line} is entered while "
        r"annotate\('PP', 0\) is still open: .*twice \(\{PP:0,PP:1\}\)",
    ):
        lift_fn(fn)


def test_unclosed_annotation_is_refused_at_the_next_entry() -> None:
    class Block(nnx.Module):
        def __call__(self, x):
            piper.annotate("PP").__enter__()  # never exited
            return jnp.sin(x)

    block = Block()

    def fn(x):
        return jnp.sum(block(block(x)))

    with pytest.raises(AnnotationError, match=r"annotate\('PP', 1\) .* annotate\('PP', 0\) is"):
        lift_fn(fn)
    # the next trace starts clean
    lifted = lift_fn(lambda x: jnp.sum(jnp.sin(x)))
    assert [r.key for r in lifted.regions] == [()]


def test_annotations_exited_out_of_order_name_the_user_line() -> None:
    """The location is the model line, not a frame inside Flax or piper-jax."""

    class Model(nnx.Module):
        def __init__(self):
            self.a = nnx.Linear(4, 4, rngs=nnx.Rngs(0))

        def __call__(self, x):
            pp = piper.annotate("PP")
            pp.__enter__()
            ep = piper.annotate("EP")
            ep.__enter__()
            x = self.a(x)
            pp.__exit__(None, None, None)
            ep.__exit__(None, None, None)
            return x

    batch = {"x": X}
    line = line_of("pp.__exit__", Model.__call__)
    with pytest.raises(
        AnnotationError,
        match=rf"annotate\('PP', 0\) is exited at .*test_annotations.py:{line} while "
        r"annotate\('EP', 0\), entered inside it, is still open",
    ):
        piper.compile(lambda m, b: jnp.mean(m(b["x"])), Model(), optax.sgd(0.1), batch)


def test_annotations_inside_jit_are_refused() -> None:
    @jax.jit
    def block(x):
        with piper.annotate("PP", 0):
            return jnp.sin(x)

    def fn(x):
        return jnp.sum(block(x))

    line = line_of("return jnp.sum(block(x))", fn)
    with pytest.raises(
        AnnotationError,
        match=r"annotation \{PP:0\} at .*test_annotations.py:\d+ is inside a 'jit' call "
        rf"\(jax.jit, .*\) made at .*test_annotations.py:{line}: .*would be lost",
    ):
        lift_fn(fn)


def test_split_filter_matching_nothing_lists_the_regions() -> None:
    batch = mlp_batches(1)[0]
    typo = [piper.split({"pp": "*"}, num_microbatches=2)]
    with pytest.raises(
        piper.DirectiveError,
        match=r"split \{pp:\*\}: filter matches no region; the regions are \{PP:0\}, "
        r"\{PP:1\}: check the tag's spelling",
    ):
        piper.compile(mlp_loss, StageMLP(2), optax.sgd(0.1), batch, typo)


def test_split_over_an_unannotated_model_says_so() -> None:
    class Plain(nnx.Module):
        def __init__(self):
            self.a = nnx.Linear(8, 8, rngs=nnx.Rngs(0))

        def __call__(self, x):
            return self.a(x)

    batch = mlp_batches(1)[0]
    split = [piper.split({"PP": "*"}, num_microbatches=2)]
    with pytest.raises(
        piper.DirectiveError, match=r"the regions are \{\}: the model has no annotated region"
    ):
        piper.compile(mlp_loss, Plain(), optax.sgd(0.1), batch, split)
