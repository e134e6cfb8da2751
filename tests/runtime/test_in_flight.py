"""Note [in-process collectives ahead on XLA:CPU]: a ZeRO-3 group of 2 devices with 64
microbatches, whose gathers read only parameters and the batch and so are all runnable at
once, trains like single-device training; with every program dispatched ahead, XLA:CPU
aborted the process after 40 s. Runs in a child process: the deadlock needs a process of
2 devices (with the tests' 8, XLA's thread pool is larger)."""

from __future__ import annotations

import os
import subprocess
import sys

CHILD = """
import sys
import jax
jax.config.update("jax_num_cpu_devices", 2)
jax.config.update("jax_platforms", "cpu")
sys.path.insert(0, sys.argv[1])
import optax
import piper_jax as piper
from helpers import check_mlp_strategy, mlp_batches
directives = [
    piper.split({"PP": "*"}, num_microbatches=64),
    piper.replicate({"PP": "*"}, [0, 1], shard_params=True),
]
check_mlp_strategy(directives, optax.adam(1e-2), batches=mlp_batches(3, batch_size=128))
print("trained like one device")
"""


def test_zero3_with_64_microbatches_on_2_devices_trains() -> None:
    tests = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    # XLA's default code (not the tests' fast-compiling flags): the abort it ran into
    # came at the first step there, and only later, if at all, with the flags
    env = {k: v for k, v in os.environ.items() if k != "XLA_FLAGS"}
    done = subprocess.run(
        [sys.executable, "-c", CHILD, tests], capture_output=True, text=True, timeout=180, env=env
    )
    assert done.returncode == 0, done.stdout[-2000:] + done.stderr[-4000:]
    assert "trained like one device" in done.stdout
