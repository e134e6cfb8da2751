"""Pipeline schedule builders: one order directive per device (stage s on device s).

Each returns the per-device order of F and B passes; the placement it assumes is
written by the user with `place`.
"""

from __future__ import annotations

from piper_jax.directives.types import Order
from piper_jax.ir.errors import DirectiveError


def _check(num_stages: int, num_microbatches: int, name: str) -> None:
    for arg, value in (("num_stages", num_stages), ("num_microbatches", num_microbatches)):
        if isinstance(value, bool) or not isinstance(value, int) or value < 1:
            raise DirectiveError(f"{name}: {arg} must be an int >= 1, got {value!r}")


def _order(actions: list[tuple[str, int, int]], tag: str, dim_name: str) -> Order:
    return Order(tuple(({tag: s, dim_name: mb, "PASS": p},) for p, s, mb in actions))


def gpipe(
    num_stages: int, num_microbatches: int, tag: str = "PP", dim_name: str = "MB"
) -> list[Order]:
    """All forwards, then all backwards: peak activations m per stage."""
    _check(num_stages, num_microbatches, "gpipe")
    m = num_microbatches
    return [
        _order([("F", s, i) for i in range(m)] + [("B", s, i) for i in range(m)], tag, dim_name)
        for s in range(num_stages)
    ]


def one_f_one_b_actions(
    num_stages: int, num_microbatches: int, stage: int
) -> list[tuple[str, int, int]]:
    """Stage `stage`'s 1F1B order: p-s-1 warm-up forwards, F/B pairs, then the drain."""
    m = num_microbatches
    warmup = min(num_stages - stage - 1, m)
    actions = [("F", stage, i) for i in range(warmup)]
    for i in range(m - warmup):
        actions += [("F", stage, warmup + i), ("B", stage, i)]
    actions += [("B", stage, i) for i in range(m - warmup, m)]
    return actions


def one_f_one_b(
    num_stages: int, num_microbatches: int, tag: str = "PP", dim_name: str = "MB"
) -> list[Order]:
    """1F1B: at most p microbatches in flight on stage 0."""
    _check(num_stages, num_microbatches, "one_f_one_b")
    return [
        _order(one_f_one_b_actions(num_stages, num_microbatches, s), tag, dim_name)
        for s in range(num_stages)
    ]
