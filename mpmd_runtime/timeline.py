"""Timelines of plans: a PNG Gantt chart or a Chrome/Perfetto trace of TimelineEvents."""

from __future__ import annotations

import json
import os
from collections.abc import Sequence

from piper_jax.ir.dag import group_str
from piper_jax.mpmd_runtime.simulator import TimelineEvent

# One colour per kind; communication ops share one.
COLOURS = {
    "F": "#4c72b0",
    "B": "#55a868",
    "BI": "#8fbc5a",
    "BW": "#c9a227",
    "UPD": "#8172b2",
    "comm": "#a0a0a0",
}
COMPUTE = ("F", "B", "BI", "BW")


def _colour_key(kind: str) -> str:
    return kind if kind in COLOURS else "comm"


def write_timeline(
    events: Sequence[TimelineEvent],
    path: str | os.PathLike,
    title: str = "",
    time_unit_us: float = 1000.0,
) -> None:
    """Write `events` as a Chrome/Perfetto trace (path ends in .json) or a PNG Gantt chart.

    Args:
      events: the timeline, e.g. `simulate(...).timeline`; FREE never appears in it.
      path: where to write; `.json` gives a trace, any other suffix a PNG image.
      title: the chart's title, or the trace's process name.
      time_unit_us: microseconds per time unit of the events, for the trace: 1000 draws
        one cost unit of a simulation as 1 ms; use 1e6 for events measured in seconds.
    """
    path = os.fspath(path)
    if path.endswith(".json"):
        _write_trace(events, path, title, time_unit_us)
    else:
        _write_png(events, path, title)


def _write_trace(
    events: Sequence[TimelineEvent], path: str, title: str, time_unit_us: float
) -> None:
    groups = sorted({e.group for e in events})
    tid = {g: i for i, g in enumerate(groups)}
    trace: list[dict] = [
        {"name": "process_name", "ph": "M", "pid": 0, "args": {"name": title or "piper-jax"}}
    ]
    trace += [
        {"name": "thread_name", "ph": "M", "pid": 0, "tid": tid[g], "args": {"name": group_str(g)}}
        for g in groups
    ]
    for e in events:
        trace.append(
            {
                "name": e.label,
                "cat": e.kind,
                "ph": "X",
                "pid": 0,
                "tid": tid[e.group],
                "ts": e.start * time_unit_us,
                "dur": (e.end - e.start) * time_unit_us,
                "args": {"microbatch": e.microbatch, "group": group_str(e.group)},
            }
        )
    with open(path, "w") as f:
        json.dump({"traceEvents": trace, "displayTimeUnit": "ms"}, f)


def _write_png(events: Sequence[TimelineEvent], path: str, title: str) -> None:
    # Figure without pyplot: no global state, no backend switch, nothing to close.
    from matplotlib.backends.backend_agg import FigureCanvasAgg
    from matplotlib.figure import Figure
    from matplotlib.patches import Patch

    groups = sorted({e.group for e in events})
    row = {g: i for i, g in enumerate(groups)}
    end = max((e.end for e in events), default=0.0) or 1.0
    width_in = 12.0
    fig = Figure(figsize=(width_in, 1.2 + 0.45 * max(len(groups), 1)), dpi=110)
    FigureCanvasAgg(fig)
    ax = fig.add_subplot()
    px_per_unit = width_in * fig.dpi * 0.8 / end  # about the axes' share of the figure
    kinds_seen = set()
    for e in events:
        key = _colour_key(e.kind)
        kinds_seen.add(key)
        dur = e.end - e.start
        comm = key == "comm"
        height = 0.3 if comm else 0.8
        ax.barh(
            row[e.group],
            dur,
            left=e.start,
            height=height,
            color=COLOURS[key],
            edgecolor="black" if not comm else "none",
            linewidth=0.4,
        )
        text = "" if e.microbatch is None else str(e.microbatch)
        if e.kind in COMPUTE and text and dur * px_per_unit >= 6 * len(text) + 2:
            ax.text(
                e.start + dur / 2,
                row[e.group],
                text,
                ha="center",
                va="center",
                fontsize=7,
                color="white",
            )
    ax.set_yticks(range(len(groups)), [group_str(g) for g in groups])
    ax.set_ylim(len(groups) - 0.5, -0.5)  # first group on top
    ax.set_xlim(0, end)
    ax.set_xlabel("time")
    ax.set_ylabel("device group")
    ax.set_title(title or "timeline")
    order = [k for k in COLOURS if k in kinds_seen]
    ax.legend(
        [Patch(color=COLOURS[k]) for k in order],
        order,
        loc="upper left",
        bbox_to_anchor=(1.005, 1.0),
        fontsize=8,
        frameon=False,
    )
    fig.tight_layout()
    fig.savefig(path, format="png")
