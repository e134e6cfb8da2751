"""Per-step overhead of piper-jax next to one `jax.jit` step (pjit), on 4 virtual CPU devices.

A thin wrapper around examples/compare_pjit.py with a GPT big enough that a pjit step
takes a few hundred milliseconds on 4 CPU devices (200-280 ms on a shared 2-core
machine), so the ratio measures the runtime's overhead against real work, not against an
empty step. Each strategy runs 6 rounds of one block of steps per system (see
`compare_pjit.race`). The table and the ratio lines go to stdout; nothing is written to
disk. Takes about a minute on 2 cores.

Run: .venv/bin/python benchmarks/overhead_vs_pjit.py [extra compare_pjit.py flags]
(e.g. `--strategies tp --devices 2`: tensor parallelism against the same sharding under
pjit)
"""

from __future__ import annotations

import os
import sys

SIZES = [
    "--devices", "4",
    "--d-model", "128",
    "--layers", "4",
    "--seq-len", "128",
    "--batch-size", "32",
    "--steps", "5",
    "--rounds", "6",
    "--warmup", "2",
]  # fmt: skip


def main(argv: list[str] | None = None) -> int:
    here = os.path.dirname(os.path.abspath(__file__))
    sys.path.insert(0, os.path.join(here, "..", "examples"))
    import compare_pjit  # imports no jax: it configures the CPU devices itself

    extra = sys.argv[1:] if argv is None else argv
    if "-h" in extra or "--help" in extra:
        print(__doc__)
    return compare_pjit.main(SIZES + extra)


if __name__ == "__main__":
    sys.exit(main())
