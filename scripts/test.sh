#!/usr/bin/env bash
# The whole test suite: set up, lint, then pytest. Extra arguments go to pytest.
set -euo pipefail
root="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
bash "$root/scripts/setup.sh"
cd "$root"
.venv/bin/ruff check .
exec .venv/bin/python -m pytest -q "$@"
