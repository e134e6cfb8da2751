"""Where a traced step's time goes, from a `jax.profiler` trace (an .xplane.pb file): per
device, how long each program ran (by name: piper-jax names its programs after their plan
steps, "F0", "B0", "UPD0") and how long the device sat idle between kernels; on the host,
how long the Python calls named in `host_calls` took (the executor's dispatch loop, the
whole step).

On CPU devices, where XLA has no device planes, `cpu_program_runs` gives each program
run's span from its ops instead (benchmarks/sim_vs_real.py --trace).

Run: .venv/bin/python benchmarks/trace_summary.py TRACE.xplane.pb [--steps N]
"""

from __future__ import annotations

import argparse
import collections
import re
import sys
from collections.abc import Iterable, Sequence

# (file, function) of the host calls worth reporting: a whole step, piper-jax's dispatch
# loop (and the closures it calls, also named run), its wait and its batch staging
HOST_CALLS = (
    ("train_step.py", "__call__"),
    ("baselines.py", "__call__"),
    ("executor.py", "run"),
    ("executor.py", "wait"),
    ("executor.py", "_stage_batch"),
)
TOP_RUNTIME_EVENTS = 12
_CALL = re.compile(r"^\$(\S+):(\d+) (\S+)$")


def busy_ns(intervals: Iterable[tuple[float, float]]) -> float:
    """Length of the union of (start, end) intervals."""
    total, reach = 0.0, float("-inf")
    for start, end in sorted(intervals):
        if end > reach:
            total += end - max(start, reach)
            reach = end
    return total


def module_name(hlo_module: str) -> str:
    """A program's name without jax's "jit_" and a run id."""
    return hlo_module.split("(")[0].removeprefix("jit_")


def summarize(
    path: str, steps: int, host_calls: Sequence[tuple[str, str]] = HOST_CALLS
) -> list[str]:
    """Lines describing the trace at `path` of `steps` training steps, per step."""
    from jax.profiler import ProfileData

    data = ProfileData.from_file(path)
    lines: list[str] = []
    for plane in data.planes:
        if plane.name.startswith("/device:"):
            lines += _device(plane, steps)
        elif plane.name == "/host:CPU":
            lines += _host(plane, steps, host_calls)
    return lines


def cpu_program_runs(path: str) -> list[tuple[int, int, str]]:
    """(start ns, end ns, program name) of every program run in a trace taken on CPU
    devices, in order of start. XLA:CPU has no device planes: it traces each op of a
    program, tagged with the program's hlo_module and run_id, on the thread that runs it."""
    from jax.profiler import ProfileData

    spans: dict[tuple[int, str], tuple[int, int]] = {}
    for plane in ProfileData.from_file(path).planes:
        for line in plane.lines:
            for e in line.events:
                stats = dict(e.stats)
                if "hlo_module" not in stats or "run_id" not in stats:
                    continue
                key = (stats["run_id"], module_name(str(stats["hlo_module"])))
                start, end = spans.get(key, (e.start_ns, e.start_ns + e.duration_ns))
                spans[key] = (min(start, e.start_ns), max(end, e.start_ns + e.duration_ns))
    return sorted((start, end, name) for (_, name), (start, end) in spans.items())


def _device(plane: object, steps: int) -> list[str]:
    """Kernel time per program (by each kernel's hlo_module) and the device's idle time."""
    kernels: list[tuple[float, float]] = []
    by_module: dict[str, list[float]] = collections.defaultdict(list)
    for line in plane.lines:
        if not line.name.startswith("Stream"):
            continue
        for e in line.events:
            kernels.append((e.start_ns, e.start_ns + e.duration_ns))
            stats = dict(e.stats)
            by_module[module_name(str(stats.get("hlo_module", e.name)))].append(e.duration_ns)
    if not kernels:
        return [f"{plane.name}: no kernels traced"]
    span = max(end for _, end in kernels) - min(start for start, _ in kernels)
    busy = busy_ns(kernels)
    out = [
        f"{plane.name}: {len(kernels) / steps:.0f} kernels per step; from first to last "
        f"kernel {span / steps / 1e6:.2f} ms per step, kernels running {busy / steps / 1e6:.2f} "
        f"ms ({busy / span:.0%}), idle {(span - busy) / steps / 1e6:.2f} ms"
    ]
    for name, durations in sorted(by_module.items(), key=lambda kv: -sum(kv[1])):
        out.append(
            f"  program {name:<28} {len(durations) / steps:6.0f} kernels per step, "
            f"{sum(durations) / steps / 1e6:8.2f} ms per step"
        )
    return out


def _host(plane: object, steps: int, host_calls: Sequence[tuple[str, str]]) -> list[str]:
    """The Python calls in `host_calls`, then the runtime's own (XLA, PjRt, CUDA) events
    that took the most host time."""
    calls: dict[str, list[float]] = collections.defaultdict(list)
    runtime: dict[str, list[float]] = collections.defaultdict(list)
    for line in plane.lines:
        for e in line.events:
            if not e.name.startswith("$"):
                if not e.name.startswith(("ThreadpoolListener", "end: ", "PjitFunction")):
                    runtime[e.name.split("(")[0][:60]].append(e.duration_ns)
                continue
            match = _CALL.match(e.name)
            if match and (match.group(1), match.group(3)) in host_calls:
                calls[f"{match.group(1)}:{match.group(2)} {match.group(3)}"].append(e.duration_ns)
    top = sorted(runtime.items(), key=lambda kv: -sum(kv[1]))[:TOP_RUNTIME_EVENTS]
    return [
        f"host: {name:<28} {len(d) / steps:5.1f} per step, {sum(d) / steps / 1e6:8.2f} ms per step"
        for name, d in sorted(calls.items(), key=lambda kv: -sum(kv[1]))
    ] + [
        f"host runtime: {name:<60} {len(d) / steps:7.1f} per step, "
        f"{sum(d) / steps / 1e6:8.2f} ms per step"
        for name, d in top
    ]


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("trace", help="an .xplane.pb file written by jax.profiler")
    parser.add_argument("--steps", type=int, default=1, help="training steps in the trace")
    args = parser.parse_args(argv)
    print("\n".join(summarize(args.trace, args.steps)))
    return 0


if __name__ == "__main__":
    sys.exit(main())
