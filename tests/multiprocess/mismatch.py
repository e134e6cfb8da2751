"""Run by both processes of the plan-mismatch test: process 1 asks for a different
microbatch count than process 0, which must be caught at start-up, not deadlock."""

from __future__ import annotations

import os
import sys

import piper_jax.distributed as dist

dist.initialize()

import optax  # noqa: E402

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
from helpers import StageMLP, mlp_batches, mlp_loss  # noqa: E402

import piper_jax as piper  # noqa: E402


def main() -> None:
    m = 2 if dist.process_index() == 0 else 4
    directives = [
        piper.split({"PP": "*"}, num_microbatches=m),
        piper.place({"PP": 0}, [0]),
        piper.place({"PP": 1}, [1]),
        *piper.schedules.one_f_one_b(2, m),
    ]
    step = piper.compile(
        mlp_loss, StageMLP(2), optax.sgd(0.1), mlp_batches(1)[0], directives, timeout_s=20
    )
    step(mlp_batches(1)[0])
    print("no error: the mismatch went unnoticed", flush=True)


if __name__ == "__main__":
    main()
