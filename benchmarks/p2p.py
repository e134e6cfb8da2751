"""Point-to-point bandwidth between two processes: the runtime's transfer vs a raw ppermute.

For float32 payloads of 4 KiB, 1 MiB, 16 MiB and 64 MiB, moves one (1, n) buffer from
the only device of process 0 to the only device of process 1 (gloo on 127.0.0.1) with
  runtime: `mpmd_runtime.transport.make_transfer` between two 1-device groups, as a
           SEND/RECV of a plan does (the sender wraps its buffer into the program's global
           input, the receiver passes placeholder zeros made once, both run a jitted
           2-device ppermute, and the receiver wraps its part of the output as its
           group's array: Note [cheap small transfers]);
  raw:     the same jitted `ppermute` inside `jax.shard_map` on the same 2-device mesh,
           called on a global input array built once.
and, for the same payloads each way, the two directions as one exchange
(`transport.make_exchange`, what the executor runs for a pipeline's back-to-back SENDs
between the same processes: Note [transfers that meet together]) against the two
runtime transfers one after the other.
Each repetition ends with `jax.block_until_ready` on both ranks; runtime and raw calls
alternate (ABBA...) so that the load of other work on the machine hits both alike. The
latency of a size is the larger of the two ranks' median seconds per transfer;
bandwidth = bytes / latency.
Rank 0 prints the table; "zeros ms" is the receiver's median time to make a fresh
jnp.zeros of the payload: what a receive would cost if it made its placeholder on every
call, as the runtime once did.

Run: .venv/bin/python benchmarks/p2p.py --launch       (starts the 2 ranks itself)
  or .venv/bin/python -m piper_jax.launch --nprocs 2 benchmarks/p2p.py
"""

from __future__ import annotations

import argparse
import os
import subprocess
import sys
import time

SIZES = {"4KiB": 4 << 10, "1MiB": 1 << 20, "16MiB": 16 << 20, "64MiB": 64 << 20}
# (warm-up, timed) repetitions per size: small sizes are cheap, large ones take ~0.1 s.
REPS = {"4KiB": (20, 600), "1MiB": (10, 300), "16MiB": (5, 80), "64MiB": (3, 40)}


def parse(argv: list[str] | None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    p.add_argument("--launch", action="store_true", help="run both ranks via piper-launch")
    p.add_argument("--reps-scale", type=float, default=1.0, help="multiply repetitions by this")
    p.add_argument(
        "--sizes", nargs="+", choices=list(SIZES), default=list(SIZES), help="payload sizes"
    )
    p.add_argument("--timeout", type=float, default=300.0, help="seconds before giving up")
    return p.parse_args(argv)


def launch(argv: list[str], timeout: float) -> int:
    """Re-invoke this script under piper-launch with 2 processes x 1 CPU device."""
    args = [a for a in argv if a != "--launch"]
    cmd = [sys.executable, "-m", "piper_jax.launch", "--nprocs", "2", "--devices-per-proc", "1"]
    cmd += ["--timeout", str(timeout), os.path.abspath(__file__), *args]
    try:
        return subprocess.run(cmd, timeout=timeout + 30).returncode
    except subprocess.TimeoutExpired:
        print("p2p: launcher did not finish in time", file=sys.stderr)
        return 124


def bench(args: argparse.Namespace) -> None:
    import piper_jax.distributed as dist

    dist.initialize()
    import jax
    import jax.numpy as jnp
    import numpy as np
    from jax.experimental import multihost_utils
    from jax.sharding import NamedSharding
    from jax.sharding import PartitionSpec as P
    from piper_jax.mpmd_runtime.programs import group_mesh, stacked
    from piper_jax.mpmd_runtime.transport import TransferSpec, make_exchange, make_transfer

    if jax.process_count() != 2 or jax.device_count() != 2:
        raise SystemExit("p2p.py needs 2 processes x 1 device: use --launch")
    rank = jax.process_index()
    dev0, dev1 = jax.devices()
    src_mesh, dst_mesh = group_mesh([dev0]), group_mesh([dev1])
    pair = group_mesh([dev0, dev1], [("r", 2)])
    raw_program = jax.jit(
        jax.shard_map(
            lambda x: jax.lax.ppermute(x, "r", [(0, 1)]),
            mesh=pair,
            in_specs=P("r"),
            out_specs=P("r"),
        )
    )
    mine = jax.local_devices()[0]

    def timed(fns: list, warmup: int, reps: int) -> list[float]:
        """Median s per call of each of `fns`, interleaved (order flipped every repetition)
        so that drifting load on this small machine hits all of them alike."""
        times: list[list[float]] = [[] for _ in fns]
        for i in range(warmup + reps):
            order = range(len(fns)) if i % 2 == 0 else reversed(range(len(fns)))
            for k in order:
                t0 = time.perf_counter()
                jax.block_until_ready(fns[k]())
                if i >= warmup:
                    times[k].append(time.perf_counter() - t0)
        return [float(np.median(t)) for t in times]

    rows = []
    for name in args.sizes:
        n = SIZES[name] // 4
        warmup, reps = (max(1, round(r * args.reps_scale)) for r in REPS[name])
        # Runtime transfer: sender passes [array on its 1-device group], receiver None.
        avals = [((1, n), np.float32)]
        transfer = make_transfer(src_mesh, dst_mesh, avals, avals)
        if rank == 0:
            arg = [jax.device_put(np.ones((1, n), np.float32), stacked(src_mesh))]
        else:
            arg = None
        # Raw ppermute: global (2, n) array sharded over the pair, built once.
        local = jnp.full((1, n), 1.0 if rank == 0 else 0.0, jnp.float32, device=mine)
        sharding = NamedSharding(pair, P("r"))
        xg = jax.make_array_from_single_device_arrays((2, n), sharding, [local])
        got, _ = transfer(arg)  # correctness (and compiles both): rank 1 got rank 0's ones
        out = raw_program(xg)
        if rank == 1:
            assert float(got[0].addressable_shards[0].data.min()) == 1.0
            assert float(out.addressable_shards[0].data.min()) == 1.0
        del got, out
        fns = [lambda a=arg, t=transfer: t(a), lambda a=xg: raw_program(a)]
        t_runtime, t_raw = timed(fns, warmup, reps)
        # What a fresh placeholder per call would cost the receiver (the runtime makes one).
        (t_zeros,) = timed([lambda n=n: jnp.zeros((1, n), jnp.float32, device=mine)], 2, reps)
        # Both directions: two transfers one after the other vs one exchange.
        back = make_transfer(dst_mesh, src_mesh, avals, avals)
        exchange = make_exchange(
            [
                TransferSpec(src_mesh, dst_mesh, avals, avals),
                TransferSpec(dst_mesh, src_mesh, avals, avals),
            ]
        )
        if rank == 1:
            arg = [jax.device_put(np.ones((1, n), np.float32), stacked(dst_mesh))]
        ahead, behind = (arg, None) if rank == 0 else (None, arg)
        (got, got_back), _ = exchange([ahead, behind])  # each rank got the other's ones
        mine_got = got if rank == 1 else got_back
        assert float(mine_got[0].addressable_shards[0].data.min()) == 1.0
        del got, got_back, mine_got
        fns = [
            lambda a=ahead, b=behind, t=transfer, u=back: (t(a), u(b)),
            lambda a=ahead, b=behind, x=exchange: x([a, b]),
        ]
        t_apart, t_together = timed(fns, warmup, reps)
        rows.append((t_runtime, t_raw, t_zeros, t_apart, t_together))
        del transfer, back, exchange, arg, ahead, behind, local, xg, fns

    mine_t = np.array(rows, np.float64)
    both = np.asarray(multihost_utils.process_allgather(mine_t))  # (2 ranks, sizes, 5)
    if rank != 0:
        return
    print(f"p2p: process 0 -> process 1, 1 CPU device each, gloo; reps x{args.reps_scale:g}")
    print("latency = max over ranks of median s/transfer; BW = payload bytes / latency")
    head = f"{'size':>7} | {'runtime s':>10} {'runtime MB/s':>12} | {'raw s':>10} {'raw MB/s':>9}"
    print(head + f" | {'runtime/raw':>11} | {'zeros ms':>8} | per rank (runtime; raw) ms")
    print("-" * (len(head) + 55))
    for i, name in enumerate(args.sizes):
        lat = both[:, i, :2].max(axis=0)
        bw = SIZES[name] / lat / 1e6
        per = "; ".join(
            f"r{r}: {both[r, i, 0] * 1e3:.2f} {both[r, i, 1] * 1e3:.2f}" for r in (0, 1)
        )
        print(
            f"{name:>7} | {lat[0]:10.3e} {bw[0]:12.1f} | {lat[1]:10.3e} {bw[1]:9.1f}"
            f" | {lat[0] / lat[1]:11.2f} | {both[1, i, 2] * 1e3:8.2f} | {per}"
        )
    print("\nboth directions at once (the payload each way): two transfers vs one exchange")
    print(
        f"{'size':>7} | {'two transfers ms':>16} | {'one exchange ms':>15} | {'exchange/two':>12}"
    )
    for i, name in enumerate(args.sizes):
        apart, together = both[:, i, 3:5].max(axis=0)
        print(
            f"{name:>7} | {apart * 1e3:16.3f} | {together * 1e3:15.3f} | {together / apart:12.2f}"
        )


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    args = parse(argv)
    if args.launch:
        return launch(argv, args.timeout)
    bench(args)
    return 0


if __name__ == "__main__":
    sys.exit(main())
