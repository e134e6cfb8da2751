"""Run by every process of a multi-process test: train a strategy for 3 steps and check
the single-device oracle on this process. Usage: train_check.py STRATEGY"""

from __future__ import annotations

import os
import sys

import piper_jax.distributed as dist

dist.initialize()

import jax  # noqa: E402
import optax  # noqa: E402

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, os.path.dirname(HERE))
from flax import nnx  # noqa: E402
from helpers import (  # noqa: E402
    assert_matches_reference,
    check_mlp_strategy,
    mlp_batches,
    token_batches,
)

import piper_jax as piper  # noqa: E402
from piper_jax import schedules  # noqa: E402


def strategy(name: str) -> tuple[int, list]:
    split = [piper.split({"PP": "*"}, num_microbatches=4)]
    if name == "pp2_1f1b":
        places = [piper.place({"PP": s}, [s]) for s in range(2)]
        return 2, split + places + schedules.one_f_one_b(2, 4)
    if name == "pp2_zbh1":  # stage 1's deferred weight gradients sit inside exchanges
        places = [piper.place({"PP": s}, [s]) for s in range(2)]
        return 2, split + places + schedules.zero_bubble_h1(2, 4)
    if name == "dp2":
        return 2, [piper.replicate({"PP": "*"}, [0, 1])]
    if name == "pp2_dp2_1f1b":  # stage s on devices [s, s + 2]: each group spans both processes
        groups = [[s, s + 2] for s in range(2)]
        places = [piper.place({"PP": s}, g) for s, g in enumerate(groups)]
        reps = [piper.replicate({"PP": s}, g) for s, g in enumerate(groups)]
        return 2, split + places + reps + schedules.one_f_one_b(2, 4)
    if name == "pp2_2_to_1":  # stage 0 over process 0's two devices, stage 1 on one of 1's
        directives = [piper.place({"PP": 0}, [0, 1]), piper.replicate({"PP": 0}, [0, 1])]
        directives += [piper.place({"PP": 1}, [2])]
        return 2, split + directives + schedules.one_f_one_b(2, 4)
    if name == "pp2_1_to_2_zero3":  # stage 0 on one device, stage 1 ZeRO-3 over two
        directives = [piper.place({"PP": 0}, [0]), piper.place({"PP": 1}, [2, 3])]
        directives += [piper.replicate({"PP": 1}, [2, 3], shard_params=True)]
        return 2, split + directives + schedules.one_f_one_b(2, 4)
    if name == "tp2_spanning":  # one tensor-parallel group over both processes
        tp = piper.shard_tensor({}, [0, 1], params={"blocks/0": "colwise", "blocks/1": "rowwise"})
        return 2, split + [tp]
    if name == "pp2_tp2_per_process":  # each stage tensor-parallel on one process's devices
        directives = []
        for s, devices in enumerate(([0, 1], [2, 3])):
            split_as = {f"blocks/{s}": "rowwise" if s else "colwise"}
            directives += [
                piper.place({"PP": s}, devices),
                piper.shard_tensor({"PP": s}, devices, params=split_as),
            ]
        return 2, split + directives + schedules.one_f_one_b(2, 4)
    if name == "pp2_ep2_per_process":  # each stage's experts split over one process's devices
        directives = []
        for s, devices in enumerate(([0, 1], [2, 3])):
            directives += [
                piper.place({"PP": s}, devices),
                piper.replicate({"PP": s}, devices),
                piper.shard({"PP": s, "EP": "*"}, devices),
            ]
        return 2, split + directives + schedules.one_f_one_b(2, 4)
    if name == "pp3_ep_spanning":  # the middle stage's experts split over both processes
        directives = [
            piper.place({"PP": 0}, [0]),
            piper.place({"PP": 1}, [1, 2]),
            piper.replicate({"PP": 1}, [1, 2]),
            piper.shard({"PP": 1, "EP": "*"}, [1, 2]),
            piper.place({"PP": 2}, [3]),
        ]
        return 3, split + directives + schedules.one_f_one_b(3, 4)
    if name == "interleaved2":  # rank r holds stages r and r + 2
        places = [piper.place({"PP": s}, [s % 2]) for s in range(4)]
        return 4, split + places + schedules.interleaved_1f1b(4, 4, 2)
    if name == "dualpipev2":  # rank r holds stages r and 3 - r
        places = [piper.place({"PP": s}, [min(s, 3 - s)]) for s in range(4)]
        return 4, split + places + schedules.dualpipev(2, 4)
    raise SystemExit(f"unknown strategy {name}")


# transfers that meet as one program per step, at m = 4 (Note [transfers that meet
# together]): 1F1B's B1.k with F0.(k + 1), ZB-H1's BI1.k with F0.(k + 1) across stage 1's
# deferred weight gradient (Note [meeting before local work]), k = 1, 2
EXCHANGES = {"pp2_1f1b": 2, "pp2_dp2_1f1b": 2, "pp2_zbh1": 2}


def check_moe_pp2_ep2() -> None:
    """The example MoE transformer, one stage per process, each stage's experts split
    over its process's two devices (routing, capacity and the aux loss as on one device)."""
    sys.path.insert(0, os.path.join(os.path.dirname(os.path.dirname(HERE)), "examples"))
    from moe import MoEConfig, MoETransformer, loss_fn

    cfg = MoEConfig(d_model=16, n_heads=2, n_layers=2, num_stages=2, d_expert=32)
    directives = [piper.split({"PP": "*"}, num_microbatches=2)]
    for s, devices in enumerate(([0, 1], [2, 3])):
        directives += [
            piper.place({"PP": s}, devices),
            piper.replicate({"PP": s}, devices),
            piper.shard({"PP": s, "EP": "*"}, devices),
        ]
    directives += schedules.one_f_one_b(2, 2)

    def make() -> MoETransformer:
        return MoETransformer(cfg, rngs=nnx.Rngs(0))

    batches = token_batches(2, cfg.vocab_size, 8, batch_size=8)
    opt = optax.adamw(1e-2, eps=1e-4)
    step = piper.compile(loss_fn, make(), opt, batches[0], directives)
    assert_matches_reference(step, loss_fn, make, opt, batches)


def check_transfer_witnesses(step: piper.TrainStep) -> None:
    """What the executor keeps of a transfer to wait for it is a one-element marker per
    device, not the payload (which FREE must be able to free)."""
    ex = step._executor
    for i, witness in ex._witnesses:
        members, index = ex.step_events[i]
        if ex.plans.steps[members[0]][index[0]].head.op == "SEND":
            sizes = [x.size for x in witness]
            assert all(n <= jax.device_count() for n in sizes), (i, sizes)


def check_recorded_transfers(step: piper.TrainStep) -> None:
    """An instrumented step records what this process's devices ran: a transfer as SEND
    where this process sends and as RECV of its own group where it only receives."""
    mine = {i for i, d in enumerate(step.devices) if d.process_index == jax.process_index()}
    events = step._executor.run_recorded(step._batch_leaves(mlp_batches(1)[0]))
    assert all(set(e.group) <= mine for e in events), [e.label for e in events]
    kinds = {e.kind for e in events}
    assert {"SEND", "RECV"} <= kinds, kinds
    assert all(e.label.startswith("RECV") for e in events if e.kind == "RECV")


def main() -> None:
    if sys.argv[1] == "moe_pp2_ep2_per_process":
        check_moe_pp2_ep2()
    else:
        num_stages, directives = strategy(sys.argv[1])
        experts = 4 if "_ep" in sys.argv[1] else 0  # the toy expert layers of StageMLP
        step = check_mlp_strategy(directives, optax.adam(1e-2), num_stages, experts=experts)
        check_transfer_witnesses(step)
        if sys.argv[1] in EXCHANGES:
            exchanges = [p for p in step._executor.exchanges.values() if len(p) > 1]
            assert len(exchanges) == EXCHANGES[sys.argv[1]], exchanges
        if sys.argv[1] == "pp2_1f1b":
            check_recorded_transfers(step)
    print(f"ORACLE OK process {jax.process_index()} of {jax.process_count()}", flush=True)


if __name__ == "__main__":
    main()
