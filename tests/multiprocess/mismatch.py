"""Run by both processes of the plan-mismatch test: process 1 asks for a different
microbatch count (`microbatches`) or batch size (`batch`) than process 0, which must be
caught at start-up, not deadlock or abort in gloo. Usage: mismatch.py microbatches|batch"""

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
    differ = dist.process_index() == 1
    m = 4 if differ and sys.argv[1] == "microbatches" else 2
    batch = mlp_batches(1, batch_size=32 if differ and sys.argv[1] == "batch" else 16)[0]
    directives = [
        piper.split({"PP": "*"}, num_microbatches=m),
        piper.place({"PP": 0}, [0]),
        piper.place({"PP": 1}, [1]),
        *piper.schedules.one_f_one_b(2, m),
    ]
    step = piper.compile(mlp_loss, StageMLP(2), optax.sgd(0.1), batch, directives, timeout_s=20)
    step(batch)
    print("no error: the mismatch went unnoticed", flush=True)


if __name__ == "__main__":
    main()
