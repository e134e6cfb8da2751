#!/usr/bin/env bash
# The main job: set up, then train the example GPT with PP=2 x DP=2 under 1F1B on 4
# virtual CPU devices. Extra arguments go to examples/train.py (see --help).
set -euo pipefail
root="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
bash "$root/scripts/setup.sh"
exec "$root/.venv/bin/python" "$root/examples/train.py" "$@"
