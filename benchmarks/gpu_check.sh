#!/usr/bin/env bash
# One prepared device check for a machine with one NVIDIA GPU and this repository checked
# out: make or reuse .venv, add the CUDA build of jax if the venv cannot see a GPU, then
# time the example GPT on one GPU under piper-jax (no directives) and under one plain
# jax.jit step, with the ratio and MFU. Finishes within ~5 minutes including compiles.
# Extra arguments go to benchmarks/gpu_step.py (e.g. --peak-tflops 312 for an A100);
# with --cpu-smoke it checks the script on the CPU and installs nothing.
set -euo pipefail
root="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
cd "$root"
bash scripts/setup.sh
case " $* " in
  *" --cpu-smoke "*) ;;
  *)
    if ! .venv/bin/python -c "import jax; jax.devices('gpu')" >/dev/null 2>&1; then
      echo "no GPU visible to jax in .venv: installing jax[cuda12]==0.10.2"
      .venv/bin/python -m pip install --quiet "jax[cuda12]==0.10.2"
    fi
    if command -v nvidia-smi >/dev/null; then
      nvidia-smi --query-gpu=name,memory.total --format=csv,noheader
    fi
    .venv/bin/python -c "import jax; print('jax', jax.__version__, jax.devices('gpu'))"
    ;;
esac
exec timeout 270 .venv/bin/python benchmarks/gpu_step.py "$@"
