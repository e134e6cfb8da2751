"""Models and losses as people write them: code around and between the regions, models
annotated from outside, nested regions; each trains like single-device training."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from flax import nnx
from helpers import assert_matches_reference, mlp_batches, mlp_loss
from piper_jax.ir import lift

import piper_jax as piper
from piper_jax import annotate, schedules
from piper_jax.annotate import reset_annotation_counters

OPT = optax.sgd(0.2)
VOCAB, WIDTH, LENGTH = 8, 8, 4


class StageLM(nnx.Module):
    """A two-stage token model: embedding, a residual block per PP region, tied head."""

    def __init__(self):
        rngs = nnx.Rngs(0)
        self.embed = nnx.Param(jax.random.normal(rngs.params(), (VOCAB, WIDTH)) * 0.5)
        self.blocks = nnx.List([nnx.Linear(WIDTH, WIDTH, rngs=rngs) for _ in range(2)])
        self.norm = nnx.RMSNorm(WIDTH, rngs=rngs)

    def __call__(self, tokens, mask=None, gate=None):
        h = self.embed[...][tokens]
        if mask is not None:
            h = h * mask[..., None]
        for s, block in enumerate(self.blocks):
            with annotate("PP", s):
                if gate is not None and s == 1:
                    h = h * gate
                h = h + jnp.tanh(block(h))
        return h @ self.embed[...].T


class GlueLM(StageLM):
    """The same blocks with glue between the regions: the residual add, a reshape and a
    norm run outside any annotation."""

    def __call__(self, tokens, mask=None, gate=None):
        h = self.embed[...][tokens]
        for s, block in enumerate(self.blocks):
            with annotate("PP", s):
                y = jnp.tanh(block(h))
            h = (h + y).reshape(h.shape[0], -1).reshape(h.shape)
            if s == 0:
                h = self.norm(h)
        return h @ self.embed[...].T


def cross_entropy(logits, targets):
    return optax.softmax_cross_entropy_with_integer_labels(logits, targets)


def masked_loss(model, batch):
    """The padding mask is made before the model, used by it, and weights the loss."""
    mask = (batch["tokens"] > 0).astype(jnp.float32)
    return jnp.mean(cross_entropy(model(batch["tokens"], mask), batch["targets"]) * mask)


def plain_loss(model, batch):
    return jnp.mean(cross_entropy(model(batch["tokens"]), batch["targets"]))


def gated_loss(model, batch):
    """A value made before the first region that only the second region reads."""
    gate = jnp.mean(batch["tokens"] > 0, axis=1, keepdims=True)[..., None] + 0.5
    return jnp.mean(cross_entropy(model(batch["tokens"], gate=gate), batch["targets"]))


PATTERNS = {
    "mask_before_and_after": (StageLM, masked_loss),
    "glue_between_regions": (GlueLM, plain_loss),
    "value_for_a_later_region": (StageLM, gated_loss),
}


def token_batches(steps: int, batch_size: int = 8) -> list[dict]:
    rng = np.random.default_rng(0)
    out = []
    for _ in range(steps):
        tokens = rng.integers(1, VOCAB, size=(batch_size, LENGTH)).astype(np.int32)
        tokens[:, LENGTH - 1 - rng.integers(0, 2, size=batch_size)] = 0  # padding
        targets = rng.integers(0, VOCAB, size=(batch_size, LENGTH)).astype(np.int32)
        out.append({"tokens": tokens, "targets": targets})
    return out


def pp2_1f1b() -> list:
    return [
        piper.split({"PP": "*"}, num_microbatches=4),
        piper.place({"PP": 0}, [0]),
        piper.place({"PP": 1}, [1]),
        *schedules.one_f_one_b(2, 4),
    ]


def pp2_dp2_1f1b() -> list:
    directives = [piper.split({"PP": "*"}, num_microbatches=2)]
    for s in range(2):
        directives += [piper.place({"PP": s}, [s, s + 2]), piper.replicate({"PP": s}, [s, s + 2])]
    return directives + schedules.one_f_one_b(2, 2)


STRATEGIES = {"no_directives": list, "pp2_1f1b": pp2_1f1b, "pp2_dp2_1f1b": pp2_dp2_1f1b}


@pytest.mark.parametrize("strategy", sorted(STRATEGIES))
@pytest.mark.parametrize("pattern", sorted(PATTERNS))
def test_loss_pattern_trains_like_single_device(pattern: str, strategy: str) -> None:
    make_model, loss_fn = PATTERNS[pattern]
    batches = token_batches(2)
    step = piper.compile(loss_fn, make_model(), OPT, batches[0], STRATEGIES[strategy]())
    assert [str(r) for r in step.lifted.regions] == ["{PP:0}", "{PP:1}"]
    assert_matches_reference(step, loss_fn, make_model, OPT, batches)


class PlainMLP(nnx.Module):
    """tests/helpers.py's StageMLP without any annotation: a model we do not own."""

    def __init__(self, num_stages: int = 2, width: int = 16):
        rngs = nnx.Rngs(0)
        self.embed = nnx.Param(jax.random.normal(rngs.params(), (8, width)) * 0.3)
        self.blocks = nnx.List([nnx.Linear(width, width, rngs=rngs) for _ in range(num_stages)])

    def __call__(self, x: jax.Array) -> jax.Array:
        h = x @ self.embed[...]
        for block in self.blocks:
            h = h + jnp.tanh(block(h))
        return h @ self.embed[...].T


def annotated_plain_mlp() -> PlainMLP:
    model = PlainMLP()
    for s, block in enumerate(model.blocks):
        piper.annotate_module(block, "PP", s)
    return model


def flat_lift(model: nnx.Module, x: jax.Array):
    graphdef, params, rest = nnx.split(model, nnx.Param, ...)
    leaves, treedef = jax.tree.flatten(params)

    def flat(p, b):
        return jnp.sum(nnx.merge(graphdef, jax.tree.unflatten(treedef, p), rest)(*b))

    reset_annotation_counters()
    return lift(flat, leaves, [jnp.asarray(x)], [str(i) for i in leaves], ["x"])


def paths(model: nnx.Module) -> list:
    return [p for p, _ in jax.tree_util.tree_flatten_with_path(nnx.state(model))[0]]


def test_annotate_module_keeps_paths_values_and_other_instances() -> None:
    plain, annotated = PlainMLP(), annotated_plain_mlp()
    assert paths(annotated) == paths(plain)
    assert isinstance(annotated.blocks[0], nnx.Linear)
    assert type(annotated.blocks[0]).__name__ == "Linear"
    assert type(plain.blocks[0]) is nnx.Linear  # other instances untouched
    x = mlp_batches(1)[0]["x"]
    np.testing.assert_allclose(annotated(x), plain(x), rtol=1e-6)  # eager calls still work
    lifted = flat_lift(annotated, x)
    assert [str(r) for r in lifted.regions] == ["{PP:0}", "{PP:1}"]
    # block 0's tanh and the residual add are glue feeding block 1
    assert [a.split(" at")[0] for a in lifted.regions[1].absorbed][:2] == ["tanh", "add"]
    merged = nnx.merge(*nnx.split(annotated))
    assert [str(r) for r in flat_lift(merged, x).regions] == ["{PP:0}", "{PP:1}"]


def test_annotate_module_nests_and_takes_automatic_indices() -> None:
    """The whole model as PP (automatic index) around block 1 as EP: the nested region
    interrupts the outer one."""
    model = PlainMLP(3)
    piper.annotate_module(model.blocks[1], "EP")
    piper.annotate_module(model, "PP")
    lifted = flat_lift(model, np.ones((2, 8), np.float32))
    assert [str(r) for r in lifted.regions] == ["{PP:0}", "{PP:0,EP:0}", "{PP:0}"]


def test_annotate_module_refuses_bad_input() -> None:
    model = PlainMLP()
    with pytest.raises(piper.AnnotationError, match="takes an nnx.Module instance"):
        piper.annotate_module(PlainMLP, "PP", 0)
    with pytest.raises(piper.AnnotationError, match="reserved"):
        piper.annotate_module(model.blocks[0], "MB", 0)
    with pytest.raises(piper.AnnotationError, match="index must be a non-negative int"):
        piper.annotate_module(model.blocks[0], "PP", -1)
    piper.annotate_module(model.blocks[0], "PP", 0)
    with pytest.raises(piper.AnnotationError, match=r"already annotated with 'PP' \(index 0\)"):
        piper.annotate_module(model.blocks[0], "PP", 1)


def test_model_annotated_from_outside_trains_like_single_device_under_1f1b() -> None:
    batches = mlp_batches(2)
    step = piper.compile(mlp_loss, annotated_plain_mlp(), OPT, batches[0], pp2_1f1b())
    assert [str(r) for r in step.lifted.regions] == ["{PP:0}", "{PP:1}"]
    assert paths(step.model()) == paths(PlainMLP())
    assert_matches_reference(step, mlp_loss, PlainMLP, OPT, batches)


class ExpertBlockLM(StageLM):
    """Stage 0 holds an expert MLP in a nested EP region, and stage 0's code resumes after
    it: regions {PP:0}, {PP:0,EP:0}, {PP:0}, {PP:1}."""

    def __init__(self):
        super().__init__()
        self.expert = nnx.Linear(WIDTH, WIDTH, rngs=nnx.Rngs(3))

    def __call__(self, tokens, mask=None, gate=None):
        h = self.embed[...][tokens]
        with annotate("PP", 0):
            h = h + jnp.tanh(self.blocks[0](h))
            with annotate("EP"):
                e = jax.nn.gelu(self.expert(self.norm(h)))
            h = self.norm(h + e)
        with annotate("PP", 1):
            h = h + jnp.tanh(self.blocks[1](h))
        return h @ self.embed[...].T


NESTED = {
    "no_directives": list,
    "pp2_split2": lambda: [
        piper.split({"PP": "*"}, num_microbatches=2),
        piper.place({"PP": 0}, [0]),
        piper.place({"PP": 1}, [1]),
    ],
    "ep_on_its_own_device": lambda: [  # the norm, read inside and after EP, is tied
        piper.split({"PP": "*"}, num_microbatches=2),
        piper.place({"PP": 0, "EP": "-"}, [0]),
        piper.place({"EP": 0}, [2]),
        piper.place({"PP": 1}, [1]),
    ],
}


@pytest.mark.parametrize("strategy", sorted(NESTED))
def test_nested_region_trains_like_single_device(strategy: str) -> None:
    batches = token_batches(2)
    step = piper.compile(plain_loss, ExpertBlockLM(), OPT, batches[0], NESTED[strategy]())
    assert [str(r) for r in step.lifted.regions] == ["{PP:0}", "{PP:0,EP:0}", "{PP:0}", "{PP:1}"]
    assert_matches_reference(step, plain_loss, ExpertBlockLM, OPT, batches)
