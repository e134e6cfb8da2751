"""Small annotated models and the single-device reference the equivalence tests use."""

from __future__ import annotations

import collections
import re
from collections.abc import Iterable
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
import optax
from flax import nnx

import piper_jax as piper
from piper_jax import annotate


class StageMLP(nnx.Module):
    """num_stages residual MLP blocks, each its own PP region, with a tied in/out matrix.

    With `experts` E, each block ends in a toy expert layer: the features cut into E
    chunks are the tokens "dispatched" as (batch, E, 1, width / E) to E experts (weights
    stacked experts first), in a nested {EP: s} region."""

    def __init__(
        self,
        num_stages: int = 2,
        width: int = 16,
        rngs: nnx.Rngs | None = None,
        experts: int = 0,
    ):
        rngs = rngs or nnx.Rngs(0)
        self.embed = nnx.Param(jax.random.normal(rngs.params(), (8, width)) * 0.3)
        self.blocks = nnx.List([nnx.Linear(width, width, rngs=rngs) for _ in range(num_stages)])
        self.num_experts = experts
        chunk = (experts, width // max(experts, 1), width // max(experts, 1))
        self.experts = nnx.List(
            [nnx.Param(jax.random.normal(rngs.params(), chunk) * 0.3) for _ in range(num_stages)]
            if experts
            else []
        )

    def __call__(self, x: jax.Array) -> jax.Array:
        h = x @ self.embed[...]
        for s, block in enumerate(self.blocks):
            with annotate("PP", s):
                h = h + jnp.tanh(block(h))
                if self.num_experts:
                    tokens = h.reshape(h.shape[0], self.num_experts, 1, -1)
                    with annotate("EP", s):
                        out = jnp.tanh(jnp.einsum("becd,edf->becf", tokens, self.experts[s][...]))
                    h = h + out.reshape(h.shape)
        return h @ self.embed[...].T


def mlp_loss(model: StageMLP, batch: dict) -> jax.Array:
    out = model(batch["x"])
    return jnp.mean((out - batch["y"]) ** 2)


def mlp_batches(steps: int, batch_size: int = 16, seed: int = 0) -> list[dict]:
    rng = np.random.default_rng(seed)
    return [
        {
            "x": rng.normal(size=(batch_size, 8)).astype(np.float32),
            "y": rng.normal(size=(batch_size, 8)).astype(np.float32),
        }
        for _ in range(steps)
    ]


# DualPipeV's V over StageMLP(4): the middle stages 1 and 2 both lie on device 1
DUALPIPEV_MLP4 = [
    piper.split({"PP": "*"}, num_microbatches=4),
    *[piper.place({"PP": s}, [min(s, 3 - s)]) for s in range(4)],
    *piper.schedules.dualpipev(2, 4),
]


def mlp_program_texts(directives: list, label_pattern: str) -> dict[str, str]:
    """The StableHLO piper-jax hands XLA for each program of one StageMLP(2, width=16)
    step under `directives` whose plan step matches `label_pattern` (a regex), by label."""
    batch = mlp_batches(1)[0]
    step = piper.compile(mlp_loss, StageMLP(2, width=16), optax.sgd(0.1), batch, directives)
    step(batch)
    texts = step._executor.program_texts(optimized=False)
    matched = {label: t for label, t in texts.items() if re.search(label_pattern, label)}
    assert matched, sorted(texts)
    return matched


_COMPILED: collections.Counter = collections.Counter()  # XLA compilations by function name


def _count_compilation(event: str, _seconds: float, **labels: str) -> None:
    if event == "/jax/core/compile/backend_compile_duration":
        _COMPILED[labels.get("fun_name", "")] += 1


jax.monitoring.register_event_duration_secs_listener(_count_compilation)


def xla_compilations(fun_names: str | Iterable[str] | None = None) -> int:
    """How many programs (of functions named `fun_names`, as jax labels them:
    "jit(f)") XLA has compiled in this process."""
    if fun_names is None:
        return _COMPILED.total()
    names = {fun_names} if isinstance(fun_names, str) else set(fun_names)
    return sum(_COMPILED[n] for n in names)


def reference_run(
    loss_fn: Any, model: nnx.Module, optimizer: optax.GradientTransformation, batches: list
) -> tuple[list[float], Any]:
    """Plain single-device jax.value_and_grad + optax on each global batch: the losses
    and the trained parameters."""
    losses, params, _ = reference_training(loss_fn, model, optimizer, batches)
    return losses, params


def reference_training(
    loss_fn: Any, model: nnx.Module, optimizer: optax.GradientTransformation, batches: list
) -> tuple[list[float], Any, Any]:
    """`reference_run`'s losses and parameters, and the optimizer state it ends with."""
    graphdef, params, rest = nnx.split(model, nnx.Param, ...)
    state = optimizer.init(params)

    @jax.jit
    def step(params: Any, state: Any, batch: Any) -> tuple:
        loss, grads = jax.value_and_grad(lambda p: loss_fn(nnx.merge(graphdef, p, rest), batch))(
            params
        )
        updates, state = optimizer.update(grads, state, params)
        return optax.apply_updates(params, updates), state, loss

    losses = []
    for batch in batches:
        params, state, loss = step(params, state, batch)
        losses.append(float(loss))
    return losses, params, state


# Absolute slack for trained parameters against the reference. Adam divides each gradient
# by its running RMS, so where a gradient element is tiny the rounding of a different
# summation order (over microbatches and replicas) grows to ~2e-6 after a few steps at
# lr 1e-2 (seen on an AVX-512 XLA:CPU); a lost or doubled gradient moves a parameter by
# ~lr, 1,000 times more.
PARAM_ATOL = 1e-5


def assert_matches_reference(
    step: Any, loss_fn: Any, make_model: Any, optimizer: optax.GradientTransformation, batches: list
) -> None:
    """The DESIGN.md oracle: same losses (rtol 1e-5) and params (rtol 1e-4) every step."""
    ref_losses, ref_params = reference_run(loss_fn, make_model(), optimizer, batches)
    losses = [step(batches[0])["loss"]]
    compiled = xla_compilations()
    losses += [step(b)["loss"] for b in batches[1:]]
    # each distinct program compiles once: in the first step, for the layouts of every step
    assert xla_compilations() == compiled, "a step after the first compiled a program"
    np.testing.assert_allclose(losses, ref_losses, rtol=1e-5)
    got = jax.tree.leaves(step.params())
    want = jax.tree.leaves(ref_params)
    assert len(got) == len(want)
    for g, w in zip(got, want):
        np.testing.assert_allclose(np.asarray(g), np.asarray(w), rtol=1e-4, atol=PARAM_ATOL)


def check_mlp_strategy(
    directives: list,
    optimizer: optax.GradientTransformation,
    num_stages: int = 2,
    batches: list | None = None,
    experts: int = 0,
    **compile_flags: Any,
) -> Any:
    """Compile StageMLP(num_stages, experts=experts) under `directives` (and
    `compile_flags`), train it on `batches` (3 default ones) and assert the single-device
    oracle; returns the step."""
    batches = batches or mlp_batches(3)

    def make() -> StageMLP:
        return StageMLP(num_stages, experts=experts)

    step = piper.compile(mlp_loss, make(), optimizer, batches[0], directives, **compile_flags)
    assert_matches_reference(step, mlp_loss, make, optimizer, batches)
    return step


def deadlocked_steps(step: Any) -> dict:
    """The steps of a PP=2, m=2 1F1B step's plans, edited so that d0 waits for B1.0
    before sending F0.1 while d1 waits for F0.1 before sending B1.0."""
    steps = {g: list(s) for g, s in step.plans.steps.items()}

    def move_before(group: tuple, text: str, anchor: str) -> None:
        names = [str(x) for x in steps[group]]
        i, j = names.index(text), names.index(anchor)
        steps[group].insert(j, steps[group].pop(i))

    move_before((0,), "RECV B1.0 <- d1", "SEND F0.1 -> d1")
    move_before((1,), "RECV F0.1 <- d0", "SEND B1.0 -> d0")
    return steps


def token_batches(
    steps: int, vocab_size: int, seq_len: int, batch_size: int = 8
) -> list[dict[str, np.ndarray]]:
    """Random next-token batches ("tokens", "targets": int32 (B, T)) for the example GPT."""
    rng = np.random.default_rng(0)
    out = []
    for _ in range(steps):
        ids = rng.integers(0, vocab_size, size=(batch_size, seq_len + 1))
        out.append({"tokens": ids[:, :-1].astype(np.int32), "targets": ids[:, 1:].astype(np.int32)})
    return out
