"""The main job: train the example GPT as a character-level language model on the Python
standard library's own source, with a piper-jax strategy on virtual CPU devices.

Default: PP=2 x DP=2 under 1F1B on 4 devices. Run with --help for the options.
"""

from __future__ import annotations

import argparse
import os
import sys
import time


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--steps", type=int, default=1500, help="training steps")
    parser.add_argument("--batch-size", type=int, default=32, help="global batch size")
    parser.add_argument("--seq-len", type=int, default=64)
    parser.add_argument("--pp", type=int, default=2, help="pipeline stages")
    parser.add_argument("--dp", type=int, default=2, help="data-parallel replicas per stage")
    parser.add_argument("--microbatches", type=int, default=4)
    parser.add_argument("--schedule", choices=["1f1b", "gpipe"], default="1f1b")
    parser.add_argument("--lr", type=float, default=3e-3)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--explain", action="store_true", help="print the plans first")
    parser.add_argument(
        "--resume",
        metavar="DIR",
        help="start from a checkpoint of --save (any --pp/--dp); the data stream starts "
        "again from --seed",
    )
    parser.add_argument("--save", metavar="DIR", help="write a checkpoint after the last step")
    args = parser.parse_args(argv)
    if args.save and os.path.exists(args.save):  # before training, not after
        parser.error(f"--save {args.save} already exists")
    return args


def strategy(pp: int, dp: int, m: int, schedule: str) -> list:
    import piper_jax as piper

    directives = [piper.split({"PP": "*"}, num_microbatches=m)]
    for s in range(pp):
        devices = [s + k * pp for k in range(dp)]
        directives.append(piper.place({"PP": s}, devices, stream="pp"))
        if dp > 1:
            directives.append(piper.replicate({"PP": s}, devices))
    build = piper.schedules.one_f_one_b if schedule == "1f1b" else piper.schedules.gpipe
    return directives + build(pp, m)


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    num_devices = args.pp * args.dp
    import jax

    jax.config.update("jax_platforms", "cpu")
    jax.config.update("jax_num_cpu_devices", num_devices)
    import optax
    from flax import nnx
    from tqdm import tqdm

    import piper_jax as piper

    sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
    from data import batches, encode, load_corpus
    from gpt import GPT, GPTConfig, loss_fn

    config = GPTConfig(seq_len=args.seq_len, num_stages=args.pp)
    model = GPT(config, rngs=nnx.Rngs(args.seed))
    data = batches(encode(load_corpus()), args.batch_size, args.seq_len, args.seed)
    optimizer = optax.adamw(args.lr, weight_decay=0.01)
    directives = strategy(args.pp, args.dp, args.microbatches, args.schedule)
    t0 = time.perf_counter()
    step = piper.compile(loss_fn, model, optimizer, next(data), directives)
    print(
        f"compiled {len(step.lifted.regions)} regions onto {num_devices} devices "
        f"(PP={args.pp} x DP={args.dp}, {args.schedule}, m={args.microbatches}) "
        f"in {time.perf_counter() - t0:.1f}s"
    )
    if args.explain:
        print(step.explain())
    if args.resume:
        step.restore(args.resume)
        print(f"resumed parameters and optimizer state from {args.resume}")
    losses = []
    with tqdm(range(args.steps), desc="train", unit="step") as bar:
        for _ in bar:
            losses.append(step(next(data))["loss"])
            bar.set_postfix(loss=f"{losses[-1]:.3f}")
    window = max(1, min(20, len(losses) // 5))
    first = sum(losses[:window]) / window
    last = sum(losses[-window:]) / window
    print(f"loss: first {window} steps {first:.3f} -> last {window} steps {last:.3f}")
    if args.save:
        step.save(args.save)
        print(f"saved parameters and optimizer state to {args.save}")
    if not last < first and not args.resume:  # a resumed run may start on a plateau
        print("the loss did not fall", file=sys.stderr)
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
