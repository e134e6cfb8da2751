"""Pipeline schedule builders: one order directive per device (stage s on device s).

Each returns the per-device order of F and B passes; the placement it assumes is
written by the user with `place`. The orders are recorded as a builder's (see
directives/coverage.py), so a schedule built for fewer stages or microbatches than the
DAG has is refused instead of leaving passes unordered.
"""

from __future__ import annotations

from collections.abc import Callable

from piper_jax.directives.coverage import mark_built
from piper_jax.directives.types import Order
from piper_jax.ir.errors import DirectiveError


def _check(name: str, **counts: int) -> None:
    """Each named count (num_stages=..., num_microbatches=...) is an int >= 1."""
    for arg, value in counts.items():
        if isinstance(value, bool) or not isinstance(value, int) or value < 1:
            raise DirectiveError(f"{name}: {arg} must be an int >= 1, got {value!r}")


Action = tuple[str, int, int]  # (pass, stage, microbatch)


def _order(actions: list[Action], tag: str, dim_name: str) -> Order:
    return _grouped_order([[a] for a in actions], tag, dim_name)


def _grouped_order(groups: list[list[Action]], tag: str, dim_name: str) -> Order:
    """One order directive; actions sharing a group may overlap (see DESIGN, order)."""
    return Order(tuple(tuple({tag: s, dim_name: mb, "PASS": p} for p, s, mb in g) for g in groups))


def _built(orders: list[Order], name: str, args: tuple, tag: str, dim_name: str) -> list[Order]:
    """The builder `name`'s orders, recorded with its call as written (`gpipe(2, 4)`)."""
    return mark_built(orders, f"{name}({', '.join(map(str, args))})", tag, dim_name)


def _per_stage(
    name: str,
    actions: Callable[[int, int, int], list[Action]],
    num_stages: int,
    num_microbatches: int,
    tag: str,
    dim_name: str,
) -> list[Order]:
    """One order per stage s (on device s): actions(num_stages, num_microbatches, s)."""
    orders = [
        _order(actions(num_stages, num_microbatches, s), tag, dim_name) for s in range(num_stages)
    ]
    return _built(orders, name, (num_stages, num_microbatches), tag, dim_name)


def gpipe(
    num_stages: int, num_microbatches: int, tag: str = "PP", dim_name: str = "MB"
) -> list[Order]:
    """All forwards, then all backwards: peak activations m per stage."""
    _check("gpipe", num_stages=num_stages, num_microbatches=num_microbatches)
    m = num_microbatches
    orders = [
        _order([("F", s, i) for i in range(m)] + [("B", s, i) for i in range(m)], tag, dim_name)
        for s in range(num_stages)
    ]
    return _built(orders, "gpipe", (num_stages, num_microbatches), tag, dim_name)


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
    _check("one_f_one_b", num_stages=num_stages, num_microbatches=num_microbatches)
    return _per_stage(
        "one_f_one_b", one_f_one_b_actions, num_stages, num_microbatches, tag, dim_name
    )


def interleaved_1f1b_actions(
    num_stages: int, num_microbatches: int, num_devices: int, device: int
) -> list[Action]:
    """Interleaved 1F1B on `device`, which holds the v stages device, device + D, ...

    Forwards walk the device's stages in rounds of D microbatches, backwards walk them
    in reverse. Warm-up is min(2(D - r - 1) + (v - 1) D, m v) forwards on rank r, also
    when m = D, as PyTorch, JaxPP and the reference Piper do (Megatron runs every forward
    first there: the same step time, but more activations held on the later ranks).
    """
    d, m, r = num_devices, num_microbatches, device
    v = num_stages // d
    total = m * v

    def forward(k: int) -> tuple[int, int]:
        return ((k % (d * v)) // d) * d + r, (k // (d * v)) * d + k % d

    def backward(k: int) -> tuple[int, int]:
        return (v - 1 - (k % (d * v)) // d) * d + r, (k // (d * v)) * d + k % d

    warmup = min(2 * (d - r - 1) + (v - 1) * d, total)
    actions: list[Action] = [("F", *forward(k)) for k in range(warmup)]
    for i in range(total - warmup):
        actions += [("F", *forward(warmup + i)), ("B", *backward(i))]
    actions += [("B", *backward(i)) for i in range(total - warmup, total)]
    return actions


def interleaved_1f1b(
    num_stages: int,
    num_microbatches: int,
    num_devices: int,
    tag: str = "PP",
    dim_name: str = "MB",
) -> list[Order]:
    """Interleaved 1F1B: stage s on device s % num_devices; bubble (p-1)(F+B)/v."""
    _check(
        "interleaved_1f1b",
        num_stages=num_stages,
        num_microbatches=num_microbatches,
        num_devices=num_devices,
    )
    if num_stages % num_devices or num_microbatches % num_devices:
        raise DirectiveError(
            f"interleaved_1f1b: num_stages ({num_stages}) and num_microbatches "
            f"({num_microbatches}) must both be multiples of num_devices ({num_devices})"
        )
    orders = [
        _order(
            interleaved_1f1b_actions(num_stages, num_microbatches, num_devices, r), tag, dim_name
        )
        for r in range(num_devices)
    ]
    args = (num_stages, num_microbatches, num_devices)
    return _built(orders, "interleaved_1f1b", args, tag, dim_name)


def zero_bubble_h1_actions(num_stages: int, num_microbatches: int, stage: int) -> list[Action]:
    """ZB-H1 on `stage`: 1F1B with B split into BI and BW, each BW deferred by `stage`
    steps so the deferred BWs fill the cool-down bubble; peak activations stay at p."""
    actions: list[Action] = []
    deferred: list[int] = []
    for pass_, s, i in one_f_one_b_actions(num_stages, num_microbatches, stage):
        if pass_ == "F":
            actions.append((pass_, s, i))
            continue
        actions.append(("BI", s, i))
        deferred.append(i)
        if len(deferred) > stage:
            actions.append(("BW", s, deferred.pop(0)))
    return actions + [("BW", stage, i) for i in deferred]


def zero_bubble_h1(
    num_stages: int, num_microbatches: int, tag: str = "PP", dim_name: str = "MB"
) -> list[Order]:
    """ZB-H1 (stage s on device s): bubble (p-1)(F+B-2W), 1F1B's memory."""
    _check("zero_bubble_h1", num_stages=num_stages, num_microbatches=num_microbatches)
    return _per_stage(
        "zero_bubble_h1", zero_bubble_h1_actions, num_stages, num_microbatches, tag, dim_name
    )


def dualpipev_groups(num_ranks: int, num_microbatches: int, rank: int) -> list[list[Action]]:
    """DualPipeV's eight phases on `rank`, as order groups, pass for pass as DeepSeek's
    DualPipeV runs them.

    The rank holds two stages, one on each leg of the V: leg 0 is stage `rank`, leg 1 is
    stage 2N-1-rank. A group of several passes is an overlap group: a forward of one leg
    beside a backward of the other. A backward that is not zero-bubble is a whole B, as
    the reference Piper writes it; a zero-bubble one runs BI and defers its BW to a FIFO
    that the W steps drain, oldest first (the backward split is per (region,
    microbatch), so one stage runs both kinds).

    Note [DualPipeV's last rank]
    In the main phase (4) the last rank does not overlap its first F/B pair: the
    forward of stage N-1 runs alone, then the backward of stage N. DeepSeek keeps them
    apart to shrink the bubble: an overlap group starts only once all its passes have
    their inputs, and that backward waits for a cotangent from stage N+1 on rank N-2,
    while the forward's input comes sooner; alone, the forward fills the wait.
    """
    n, m, r = num_ranks, num_microbatches, rank
    stage = (r, 2 * n - 1 - r)
    next_f, next_b = [0, 0], [0, 0]
    deferred: list[Action] = []

    def f(leg: int) -> list[Action]:
        next_f[leg] += 1
        return [("F", stage[leg], next_f[leg] - 1)]

    def b(leg: int, zero_bubble: bool = False) -> list[Action]:
        next_b[leg] += 1
        i = next_b[leg] - 1
        if zero_bubble:
            deferred.append(("BW", stage[leg], i))
            return [("BI", stage[leg], i)]
        return [("B", stage[leg], i)]

    def w() -> list[Action]:
        return [deferred.pop(0)]

    groups: list[list[Action]] = [f(0) for _ in range(2 * (n - r - 1))]  # (1)
    for _ in range(r + 1):  # (2)
        groups += [f(0), f(1)]
    for _ in range(n - r - 1):  # (3)
        groups += [b(1, zero_bubble=True), w(), f(1)]
    for i in range(m - 2 * n + r + 1):  # (4), see Note [DualPipeV's last rank]
        groups += [f(0), b(1)] if i == 0 and r == n - 1 else [f(0) + b(1)]
        groups += [f(1) + b(0)]
    for _ in range(n - r - 1):  # (5)
        groups += [b(1), f(1) + b(0)]
    legs = [leg for _ in range(r + 1) for leg in (1, 0)]  # (6): the second half zero-bubble
    groups += [b(leg, zero_bubble=j >= len(legs) - (r + 1)) for j, leg in enumerate(legs)]
    for _ in range(n - r - 1):  # (7)
        groups += [w(), b(0, zero_bubble=True)]
    groups += [w() for _ in range(r + 1)]  # (8)
    return groups


def dualpipev(
    num_ranks: int, num_microbatches: int, tag: str = "PP", dim_name: str = "MB"
) -> list[Order]:
    """DualPipeV: 2N stages on N ranks, rank r holds stages r and 2N-1-r; needs m >= 2N."""
    _check("dualpipev", num_ranks=num_ranks, num_microbatches=num_microbatches)
    if num_microbatches < 2 * num_ranks:
        raise DirectiveError(
            f"dualpipev: num_microbatches ({num_microbatches}) must be at least "
            f"2 x num_ranks ({2 * num_ranks})"
        )
    orders = [
        _grouped_order(dualpipev_groups(num_ranks, num_microbatches, r), tag, dim_name)
        for r in range(num_ranks)
    ]
    return _built(orders, "dualpipev", (num_ranks, num_microbatches), tag, dim_name)
