"""What each pipeline stage's forward keeps for its backward, per microbatch: the example
GPT as 2 stages under 1F1B, at several sequence lengths, piper-jax's residuals against
what `jax.vjp` keeps (less the parameters, which no forward copies), keeping everything
and under `recompute(keep="costly")`. The difference is what the backward computes from
the parameters alone (a causal mask broadcast to the scores, the zeros `jnp.where` keeps:
Note [residuals from parameters alone] in ir/residuals.py); it grows with the square of
the sequence. Nothing is timed; a step is run once to trace the programs.

Run: .venv/bin/python benchmarks/residual_bytes.py [--seq-lens 128 512 1024]
"""

from __future__ import annotations

import argparse
import os
import sys

import jax

jax.config.update("jax_platforms", "cpu")
jax.config.update("jax_num_cpu_devices", 2)

import numpy as np  # noqa: E402
import optax  # noqa: E402
from flax import nnx  # noqa: E402
from piper_jax.ir.residuals import nbytes  # noqa: E402

import piper_jax as piper  # noqa: E402
from piper_jax import schedules  # noqa: E402

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "examples"))
from data import batches  # noqa: E402
from gpt import GPT, GPTConfig, loss_fn  # noqa: E402

MIB = 2**20


def stage_bytes(step: piper.TrainStep, group: tuple[int, ...]) -> tuple[int, int]:
    """(bytes of the VJP leaves less the parameters, bytes F keeps) per microbatch, over
    the regions of `group`."""
    rt = step._executor.rt
    vjp = kept = 0
    for region in rt.regions_on(group):
        split = rt.programs(region, group)._residual_structure()
        params = [split.avals[j] for j in split.param_of]
        vjp += nbytes(list(split.avals)) - nbytes(params)
        kept += nbytes(split.kept_avals)
    return vjp, kept


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--seq-lens", type=int, nargs="+", default=[128, 512, 1024])
    parser.add_argument("--d-model", type=int, default=128)
    parser.add_argument("--batch-size", type=int, default=8)
    parser.add_argument("-m", type=int, default=4, help="microbatches")
    args = parser.parse_args(argv)
    print(
        f"GPT d_model {args.d_model}, 4 layers as 2 stages, batch {args.batch_size}, "
        f"m = {args.m}: MiB per microbatch"
    )
    print(f"{'seq':>6}{'keep':>8}{'stage':>6}{'jax.vjp':>10}{'kept':>9}{'kept/vjp':>10}")
    for seq in args.seq_lens:
        config = GPTConfig(seq_len=seq, d_model=args.d_model, n_heads=4, n_layers=4, num_stages=2)
        ids = np.random.default_rng(0).integers(0, config.vocab_size, 4 * seq)
        batch = next(batches(ids, args.batch_size, seq))
        for keep in ("all", "costly"):
            directives = [
                piper.split({"PP": "*"}, num_microbatches=args.m),
                piper.place({"PP": 0}, [0]),
                piper.place({"PP": 1}, [1]),
                *schedules.one_f_one_b(2, args.m),
            ]
            if keep != "all":
                directives.append(piper.recompute({"PP": "*"}, keep=keep))
            model = GPT(config, rngs=nnx.Rngs(0))
            step = piper.compile(loss_fn, model, optax.sgd(0.1), batch, directives)
            step(batch)
            for stage in range(2):
                vjp, kept = stage_bytes(step, (stage,))
                print(
                    f"{seq:>6}{keep:>8}{stage:>6}{vjp / MIB:>10.2f}{kept / MIB:>9.2f}"
                    f"{kept / vjp:>10.2f}"
                )
    return 0


if __name__ == "__main__":
    sys.exit(main())
