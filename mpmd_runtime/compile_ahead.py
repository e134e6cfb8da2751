"""Compile the distinct programs of a step on several threads before the step first runs.

Note [compiling ahead]
jax.jit compiles a program when it is first called, so a first step compiled its
programs one after another on one core, and that was most of the time to a first step
(a forward, a backward, an update and a few collectives each take XLA:CPU 0.2-1 s for a
small GPT). Before the first step the executor walks its steps with abstract values
(shape, dtype, sharding) in place of arrays, and hands each distinct program to a pool of
threads as soon as the layouts of its inputs are known:

  * state and the staged batch: as they lie in the store now;
  * a value a program writes: as the compiled program lays it out (its `out_info`), so a
    program waits for the compilation of the programs it reads from;
  * a value a transfer delivers: stacked over the receiving group's replicas, as every
    transfer lays it out (transport.py); the result of a reduction over several groups:
    as `binders.cross_reduce_result` says.

XLA compiles without holding the GIL, so the compilations run side by side, and jax.jit's
cache then holds every program the step calls (`Lowered.compile` fills the cache that the
call looks in). It is only a guess ahead of time: a program whose inputs end up laid out
otherwise, or that fails to compile here, is compiled when it is called, as before,
and raises its errors there.

On a 2-core machine it gains nothing: XLA:CPU already spreads one compilation over both
cores (2 s of CPU per 1 s of wall), so compiling two programs at once only contends (a
GPT's first step took 3.6 s against 3.2 s, means of 4 runs). So it runs only where the
process may use at least `MIN_CORES` cores (a GPU host's, where XLA compiles each program
mostly on one thread).
"""

from __future__ import annotations

import dataclasses
import os
from collections.abc import Callable, Mapping, Sequence
from concurrent.futures import Future, ThreadPoolExecutor
from typing import TYPE_CHECKING, Any

import jax
from piper_jax.mpmd_runtime import buffers as bf
from piper_jax.mpmd_runtime.binders import cross_reduce_result
from piper_jax.mpmd_runtime.instructions import RECV, SEND
from piper_jax.mpmd_runtime.plans import Plans
from piper_jax.mpmd_runtime.programs import stacked
from piper_jax.mpmd_runtime.replay import Event
from piper_jax.mpmd_runtime.same_programs import SamePrograms

if TYPE_CHECKING:
    from piper_jax.mpmd_runtime.executor import Runtime

Group = tuple[int, ...]


@dataclasses.dataclass(frozen=True)
class UnitCall:
    """How a fused step calls its program: `jitted(donated values, kept values)` returns
    the values of `outputs`; `same` where the program may be another step's (Note
    [updates of identical stages]), which then takes only the positions `picks` of a
    kept list-valued buffer."""

    key: tuple
    group: Group
    donated: Sequence[bf.Buffer]
    kept: Sequence[bf.Buffer]
    outputs: Sequence[bf.Buffer]
    jitted: Callable
    same: SamePrograms | None = None
    picks: Mapping[bf.Buffer, tuple[int, ...]] = dataclasses.field(default_factory=dict)


@dataclasses.dataclass(frozen=True)
class _Output:
    """Output `index` of the program that `job` compiles: known once it has compiled."""

    job: Future
    index: int


_UNKNOWN = object()
MIN_CORES = 4


def default_workers() -> int:
    """Threads to compile ahead on: the cores this process may use, or none below
    `MIN_CORES`."""
    cores = len(os.sched_getaffinity(0))
    return cores if cores >= MIN_CORES else 0


def abstract(x: Any) -> Any:
    """The abstract value of an array as a program's argument: an array left on one
    device uncommitted (a fresh optimizer's step count) goes wherever the program runs."""
    sharding = x.sharding if x.committed else None
    return jax.ShapeDtypeStruct(x.shape, x.dtype, sharding=sharding, weak_type=x.weak_type)


def compile_ahead(
    rt: Runtime,
    plans: Plans,
    events: Sequence[Event],
    units: Mapping[int, UnitCall],
    workers: int,
) -> int:
    """Compile the programs that the steps `events` call (`units`: the fused steps, by
    position) on `workers` threads; returns how many compiled (none for workers < 2)."""
    if workers < 2:
        return 0
    known = {g: {b: jax.tree.map(abstract, v) for b, v in rt.stores[g].items()} for g in rt.local}
    mailbox: dict[tuple[str, Group], Any] = {}
    jobs: dict[tuple, Future] = {}
    with ThreadPoolExecutor(workers, thread_name_prefix="piper-compile") as pool:
        for position, (members, index) in enumerate(events):
            head = plans.steps[members[0]][index[0]].head
            if position in units:
                unit = units[position]
                store = known[unit.group]
                args = [[store.get(b, _UNKNOWN) for b in unit.donated]]
                args.append([store.get(b, _UNKNOWN) for b in unit.kept])
                if any(a is _UNKNOWN for part in args for a in part):
                    store.update(dict.fromkeys(unit.outputs, _UNKNOWN))
                    continue
                if unit.key not in jobs:  # FIFO: the jobs it waits for are ahead of it
                    jobs[unit.key] = pool.submit(_compile, unit, args)
                store.update({b: _Output(jobs[unit.key], i) for i, b in enumerate(unit.outputs)})
            elif len(members) > 1:  # a reduction over groups
                for g in members:
                    if g in known:
                        known[g][bf.value(head.value)] = cross_reduce_result(rt, g, head)
            elif head.op == SEND and tuple(head.peer) in known:
                peer = tuple(head.peer)
                sharding = stacked(rt.meshes[peer])
                mailbox[(head.value, peer)] = [
                    jax.ShapeDtypeStruct(shape, dtype, sharding=sharding)
                    for shape, dtype in rt.buffer_avals(head.value, peer)
                ]
            elif head.op == RECV:
                g = members[0]
                known[g][bf.value(head.value)] = mailbox.pop((head.value, g), _UNKNOWN)
    return sum(1 for job in jobs.values() if job.exception() is None)


def _compile(unit: UnitCall, args: list[list[Any]]) -> list[Any]:
    """Compile the unit's program for `args` (waiting for the programs that lay them
    out), or find it compiled for another step; return its outputs' abstract values."""
    donated, kept = [[_resolved(a) for a in part] for part in args]
    picks = unit.picks
    kept = [a if b not in picks else [a[i] for i in picks[b]] for a, b in zip(kept, unit.kept)]
    args = [donated, kept]
    jitted = unit.jitted
    if unit.same is not None:
        jitted = unit.same.resolve(jitted, args, unit.group)
    traced = jitted.trace(*args)
    compiled = traced.lower().compile()
    # the traced program knows the weak types, the compiled one the layouts
    return jax.tree.map(_abstract_output, traced.out_info, compiled.output_shardings)


def _resolved(x: Any) -> Any:
    if isinstance(x, _Output):
        return x.job.result()[x.index]
    return x


def _abstract_output(info: jax.ShapeDtypeStruct, sharding: Any) -> jax.ShapeDtypeStruct:
    return jax.ShapeDtypeStruct(info.shape, info.dtype, sharding=sharding, weak_type=info.weak_type)
