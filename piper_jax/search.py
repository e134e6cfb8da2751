"""`search`: rank candidate strategies for a model by simulating their plans on measured
per-region costs, without running any of them.

Note [how search predicts a strategy]
The candidates are every combination of: pipeline degree p (a divisor of the device
count, at most the number of the model's stage regions, those annotated with `tag`),
the grouping of those regions into p contiguous stages, data parallelism over the
remaining factor dp (device group k is devices k, k + p, k + 2p, ...), ZeRO level
(0, 2, 3; ZeRO-1 is ZeRO-2 in piper-jax), schedule (GPipe, 1F1B, ZB-H1; interleaved 1F1B
and DualPipeV where each region is a stage of its own), microbatch count and recompute.
Each is lowered to its plans (no programs are built), which the simulator replays with
a cost per instruction:
  * F and B of each region at the per-replica microbatch size the candidate gives it,
    measured once per distinct region and size (Note [timing a region's passes] in
    region_costs.py); under recompute B also pays its F again;
  * an optimizer step per UPD, the time of one step over all parameters, by its share
    of the parameter bytes (ZeRO: 1/dp of it);
  * each collective and transfer, a measured dispatch latency plus its average bytes at
    a measured bandwidth between two of the devices;
  * every instruction besides, the dispatch of a trivial program over a device group as
    wide as the candidate's (so many small steps cost more than few large ones).
The simulator runs device groups concurrently, as separate accelerators do. Virtual CPU
devices that share a few cores do not, so there the predictions are optimistic, the
more so the more devices work at once; `search` measures and reports how many devices'
worth of work the devices do at once (region_costs.measure_parallelism: about N on N
accelerators). Compare candidates with one another rather than their times with a wall
clock; `benchmarks/search.py` measures how the ranking holds up. Memory is estimated
without devices (region_costs.estimate_memory); candidates over `memory_limit` are
dropped.
"""

from __future__ import annotations

import dataclasses
import itertools
import time
from collections.abc import Callable, Iterable, Mapping, Sequence
from typing import Any

import jax
import numpy as np
import optax
from flax import nnx

from piper_jax import region_costs
from piper_jax.directives import apply_directives
from piper_jax.directives import schedules as builders
from piper_jax.directives.types import Order, Place, Recompute, Replicate, Split
from piper_jax.ir import build_dag
from piper_jax.ir.errors import PiperError
from piper_jax.lowering import lower
from piper_jax.mpmd_runtime.plans import compile_plans
from piper_jax.mpmd_runtime.simulator import Simulation, simulate

SCHEDULES = ("none", "gpipe", "1f1b", "zb-h1", "interleaved", "dualpipev")
SPLIT_BACKWARD = ("zb-h1", "dualpipev")  # refused together with recompute
MAX_GROUPINGS = 6


@dataclasses.dataclass(frozen=True)
class Candidate:
    """One strategy: where each stage region runs and how.

    Attributes:
      placement: device group index of each stage region (PP index i -> placement[i]).
      dp: data-parallel replicas per device group; group k is devices k, k + p, ...
      schedule: one of SCHEDULES ("none": no pipeline, one device group).
      microbatches: the split's microbatch count.
      zero: 0, 2 (shard_grads) or 3 (shard_params).
      recompute: every region recomputes its forward in its backward.
      tag: the annotation tag of the stage regions.
    """

    placement: tuple[int, ...]
    dp: int
    schedule: str
    microbatches: int
    zero: int
    recompute: bool
    tag: str = "PP"

    @property
    def pipeline(self) -> int:
        return max(self.placement, default=0) + 1

    def directives(self) -> list:
        """The candidate as a directive list (load it into `compile`, or dump it as JSON)."""
        p, dp, m, tag = self.pipeline, self.dp, self.microbatches, self.tag
        every = {tag: "*"} if self.placement else {}
        out: list = [Split(every, m)]
        groups = [tuple(k + j * p for j in range(dp)) for k in range(p)]
        filters = [{tag: i} for i in range(len(self.placement))] if p > 1 else [every]
        for flt, k in zip(filters, self.placement if p > 1 else (0,)):
            out.append(Place(flt, groups[k]))
            if dp > 1:
                out.append(Replicate(flt, groups[k], self.zero >= 2, self.zero == 3))
        if self.recompute:
            out.append(Recompute(every))
        return out + self._orders()

    def _orders(self) -> list[Order]:
        p, m, tag = self.pipeline, self.microbatches, self.tag
        if self.schedule == "interleaved":
            return builders.interleaved_1f1b(len(self.placement), m, p, tag)
        if self.schedule == "dualpipev":
            return builders.dualpipev(p, m, tag)
        if self.schedule == "none":
            return []
        if self.placement == tuple(range(p)):
            build = {"gpipe": builders.gpipe, "1f1b": builders.one_f_one_b}
            return build.get(self.schedule, builders.zero_bubble_h1)(p, m, tag)
        return [self._stage_order(k) for k in range(p)]

    def _stage_order(self, k: int) -> Order:
        """Stage k's schedule over the several regions it groups: each pass of the stage
        runs its regions in data order (backward passes last region first)."""
        p, m = self.pipeline, self.microbatches
        if self.schedule == "gpipe":
            actions = [("F", k, i) for i in range(m)] + [("B", k, i) for i in range(m)]
        elif self.schedule == "1f1b":
            actions = builders.one_f_one_b_actions(p, m, k)
        else:
            actions = builders.zero_bubble_h1_actions(p, m, k)
        units = [u for u, g in enumerate(self.placement) if g == k]
        groups = []
        for pass_, _, mb in actions:
            for u in units if pass_ == "F" else units[::-1]:
                groups.append(({self.tag: u, "MB": mb, "PASS": pass_},))
        return Order(tuple(groups))

    def __str__(self) -> str:
        stages = "|".join(
            ",".join(str(u) for u, g in enumerate(self.placement) if g == k)
            for k in range(self.pipeline)
        )
        parts = [f"PP{self.pipeline}" + (f" [{stages}]" if self.placement else "")]
        parts[0] += f" x DP{self.dp}"
        if self.schedule != "none":
            parts.append(self.schedule)
        parts.append(f"m={self.microbatches}")
        if self.zero:
            parts.append(f"ZeRO-{self.zero}")
        if self.recompute:
            parts.append("recompute")
        return ", ".join(parts)


@dataclasses.dataclass(frozen=True)
class Result:
    """A candidate's prediction.

    Attributes:
      step_time: predicted seconds per step (cost units with unit costs).
      bubble_fraction: as `Simulation.bubble_fraction`.
      memory: estimated bytes per device: params, grads, opt_state, activations.
      simulation: the simulation itself (its .timeline draws with `write_timeline`).
    """

    candidate: Candidate
    step_time: float
    bubble_fraction: float
    memory: dict[int, dict[str, int]]
    simulation: Simulation

    @property
    def directives(self) -> list:
        return self.candidate.directives()

    @property
    def peak_memory(self) -> int:
        """The largest estimated total over devices, in bytes."""
        return max((sum(row.values()) for row in self.memory.values()), default=0)


@dataclasses.dataclass(frozen=True)
class SearchResult:
    """Ranked results (fastest first), the candidates dropped and why, how long it took,
    and how many devices' worth of work the devices did at once (`parallelism`; the
    device count with unit costs).

    Indexing and iterating go over `results`."""

    results: list[Result]
    rejected: list[tuple[Candidate, str]]
    unit: str
    seconds: float
    parallelism: float

    def __getitem__(self, i: int) -> Result:
        return self.results[i]

    def __len__(self) -> int:
        return len(self.results)

    def __iter__(self) -> Iterable[Result]:
        return iter(self.results)

    def table(self, top: int = 10) -> str:
        """The first `top` results as a text table."""
        scale, unit = (1e3, "ms") if self.unit == "s" else (1.0, "units")
        lines = [f"{'#':>3}  {'step ' + unit:>10}  {'bubble':>6}  {'peak MiB':>8}  strategy"]
        for i, r in enumerate(self.results[:top]):
            lines.append(
                f"{i + 1:>3}  {r.step_time * scale:>10.3f}  {r.bubble_fraction:>6.1%}  "
                f"{r.peak_memory / 2**20:>8.2f}  {r.candidate}"
            )
        lines.append(
            f"{len(self.results)} candidates ranked, {len(self.rejected)} dropped, "
            f"in {self.seconds:.1f} s; the devices ran {self.parallelism:.2g}x one device's "
            "work at once"
        )
        return "\n".join(lines)


def search(
    loss_fn: Callable[[nnx.Module, Any], jax.Array],
    model: nnx.Module,
    optimizer: optax.GradientTransformation,
    example_batch: Any,
    num_devices: int,
    memory_limit: float | None = None,
    *,
    costs: str = "measured",
    microbatches: Sequence[int] | None = None,
    schedules: Sequence[str] | None = None,
    zero_levels: Sequence[int] = (0, 2, 3),
    recompute: Sequence[bool] = (False, True),
    tag: str = "PP",
) -> SearchResult:
    """Rank strategies for `model` on `num_devices` devices by simulated step time
    (Note [how search predicts a strategy]).

    Args:
      loss_fn, model, optimizer, example_batch: as for `piper_jax.compile`; the batch
        size is the global batch the strategies must train on.
      num_devices: devices every candidate uses.
      memory_limit: bytes per device; candidates estimated above it are dropped.
      costs: "measured" times each region's passes on this machine's first device (a few
        seconds); "unit" takes F = 1 and B = 2 per replica's share of the batch per
        device, which needs no device time.
      microbatches: microbatch counts to try; default 1, 2, 4 without a pipeline and
        p, 2p, 4p with p stages (those that divide the batch).
      schedules: which of SCHEDULES to try (default all).
      zero_levels: ZeRO levels to try where there is data parallelism.
      recompute: whether to try without and/or with recompute.
      tag: the annotation tag whose indices are the stage regions.

    Returns:
      A SearchResult: `.results` ranked fastest first (ties: lower ZeRO level, no
      recompute, fewer microbatches, less memory), `.table()`, `.rejected`.

    Raises:
      PiperError: a bad argument, or no candidate fits.
    """
    start = time.perf_counter()
    _check_args(num_devices, costs, schedules, zero_levels)
    base = lower(loss_fn, model, optimizer, example_batch, [], num_devices=1)
    size = base.batch.size
    candidates = list(
        enumerate_candidates(
            len(_stage_units(base.lifted, tag)), num_devices, size, microbatches,
            schedules or SCHEDULES, zero_levels, recompute, tag,
        )
    )  # fmt: skip
    if not candidates:
        raise PiperError(
            f"no candidate strategy for {num_devices} devices and batch size {size}; "
            "give microbatch counts that divide the batch"
        )
    measured = _measure(
        loss_fn, model, optimizer, example_batch, base, candidates, costs == "measured"
    )
    results, rejected = [], []
    for c in candidates:
        try:
            result = _predict(c, base, measured, num_devices)
        except PiperError as err:
            rejected.append((c, str(err)))
            continue
        if memory_limit is not None and result.peak_memory > memory_limit:
            rejected.append((c, f"estimated {result.peak_memory / 2**20:.2f} MiB per device"))
            continue
        results.append(result)
    if not results:
        raise PiperError(
            f"no candidate strategy fits: {len(rejected)} tried, e.g. {rejected[0][0]}: "
            f"{rejected[0][1]}; raise memory_limit or allow more microbatches and recompute"
        )
    results.sort(key=_rank)
    unit = "s" if measured.timed else "units"
    elapsed = time.perf_counter() - start
    return SearchResult(results, rejected, unit, elapsed, measured.parallelism)


@dataclasses.dataclass(frozen=True)
class _Measured:
    """What search measures once: per-replica microbatch size -> region -> RegionCost,
    one optimizer step, the link and dispatch costs, and the devices' parallelism."""

    timed: bool
    per_size: dict[int, dict[int, region_costs.RegionCost]]
    param_bytes: list[int]
    update_time: float
    state_ratio: float
    link: tuple[float, float]
    dispatch: dict[int, float]
    parallelism: float


def _measure(
    loss_fn: Callable,
    model: nnx.Module,
    optimizer: optax.GradientTransformation,
    example_batch: Any,
    base: Any,
    candidates: list[Candidate],
    timed: bool,
) -> _Measured:
    num_devices = candidates[0].pipeline * candidates[0].dp
    update_time, state_ratio = region_costs.optimizer_costs(
        optimizer, nnx.state(model, nnx.Param), timed
    )
    batch_leaves = jax.tree_util.tree_leaves(example_batch)
    per_size: dict[int, dict[int, region_costs.RegionCost]] = {}
    for rows in sorted({base.batch.size // (c.microbatches * c.dp) for c in candidates}):
        at = lower(loss_fn, model, optimizer, _rows(example_batch, rows), [], num_devices=1)
        leaves = region_costs.batch_rows(batch_leaves, rows, base.batch.random)
        per_size[rows] = region_costs.measure_regions(at.lifted, base.param_leaves, leaves, timed)
    parallelism, link, dispatch = float(num_devices), (0.0, 0.0), {}
    if timed:  # parallelism at the largest microbatch, the last one measured
        parallelism = region_costs.measure_parallelism(
            at.lifted, base.param_leaves, leaves, num_devices
        )
        link = _link_costs(num_devices)
        dispatch = {dp: _dispatch_seconds(dp) for dp in sorted({c.dp for c in candidates})}
    param_bytes = [int(np.asarray(x).nbytes) for x in base.param_leaves]
    return _Measured(
        timed, per_size, param_bytes, update_time, state_ratio, link, dispatch, parallelism
    )


def _predict(c: Candidate, base: Any, measured: _Measured, num_devices: int) -> Result:
    """Lower candidate c to its plans (no programs), simulate them on the measured costs,
    estimate its memory."""
    lifted, size = base.lifted, base.batch.size
    dag = apply_directives(build_dag(lifted), lifted, c.directives(), num_devices, global_norm=True)
    rows = size // (c.microbatches * c.dp)
    regions = measured.per_size[rows]
    table = _cost_table(c, regions, rows / (size / num_devices), measured.timed)
    table.update(_op_costs(dag, measured, regions))
    table = {k: v + measured.dispatch.get(c.dp, 0.0) for k, v in table.items()}
    sim = simulate(compile_plans(dag, lifted), table)
    kept = {r: (x.input_bytes if c.recompute else x.residual_bytes) for r, x in regions.items()}
    memory = region_costs.estimate_memory(
        dag, lifted, measured.param_bytes, measured.state_ratio, sim.timeline, kept
    )
    return Result(c, sim.step_time, sim.bubble_fraction, memory, sim)


def _check_args(
    num_devices: int, costs: str, schedules: Sequence[str] | None, zero: Sequence[int]
) -> None:
    if isinstance(num_devices, bool) or not isinstance(num_devices, int) or num_devices < 1:
        raise PiperError(f"search: num_devices must be an int >= 1, got {num_devices!r}")
    if costs not in ("measured", "unit"):
        raise PiperError(f"search: costs={costs!r}; use 'measured' or 'unit'")
    unknown = [s for s in schedules or () if s not in SCHEDULES]
    if unknown:
        raise PiperError(f"search: unknown schedules {unknown}; pick from {', '.join(SCHEDULES)}")
    if any(z not in (0, 1, 2, 3) for z in zero):
        raise PiperError(f"search: zero_levels {list(zero)} must be among 0, 1, 2, 3")


def _stage_units(lifted: Any, tag: str) -> list[int]:
    """The stage indices of the model's regions (0..R-1), or [] when a region has no
    such tag or they are not 0..R-1 (then only data parallelism is tried)."""
    indices = [dict(r.key).get(tag) for r in lifted.regions]
    found = sorted({i for i in indices if i is not None})
    if None in indices or found != list(range(len(found))):
        return []
    return found


def enumerate_candidates(
    num_units: int,
    num_devices: int,
    batch_size: int,
    microbatches: Sequence[int] | None,
    schedules: Sequence[str],
    zero_levels: Sequence[int],
    recompute: Sequence[bool],
    tag: str = "PP",
) -> Iterable[Candidate]:
    """Every candidate of Note [how search predicts a strategy] that fits the batch."""
    zero_levels = sorted({2 if z == 1 else z for z in zero_levels})
    for p in range(1, num_devices + 1):
        if num_devices % p or (p > 1 and p > num_units):
            continue
        dp = num_devices // p
        counts = microbatches or ((1, 2, 4) if p == 1 else (p, 2 * p, 4 * p))
        for schedule, placement in _layouts(p, num_units, schedules):
            for m, zero, rec in itertools.product(
                counts, zero_levels if dp > 1 else (0,), recompute
            ):
                if batch_size % (m * dp) or not _fits(schedule, p, m, rec):
                    continue
                yield Candidate(placement, dp, schedule, m, zero, rec, tag)


def _fits(schedule: str, p: int, m: int, recompute: bool) -> bool:
    if recompute and schedule in SPLIT_BACKWARD:
        return False  # a recomputed region's backward cannot be split into BI and BW
    if schedule == "interleaved":
        return m % p == 0
    if schedule == "dualpipev":
        return m >= 2 * p
    return schedule == "none" or m >= p


def _layouts(p: int, num_units: int, schedules: Sequence[str]) -> list[tuple[str, tuple]]:
    """(schedule, placement) pairs for pipeline degree p over num_units stage regions."""
    if p == 1:
        return [("none", (0,) * num_units)] if "none" in schedules else []
    out = []
    for grouping in _groupings(num_units, p):
        for s in ("gpipe", "1f1b", "zb-h1"):
            if s in schedules:
                out.append((s, grouping))
    if "interleaved" in schedules and num_units % p == 0 and num_units >= 2 * p:
        out.append(("interleaved", tuple(u % p for u in range(num_units))))
    if "dualpipev" in schedules and num_units == 2 * p:
        out.append(("dualpipev", tuple(min(u, 2 * p - 1 - u) for u in range(num_units))))
    return out


def _groupings(num_units: int, p: int) -> list[tuple[int, ...]]:
    """Contiguous groupings of the regions into p stages, the most even first; at most
    MAX_GROUPINGS of them."""
    found = []
    for cuts in itertools.combinations(range(1, num_units), p - 1):
        bounds = (0, *cuts, num_units)
        sizes = [b - a for a, b in zip(bounds, bounds[1:])]
        placement = tuple(k for k, n in enumerate(sizes) for _ in range(n))
        found.append((max(sizes) - min(sizes), placement))
    found.sort()
    return [placement for _, placement in found[:MAX_GROUPINGS]]


def _rows(batch: Any, rows: int) -> Any:
    return jax.tree.map(lambda x: np.asarray(x)[:rows], batch)


def _cost_table(
    c: Candidate, regions: Mapping[int, region_costs.RegionCost], share: float, timed: bool
) -> dict[str, float]:
    """F and B of every region for candidate c; unit costs scale with the batch share."""
    table = {}
    for r, x in regions.items():
        f, b = (x.forward, x.backward) if timed else (share, 2 * share)
        table[f"F{r}"], table[f"B{r}"] = f, b + (f if c.recompute else 0.0)
    return table


def _op_costs(
    dag: Any, measured: _Measured, regions: Mapping[int, region_costs.RegionCost]
) -> dict[str, float]:
    """UPD per region by parameter share; collectives and transfers by average bytes."""
    if not measured.timed:
        return {}
    shares = region_costs.update_share(dag, measured.param_bytes)
    table = {f"UPD{r}": measured.update_time * share for r, share in shares.items()}
    latency, per_byte = measured.link
    moved = np.mean([x.input_bytes for x in regions.values()])
    grads = sum(measured.param_bytes) / max(1, len(regions))
    for op, nbytes in (
        ("SEND", moved), ("ALL_REDUCE", grads), ("REDUCE_SCATTER", grads), ("ALL_GATHER", grads),
    ):  # fmt: skip
        table[op] = latency + nbytes * per_byte
    table["RECV"] = 0.0
    return table


def _dispatch_seconds(width: int) -> float:
    """Seconds to run a trivial program over `width` devices: what every instruction
    costs besides its work."""
    mesh = jax.sharding.Mesh(np.array(jax.devices()[:width]), ("x",))
    spec = jax.sharding.PartitionSpec("x")
    trivial = jax.jit(jax.shard_map(lambda x: x + 1, mesh=mesh, in_specs=spec, out_specs=spec))
    x = jax.device_put(np.zeros((width, 4), np.float32), jax.sharding.NamedSharding(mesh, spec))
    return region_costs.seconds_of(trivial, x)[0]


def _link_costs(num_devices: int) -> tuple[float, float]:
    """(seconds per collective dispatch, seconds per byte) of a sum over two devices,
    from a small and a 4 MiB one; (0, 0) when this process has one device."""
    devices = jax.devices()[: min(2, num_devices)]
    if len(devices) < 2:
        return 0.0, 0.0
    mesh = jax.sharding.Mesh(np.array(devices), ("x",))
    spec = jax.sharding.PartitionSpec("x")
    total = jax.jit(
        jax.shard_map(lambda x: jax.lax.psum(x, "x"), mesh=mesh, in_specs=spec, out_specs=spec)
    )
    times = []
    for n in (256, 2**20):
        x = jax.device_put(np.ones((2, n), np.float32), jax.sharding.NamedSharding(mesh, spec))
        times.append(region_costs.seconds_of(total, x)[0])
    per_byte = max(0.0, (times[1] - times[0]) / (4 * (2**20 - 256)))
    return times[0], per_byte


def _rank(r: Result) -> tuple:
    c = r.candidate
    return (r.step_time, c.zero, c.recompute, c.microbatches, r.peak_memory)
