#!/usr/bin/env bash
# One prepared device check for a machine with one NVIDIA GPU and this repository checked
# out: time the example GPT on one GPU under piper-jax (no directives) and under one plain
# jax.jit step, with the ratio and MFU. Finishes within ~5 minutes including compiles.
#
# Which Python: if the machine's python3 already has a JAX that sees a GPU (the lent
# device machines ship one and cannot reach PyPI), that Python runs piper-jax straight
# from this checkout: a temporary folder of links lays the source folders out as the
# package (pyproject.toml's package-dir), so nothing is built or downloaded.
# Otherwise .venv is made or reused and the CUDA build of jax is added to it.
# Extra arguments go to benchmarks/gpu_step.py (e.g. --peak-tflops 312 for an A100);
# with --cpu-smoke it checks the script on the CPU through .venv and installs no CUDA.
set -euo pipefail
root="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
cd "$root"
gpu_jax() { "$1" -c "import jax; jax.devices('gpu')" >/dev/null 2>&1; }
link_source() {  # print a folder that holds piper_jax as pyproject.toml maps it
  local site
  site="$(mktemp -d)"
  mkdir "$site/piper_jax"
  ln -s "$root"/piper_jax/*.py "$site/piper_jax/"
  for sub in ir directives mpmd_runtime; do ln -s "$root/$sub" "$site/piper_jax/$sub"; done
  echo "$site"
}
case " $* " in
  *" --cpu-smoke "*)
    bash scripts/setup.sh
    python=.venv/bin/python
    ;;
  *)
    if gpu_jax python3; then
      PYTHONPATH="$(link_source)${PYTHONPATH:+:$PYTHONPATH}"
      export PYTHONPATH
      python=python3
    else
      bash scripts/setup.sh
      python=.venv/bin/python
      if ! gpu_jax "$python"; then
        echo "no GPU visible to jax in .venv: installing jax[cuda12]==0.10.2"
        "$python" -m pip install --quiet "jax[cuda12]==0.10.2"
      fi
    fi
    if command -v nvidia-smi >/dev/null; then
      nvidia-smi --query-gpu=name,memory.total --format=csv,noheader
    fi
    "$python" -c "import jax, flax, optax; print('jax', jax.__version__, 'flax', \
flax.__version__, 'optax', optax.__version__, jax.devices('gpu'))"
    ;;
esac
exec timeout 270 "$python" benchmarks/gpu_step.py "$@"
