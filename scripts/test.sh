#!/usr/bin/env bash
# The whole test suite: set up, lint, then pytest. Extra arguments go to pytest.
# The tests run on min(cores, 4) pytest-xdist workers (PIPER_TEST_WORKERS sets another
# count; 1 runs them in this process): one worker kept about one core busy, its tests
# mostly compiling or waiting for subprocesses.
set -euo pipefail
root="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
bash "$root/scripts/setup.sh"
cd "$root"
.venv/bin/ruff check .
cores="$(nproc 2>/dev/null || echo 1)"
workers="${PIPER_TEST_WORKERS:-$(( cores < 4 ? cores : 4 ))}"
parallel=()
if [ "$workers" -gt 1 ]; then
  parallel=(-n "$workers")
fi
exec .venv/bin/python -m pytest -q "${parallel[@]}" "$@"
