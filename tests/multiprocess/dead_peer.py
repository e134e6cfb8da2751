"""Run by both processes of the dead-peer tests: after one good step, process 1 dies
(`kill`) or stalls (`stall`), and process 0 must fail its next step with a PiperError
naming process 1 within the step timeout, not hang. Usage: dead_peer.py TIMEOUT MODE"""

from __future__ import annotations

import os
import sys
import time

import piper_jax.distributed as dist

dist.initialize()

import optax  # noqa: E402

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
from helpers import StageMLP, mlp_batches, mlp_loss  # noqa: E402

import piper_jax as piper  # noqa: E402


def main() -> None:
    directives = [
        piper.split({"PP": "*"}, num_microbatches=2),
        piper.place({"PP": 0}, [0]),
        piper.place({"PP": 1}, [1]),
        *piper.schedules.one_f_one_b(2, 2),
    ]
    batches = mlp_batches(2)
    step = piper.compile(
        mlp_loss, StageMLP(2), optax.sgd(0.1), batches[0], directives, timeout_s=float(sys.argv[1])
    )
    step(batches[0])
    print(f"process {dist.process_index()} finished step 1", flush=True)
    if dist.process_index() == 1:
        if sys.argv[2] == "kill":
            os.kill(os.getpid(), 9)
        time.sleep(120)
    try:
        step(batches[1])
    except piper.PiperError as err:
        print(f"PiperError: {err}", flush=True)
        dist.abort(3)
    print("no error: the dead peer went unnoticed", flush=True)
    dist.abort(0)


if __name__ == "__main__":
    main()
