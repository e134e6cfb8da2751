"""The main job: train the example GPT as a character-level language model on the Python
standard library's own source, with a piper-jax strategy on virtual CPU devices.

Default: PP=2 x DP=2 under 1F1B on 4 devices. Every few hundred steps it prints the loss
on held-out text, and at the end a short sample the trained model writes. Run with
--help for the options.
"""

from __future__ import annotations

import argparse
import os
import sys
import time

SCHEDULES = ("gpipe", "1f1b", "interleaved", "zb-h1", "dualpipev")
SPLIT_BACKWARD = ("zb-h1", "dualpipev")
# Flags that describe the strategy, which --strategy gives in full instead.
STRATEGY_FLAGS = ("pp", "dp", "ep", "microbatches", "schedule", "zero", "recompute")
DEFAULT_XLA_CACHE = os.path.join(
    os.environ.get("XDG_CACHE_HOME", os.path.expanduser("~/.cache")), "piper-jax", "xla"
)


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(
        description=__doc__.split("\n\n")[0], formatter_class=argparse.RawTextHelpFormatter
    )
    parser.add_argument("--steps", type=int, default=1500, help="training steps (default 1500)")
    parser.add_argument("--batch-size", type=int, default=32, help="global batch (default 32)")
    parser.add_argument("--seq-len", type=int, default=64, help="characters per sequence (64)")
    parser.add_argument("--d-model", type=int, default=64, help="model width (default 64)")
    parser.add_argument(
        "--layers",
        type=int,
        default=4,
        help="transformer blocks (default 4, at least 1 per region)",
    )
    parser.add_argument(
        "--model",
        choices=("gpt", "moe"),
        default="gpt",
        help="gpt (default) or moe: the mixture-of-experts transformer of examples/moe.py "
        "(4 experts, top-2 routing)",
    )
    parser.add_argument("--dropout", type=float, default=0.0, help="dropout rate (default 0)")
    parser.add_argument("--lr", type=float, default=3e-3, help="adamw learning rate (3e-3)")
    parser.add_argument("--seed", type=int, default=0, help="model init and data order (0)")
    group = parser.add_argument_group("strategy (or give it whole with --strategy)")
    group.add_argument("--pp", type=int, help="pipeline devices (default 2)")
    group.add_argument("--dp", type=int, help="data-parallel replicas per stage (default 2)")
    group.add_argument(
        "--ep",
        type=int,
        help="expert-parallel devices (--model moe): each stage's experts split over N of "
        "its data-parallel devices, N dividing --dp and the 4 experts (default 1)",
    )
    group.add_argument("--microbatches", type=int, help="microbatches per step (default 4)")
    group.add_argument(
        "--schedule",
        choices=SCHEDULES,
        help="pipeline schedule (default 1f1b):\n"
        "  gpipe        all forwards, then all backwards\n"
        "  1f1b         one forward, one backward: at most PP microbatches in flight\n"
        "  interleaved  interleaved 1F1B: two stages per pipeline device (stage s on\n"
        "               device s %% PP); microbatches a multiple of PP\n"
        "  zb-h1        zero-bubble H1: backward split into input and weight gradients\n"
        "  dualpipev    DualPipeV: 2 x PP stages in a V, device r holds stages r and\n"
        "               2PP-1-r; at least 2 x PP microbatches",
    )
    group.add_argument(
        "--zero",
        type=int,
        choices=[0, 1, 2, 3],
        help="ZeRO level over each stage's replicas (default 0, needs --dp 2 or more):\n"
        "  0  replicated parameters, gradients and optimizer state\n"
        "  1, 2  shard gradients and optimizer state (piper-jax reduce-scatters gradients\n"
        "     in every backward, so ZeRO-1 is ZeRO-2)\n"
        "  3  also shard parameters, gathered around each use (FSDP)",
    )
    group.add_argument(
        "--recompute",
        nargs="?",
        const="inputs",
        choices=("inputs", "dots", "costly"),
        help="activation checkpointing: keep only each region's inputs, run its\n"
        "forward again in the backward; '--recompute dots' also keeps every matrix\n"
        "product's output and recomputes only the elementwise work; '--recompute\n"
        "costly' recomputes only cheap elementwise and layout work (not with\n"
        "zb-h1 or dualpipev)",
    )
    group.add_argument(
        "--strategy",
        metavar="FILE.json",
        help="a directive list in the reference Piper JSON format (e.g. from `piper\n"
        "search --out`); the model gets one region per PP index it names",
    )
    parser.add_argument(
        "--eval-every",
        type=int,
        default=250,
        metavar="N",
        help="print the loss on held-out text every N steps and at the end (default\n"
        "250; 0: never)",
    )
    parser.add_argument(
        "--sample-chars", type=int, default=80, help="characters to generate at the end (80)"
    )
    parser.add_argument("--explain", action="store_true", help="print the plans first")
    parser.add_argument(
        "--timeline",
        metavar="PATH",
        help="after training, run one more step instrumented and draw its measured\n"
        "timeline (.png, or .json for Perfetto)",
    )
    parser.add_argument(
        "--processes",
        type=int,
        metavar="N",
        help="run as N processes under piper-launch, the devices split evenly among them",
    )
    parser.add_argument(
        "--resume",
        metavar="DIR",
        help="start from a checkpoint of --save (any strategy); the data stream starts\n"
        "again from --seed",
    )
    parser.add_argument("--save", metavar="DIR", help="write a checkpoint after the last step")
    parser.add_argument(
        "--xla-cache",
        metavar="DIR",
        default=os.environ.get("JAX_COMPILATION_CACHE_DIR", DEFAULT_XLA_CACHE),
        help="JAX's persistent compilation cache: a later run with the same model and\n"
        "strategy loads its programs instead of compiling them ('' turns it off;\n"
        f"default $JAX_COMPILATION_CACHE_DIR, else {DEFAULT_XLA_CACHE})",
    )
    args = parser.parse_args(argv)
    _check(parser, args)
    return args


def _check(parser: argparse.ArgumentParser, args: argparse.Namespace) -> None:
    if args.save and os.path.exists(args.save):  # before training, not after
        parser.error(f"--save {args.save} already exists")
    if args.strategy:
        given = [f"--{f}" for f in STRATEGY_FLAGS if getattr(args, f) not in (None, False)]
        if given:
            parser.error(f"--strategy gives the whole strategy; drop {', '.join(given)}")
        return
    args.pp, args.dp = args.pp or 2, args.dp or 2
    args.microbatches, args.schedule = args.microbatches or 4, args.schedule or "1f1b"
    args.zero, args.ep = args.zero or 0, args.ep or 1
    if args.ep > 1 and (args.model != "moe" or args.dp % args.ep or 4 % args.ep):
        parser.error(
            f"--ep {args.ep} splits the experts of --model moe over a divisor of --dp and 4"
        )
    if args.zero and args.dp < 2:
        parser.error(f"--zero {args.zero} shards over data-parallel replicas: use --dp 2 or more")
    if args.recompute and args.schedule in SPLIT_BACKWARD:
        parser.error(f"--recompute cannot be used with {args.schedule}, which splits the backward")
    m, pp = args.microbatches, args.pp
    if args.schedule == "interleaved" and m % pp:
        parser.error(f"interleaved needs --microbatches a multiple of --pp {pp}, got {m}")
    if args.schedule == "dualpipev" and m < 2 * pp:
        parser.error(f"dualpipev needs --microbatches at least 2 x --pp = {2 * pp}, got {m}")


def built_strategy(args: argparse.Namespace) -> tuple[list, int, int]:
    """(directives, model regions, devices) of the --pp/--dp/--schedule/... flags."""
    import piper_jax as piper

    pp, dp, m, schedule = args.pp, args.dp, args.microbatches, args.schedule
    regions = 2 * pp if schedule in ("interleaved", "dualpipev") else pp
    if schedule == "interleaved":
        group_of = [s % pp for s in range(regions)]
        orders = piper.schedules.interleaved_1f1b(regions, m, pp)
    elif schedule == "dualpipev":
        group_of = [min(s, regions - 1 - s) for s in range(regions)]
        orders = piper.schedules.dualpipev(pp, m)
    else:
        group_of = list(range(regions))
        build = {
            "gpipe": piper.schedules.gpipe,
            "1f1b": piper.schedules.one_f_one_b,
            "zb-h1": piper.schedules.zero_bubble_h1,
        }[schedule]
        orders = build(pp, m)
    directives = [piper.split({"PP": "*"}, num_microbatches=m)]
    for s, k in enumerate(group_of):
        devices = [k + j * pp for j in range(dp)]
        directives.append(piper.place({"PP": s}, devices, stream="pp"))
        if dp > 1:
            directives.append(piper.replicate({"PP": s}, devices, args.zero >= 1, args.zero == 3))
        if args.ep > 1:
            directives.append(piper.shard({"PP": s, "EP": "*"}, devices[: args.ep]))
    if args.recompute:
        directives.append(piper.recompute({"PP": "*"}, keep=args.recompute))
    return directives + orders, regions, pp * dp


def file_strategy(path: str) -> tuple[list, int, int]:
    """(directives, model regions, devices) of a strategy file: one region per PP index
    the file names, as many devices as its largest index names."""
    import piper_jax as piper

    directives = piper.load_directives(path)
    indices, devices = [0], [0]
    for d in directives:
        filters = [f for group in d.filters for f in group] if hasattr(d, "filters") else []
        for flt in filters + [getattr(d, "filter", {})]:
            if isinstance(flt.get("PP"), int):
                indices.append(flt["PP"])
        devices += list(getattr(d, "devices", ()))
    return directives, max(indices) + 1, max(devices) + 1


def describe(args: argparse.Namespace) -> str:
    if args.strategy:
        return f"strategy {args.strategy}"
    text = f"PP={args.pp} x DP={args.dp}, {args.schedule}, m={args.microbatches}"
    if args.ep > 1:
        text += f", EP={args.ep}"
    if args.zero:
        text += f", ZeRO-{args.zero}"
    if args.recompute:
        text += ", recompute" + ("" if args.recompute == "inputs" else f" ({args.recompute})")
    return text


def launch_self(args: argparse.Namespace, argv: list[str], devices: int) -> int:
    """Run this script again as args.processes ranks under piper-launch."""
    from piper_jax import launch

    if devices % args.processes:
        print(
            f"--processes {args.processes} must divide the strategy's {devices} devices",
            file=sys.stderr,
        )
        return 2
    rest, skip = [], False
    for a in argv:  # the same flags without --processes
        if skip or a == "--processes" or a.startswith("--processes="):
            skip = a == "--processes"
            continue
        rest.append(a)
    flags = ["--nprocs", str(args.processes), "--devices-per-proc", str(devices // args.processes)]
    return launch.main([*flags, os.path.abspath(__file__), *rest])


def cpu_devices(count: int) -> list:
    """`count` virtual CPU devices (or the first `count` when JAX started already)."""
    import jax

    try:
        jax.config.update("jax_platforms", "cpu")
        jax.config.update("jax_num_cpu_devices", count)
    except RuntimeError:
        pass  # the backend started already (main() called from a test): use its devices
    devices = jax.devices()
    if len(devices) < count:
        raise SystemExit(f"the strategy needs {count} devices, JAX has {len(devices)}")
    return devices[:count]


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    args = parse_args(argv)
    if args.strategy:
        directives, regions, num_devices = file_strategy(args.strategy)
    else:
        directives, regions, num_devices = built_strategy(args)
    if args.processes and args.processes > 1:
        return launch_self(args, argv, num_devices)
    import piper_jax.distributed

    piper_jax.distributed.initialize()  # joins the other ranks under piper-launch or SLURM
    import jax

    launched = jax.distributed.is_initialized()  # asks without starting the backend
    if args.xla_cache:
        jax.config.update("jax_compilation_cache_dir", args.xla_cache)
        # most of a step's programs compile in 0.1-1 s, below JAX's default of 1 s
        jax.config.update("jax_persistent_cache_min_compile_time_secs", 0.1)
    devices = jax.devices()[:num_devices] if launched else cpu_devices(num_devices)
    import optax
    from flax import nnx
    from tqdm import tqdm

    import piper_jax as piper

    here = os.path.dirname(os.path.abspath(__file__))
    if here not in sys.path:
        sys.path.insert(0, here)
    from data import batches, decode, encode, fixed_batches, load_corpus, split_held_out
    from gpt import GPT, GPTConfig, generate, loss_fn

    main_process = jax.process_index() == 0

    def say(text: str) -> None:
        if main_process:
            tqdm.write(text)

    if args.model == "moe":
        from moe import MoEConfig, MoETransformer
        from moe import loss_fn as moe_loss

        layers = regions * -(-args.layers // regions)  # the same blocks in every region
        config = MoEConfig(d_model=args.d_model, n_layers=layers, num_stages=regions)
        model, loss_fn = MoETransformer(config, rngs=nnx.Rngs(args.seed)), moe_loss
    else:
        config = GPTConfig(
            seq_len=args.seq_len,
            d_model=args.d_model,
            n_layers=max(args.layers, regions),  # at least one block per region
            num_stages=regions,
            dropout=args.dropout,
        )
        model = GPT(config, rngs=nnx.Rngs(args.seed))
    train_ids, held_out = split_held_out(encode(load_corpus()))
    data = batches(train_ids, args.batch_size, args.seq_len, args.seed)
    validation = fixed_batches(held_out, args.batch_size, args.seq_len, count=2)
    optimizer = optax.adamw(args.lr, weight_decay=0.01)
    t0 = time.perf_counter()
    step = piper.compile(loss_fn, model, optimizer, next(data), directives, devices)
    say(
        f"compiled {len(step.lifted.regions)} regions onto {num_devices} devices "
        f"({describe(args)}) in {time.perf_counter() - t0:.1f}s"
    )
    if args.explain:
        say(step.explain())
    if args.resume:
        step.restore(args.resume)
        say(f"resumed parameters and optimizer state from {args.resume}")

    def validation_loss() -> float:
        return sum(step.evaluate(b)["loss"] for b in validation) / len(validation)

    losses = []
    with tqdm(range(args.steps), desc="train", unit="step", disable=not main_process) as bar:
        for i in bar:
            losses.append(step(next(data))["loss"])
            bar.set_postfix(loss=f"{losses[-1]:.3f}")
            if args.eval_every and (i + 1) % args.eval_every == 0 and i + 1 < args.steps:
                recent = losses[-args.eval_every :]
                say(
                    f"step {i + 1}: train loss {sum(recent) / len(recent):.3f}, "
                    f"validation loss {validation_loss():.3f}"
                )
    window = max(1, min(20, len(losses) // 5))
    first = sum(losses[:window]) / window
    last = sum(losses[-window:]) / window
    say(f"loss: first {window} steps {first:.3f} -> last {window} steps {last:.3f}")
    if args.eval_every:
        say(f"validation loss after {args.steps} steps: {validation_loss():.3f}")
    if args.sample_chars and args.model == "gpt":
        head = decode(held_out[:20_000])
        start = head.find("\ndef ") + 1  # a function's first line, else the start
        prompt = head[start : start + args.seq_len // 2]
        text = decode(generate(step.model(), encode(prompt), args.sample_chars, seed=args.seed))
        say(f"sample ({args.sample_chars} characters after the held-out {prompt!r}):\n{text}")
    if args.timeline:
        step.timeline(args.timeline, batch=next(data))
        say(f"measured timeline of one more step written to {args.timeline}")
    if args.save:
        step.save(args.save)
        say(f"saved parameters and optimizer state to {args.save}")
    if not last < first and not args.resume:  # a resumed run may start on a plateau
        print("the loss did not fall", file=sys.stderr)
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
