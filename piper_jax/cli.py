"""`piper`: look at a strategy without writing a script.

    piper explain STRATEGY.json --model examples/gpt.py:factory
    piper simulate STRATEGY.json --model examples/gpt.py:factory --out timeline.png
    piper search --model examples/gpt.py:factory --model-arg num_stages=4 --devices 4
    piper launch --nprocs 2 --devices-per-proc 2 train.py   (the same as piper-launch)

`--model MODULE:FACTORY` names a function returning (model, loss_fn, optimizer,
example_batch); MODULE is a file (examples/gpt.py) or a module importable from the
current directory (examples.gpt). `--model-arg KEY=VALUE` passes keyword arguments to it
(VALUE read as JSON when it parses, else as a string).
"""

from __future__ import annotations

import argparse
import importlib
import importlib.util
import json
import os
import sys
from collections.abc import Callable, Sequence
from typing import Any

from piper_jax.ir.errors import PiperError

COSTS = ("unit", "measured")


class UsageError(PiperError):
    """The command line names something that cannot be loaded or used."""


def main(argv: Sequence[str] | None = None) -> int:
    """Run the command line; returns the exit code (0 ok, 1 a PiperError, 2 bad usage)."""
    argv = list(sys.argv[1:] if argv is None else argv)
    if argv[:1] == ["launch"]:
        from piper_jax import launch

        return launch.main(argv[1:])
    parser = _parser()
    try:
        args = parser.parse_args(argv)
    except SystemExit as e:
        return e.code if isinstance(e.code, int) else 2
    try:
        return args.run(args)
    except PiperError as err:
        print(f"piper {args.command}: {err}", file=sys.stderr)
        return 2 if isinstance(err, UsageError) else 1


def _parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="piper", description=__doc__.split("\n\n")[0].strip(), epilog=_EPILOG
    )
    commands = parser.add_subparsers(dest="command", required=True)
    explain = commands.add_parser(
        "explain",
        help="print regions, placement and per-device plans (runs nothing)",
        description="Lower STRATEGY for the model and print its regions, their placement "
        "and layouts, and every device group's plan. Builds no program, needs no device.",
    )
    _strategy_args(explain)
    explain.set_defaults(run=_explain)
    simulate = commands.add_parser(
        "simulate",
        help="predict step time, bubble and memory per device; draw the timeline",
        description="Replay STRATEGY's plans on a cost model: print the step time, the "
        "bubble fraction and the estimated memory per device, and write the timeline.",
    )
    _strategy_args(simulate)
    simulate.add_argument(
        "--costs",
        choices=COSTS,
        default="unit",
        help="unit: F=1, B=2 per pass (no device needed); measured: compile the strategy "
        "on this machine's devices, run a step and time every pass (default unit)",
    )
    simulate.add_argument("--out", metavar="PATH", help="timeline: .png, or .json (Perfetto)")
    simulate.set_defaults(run=_simulate)
    search = commands.add_parser(
        "search",
        help="rank candidate strategies by simulated step time",
        description="Enumerate strategies (pipeline degree and grouping, DP and ZeRO level, "
        "schedule, microbatches, recompute), simulate each on per-region costs measured "
        "once, drop those over the memory limit and print the ranking.",
    )
    _model_args(search)
    search.add_argument("--devices", type=int, required=True, help="devices to use")
    search.add_argument("--memory-limit", type=float, metavar="MIB", help="per device, in MiB")
    search.add_argument(
        "--costs",
        choices=COSTS,
        default="measured",
        help="measured: time each region's passes on this machine (default); unit: F=1, B=2 "
        "per share of the batch",
    )
    search.add_argument("--top", type=int, default=10, help="rows to print (default 10)")
    search.add_argument("--microbatches", type=int, nargs="+", metavar="M")
    search.add_argument("--schedules", nargs="+", metavar="S", help="among " + _schedules())
    search.add_argument("--zero", type=int, nargs="+", default=[0, 2, 3], metavar="LEVEL")
    search.add_argument("--no-recompute", action="store_true", help="never try recompute")
    search.add_argument("--out", metavar="FILE.json", help="write the first pick's directives")
    search.add_argument("--timeline", metavar="PATH", help="draw the first pick's timeline")
    search.set_defaults(run=_search)
    commands.add_parser(
        "launch",
        help="run a script as N local processes (the same as piper-launch)",
        add_help=False,
    )
    return parser


_EPILOG = "examples:\n" + "\n".join(
    "  " + line.strip() for line in __doc__.split("\n\n")[1].splitlines()
)


def _schedules() -> str:
    from piper_jax.search import SCHEDULES

    return ", ".join(SCHEDULES)


def _model_args(parser: argparse.ArgumentParser) -> None:
    parser.add_argument(
        "--model",
        required=True,
        metavar="MODULE:FACTORY",
        help="a function returning (model, loss_fn, optimizer, example_batch), e.g. "
        "examples/gpt.py:factory",
    )
    parser.add_argument(
        "--model-arg",
        action="append",
        default=[],
        metavar="KEY=VALUE",
        help="keyword argument for the factory (repeatable), e.g. num_stages=4",
    )


def _strategy_args(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("strategy", metavar="STRATEGY.json", help="directives, reference format")
    _model_args(parser)
    parser.add_argument(
        "--devices",
        type=int,
        help="devices the strategy's indices name (default: 1 + the largest index it names)",
    )


def load_factory(spec: str) -> Callable[..., Any]:
    """The function `MODULE:FACTORY` names (MODULE a .py file or an importable module)."""
    module_name, sep, attr = spec.rpartition(":")
    if not sep or not module_name or not attr:
        raise UsageError(f"--model {spec!r}: write MODULE:FACTORY, e.g. examples/gpt.py:factory")
    if module_name.endswith(".py") or os.sep in module_name:
        path = os.path.abspath(module_name)
        if not os.path.isfile(path):
            raise UsageError(f"--model {spec!r}: no file {module_name}")
        sys.path.insert(0, os.path.dirname(path))  # its sibling imports, as `python FILE`
        name = os.path.splitext(os.path.basename(path))[0]
        module = sys.modules.get(name)
        if getattr(module, "__file__", None) != path:
            loader = importlib.util.spec_from_file_location(name, path)
            module = importlib.util.module_from_spec(loader)
            sys.modules[name] = module
            loader.loader.exec_module(module)
    else:
        sys.path.insert(0, os.getcwd())
        try:
            module = importlib.import_module(module_name)
        except ImportError as err:
            raise UsageError(f"--model {spec!r}: cannot import {module_name}: {err}") from None
    factory = getattr(module, attr, None)
    if not callable(factory):
        raise UsageError(f"--model {spec!r}: {module_name} has no function {attr!r}")
    return factory


def _model(args: argparse.Namespace) -> tuple:
    kwargs = {}
    for item in args.model_arg:
        key, sep, text = item.partition("=")
        if not sep or not key.isidentifier():
            raise UsageError(f"--model-arg {item!r}: write KEY=VALUE, e.g. num_stages=4")
        try:
            kwargs[key] = json.loads(text)
        except ValueError:
            kwargs[key] = text
    made = load_factory(args.model)(**kwargs)
    if not isinstance(made, tuple) or len(made) != 4:
        raise UsageError(
            f"--model {args.model}: the factory must return (model, loss_fn, optimizer, "
            f"example_batch), got {type(made).__name__}"
        )
    return made


def _strategy(args: argparse.Namespace) -> tuple[list, int]:
    import piper_jax as piper
    from piper_jax.directives.types import Place, Replicate

    directives = piper.load_directives(args.strategy)
    named = [d for x in directives if isinstance(x, Place | Replicate) for d in x.devices]
    devices = args.devices or 1 + max(named, default=0)
    return directives, devices


def _explain(args: argparse.Namespace) -> int:
    import piper_jax as piper

    directives, devices = _strategy(args)
    model, loss_fn, optimizer, batch = _model(args)
    print(piper.lower(loss_fn, model, optimizer, batch, directives, num_devices=devices).explain())
    return 0


def _simulate(args: argparse.Namespace) -> int:
    import piper_jax as piper
    from piper_jax.mpmd_runtime.timeline import write_timeline
    from piper_jax.region_costs import lowered_memory

    directives, devices = _strategy(args)
    placed = _devices(devices) if args.costs == "measured" else None  # before JAX starts
    model, loss_fn, optimizer, batch = _model(args)
    lowered = piper.lower(loss_fn, model, optimizer, batch, directives, num_devices=devices)
    if placed:
        step = piper.compile(loss_fn, model, optimizer, batch, directives, placed)
        step(batch)  # compile every program first
        sim = step.simulate(step.measure_costs(batch))
        scale, unit, title = 1e3, " ms", "simulated on measured costs"
    else:
        sim = lowered.simulate()
        scale, unit, title = 1.0, " (units: F=1, B=2)", "simulated on unit costs"
    print(f"step time {sim.step_time * scale:.4g}{unit}")
    print(f"bubble {sim.bubble_fraction:.1%}")
    memory = lowered_memory(lowered, model, optimizer, sim.timeline)
    print("memory per device, MiB (estimated):")
    print(f"  {'device':>6}  {'params':>8}  {'grads':>8}  {'opt':>8}  {'acts':>8}  {'total':>8}")
    for d, row in sorted(memory.items()):
        cells = [row["params"], row["grads"], row["opt_state"], row["activations"]]
        cells.append(sum(cells))
        print(f"  {d:>6}  " + "  ".join(f"{x / 2**20:>8.3f}" for x in cells))
    if args.out:
        write_timeline(sim.timeline, args.out, title, 1e6 if args.costs == "measured" else 1e3)
        print(f"timeline written to {args.out}")
    return 0


def _search(args: argparse.Namespace) -> int:
    import piper_jax as piper
    from piper_jax.mpmd_runtime.timeline import write_timeline

    if args.costs == "measured":
        _devices(args.devices)
    model, loss_fn, optimizer, batch = _model(args)
    limit = None if args.memory_limit is None else args.memory_limit * 2**20
    found = piper.search(
        loss_fn,
        model,
        optimizer,
        batch,
        num_devices=args.devices,
        memory_limit=limit,
        costs=args.costs,
        microbatches=args.microbatches,
        schedules=args.schedules,
        zero_levels=args.zero,
        recompute=(False,) if args.no_recompute else (False, True),
    )
    print(found.table(args.top))
    best = found[0]
    if args.out:
        piper.dump_directives(best.directives, args.out)
        print(f"first pick's directives written to {args.out}")
    if args.timeline:
        unit = 1e6 if found.unit == "s" else 1e3
        write_timeline(best.simulation.timeline, args.timeline, str(best.candidate), unit)
        print(f"first pick's timeline written to {args.timeline}")
    return 0


def _devices(count: int) -> list:
    """`count` devices of this process: on CPU, that many virtual ones when JAX has not
    started yet."""
    import jax

    try:
        jax.config.update("jax_num_cpu_devices", count)
    except RuntimeError:
        pass  # the backend started already (inside a test, a notebook): use what it has
    devices = jax.devices()
    if len(devices) < count:
        raise UsageError(
            f"the strategy needs {count} devices but this process has {len(devices)}; "
            "use --costs unit, or run where there are enough devices"
        )
    return devices[:count]


if __name__ == "__main__":
    sys.exit(main())
