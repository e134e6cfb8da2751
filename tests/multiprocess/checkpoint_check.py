"""Run by both processes of the multi-process checkpoint tests (2 processes x 2 devices):
train 2 steps under layout BEFORE, save, restore into a step under layout AFTER, train 2
more, and check the uninterrupted single-device reference on every process.
Usage: checkpoint_check.py DIRECTORY BEFORE AFTER (layouts: see LAYOUTS)"""

from __future__ import annotations

import os
import sys

import piper_jax.distributed as dist

dist.initialize()

import jax  # noqa: E402
import numpy as np  # noqa: E402
import optax  # noqa: E402
from flax import nnx  # noqa: E402

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
from helpers import StageMLP, mlp_batches, mlp_loss, reference_run  # noqa: E402

import piper_jax as piper  # noqa: E402


def pipeline(groups: list[list[int]], **zero: bool) -> list:
    return [
        piper.split({"PP": "*"}, num_microbatches=2),
        *[piper.place({"PP": s}, g) for s, g in enumerate(groups)],
        *[piper.replicate({"PP": s}, g, **zero) for s, g in enumerate(groups)],
        *piper.schedules.one_f_one_b(2, 2),
    ]


LAYOUTS = {  # process 0 holds devices 0 and 1, process 1 holds 2 and 3
    "stage_per_process": lambda: pipeline([[0, 1], [2, 3]]),
    "stages_spanning": lambda: pipeline([[0, 2], [1, 3]]),
    "zero2_spanning": lambda: [piper.replicate({"PP": "*"}, [0, 1, 2, 3], shard_grads=True)],
    "zero3_stages_spanning": lambda: pipeline([[0, 2], [1, 3]], shard_params=True),
}


def main() -> None:
    path, before, after = (
        os.path.join(sys.argv[1], "ckpt"),
        LAYOUTS[sys.argv[2]],
        LAYOUTS[sys.argv[3]],
    )
    batches, optimizer = mlp_batches(4), optax.adam(3e-2)
    first = piper.compile(mlp_loss, StageMLP(2), optimizer, batches[0], before())
    losses = [first(b)["loss"] for b in batches[:2]]
    first.save(path)
    model = StageMLP(2, rngs=nnx.Rngs(7))
    second = piper.compile(mlp_loss, model, optimizer, batches[0], after())
    second.restore(path)
    losses += [second(b)["loss"] for b in batches[2:]]
    ref_losses, ref_params = reference_run(mlp_loss, StageMLP(2), optimizer, batches)
    np.testing.assert_allclose(losses, ref_losses, rtol=1e-5)
    for got, want in zip(jax.tree.leaves(second.params()), jax.tree.leaves(ref_params)):
        np.testing.assert_allclose(np.asarray(got), np.asarray(want), rtol=1e-4, atol=1e-6)
    print(f"RESUMED OK process {jax.process_index()} of {jax.process_count()}", flush=True)


if __name__ == "__main__":
    main()
