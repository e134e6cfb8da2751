"""Every test sees 8 virtual CPU devices (the backend starts after this runs), and every
plan a test compiles must read back from its text."""

import atexit
import os
import shutil
import sys
import tempfile

import jax
import pytest

# XLA:CPU's compile time dominates the suite, and the tests check equality, not speed:
# the legacy fusion emitters, no LLVM optimization and one codegen split compile the
# tests' tiny programs several times faster (a main-job run's XLA compile: 20 s -> 3.6 s).
# Set before the backend starts; subprocesses inherit it.
_FAST_COMPILE = (
    "--xla_cpu_use_fusion_emitters=false --xla_backend_optimization_level=0 "
    "--xla_cpu_parallel_codegen_split_count=1"
)
if _FAST_COMPILE not in os.environ.get("XLA_FLAGS", ""):
    os.environ["XLA_FLAGS"] = f"{os.environ.get('XLA_FLAGS', '')} {_FAST_COMPILE}".strip()
jax.config.update("jax_num_cpu_devices", 8)
jax.config.update("jax_platforms", "cpu")
# start the backend now: a test that runs the main job in-process (`train.main`) would
# otherwise set its own device count for every later test of the worker
jax.devices()

# One XLA compilation cache for the whole run, fresh each run: the tests compile the same
# tiny programs many times over (the references, the same strategies on the same models),
# and a cache hit skips XLA's compile, which dominates the suite. Subprocesses (the main
# job, multi-process runs) share it through the environment.
# pytest-xdist's workers inherit the directory the first process made (and only that
# process removes it).
if "PIPER_TESTS_XLA_CACHE" not in os.environ:
    os.environ["PIPER_TESTS_XLA_CACHE"] = tempfile.mkdtemp(prefix="piper-tests-xla-cache-")
    atexit.register(shutil.rmtree, os.environ["PIPER_TESTS_XLA_CACHE"], ignore_errors=True)
_CACHE = {
    "JAX_COMPILATION_CACHE_DIR": os.environ["PIPER_TESTS_XLA_CACHE"],
    "JAX_PERSISTENT_CACHE_MIN_COMPILE_TIME_SECS": "0",
    "JAX_PERSISTENT_CACHE_MIN_ENTRY_SIZE_BYTES": "0",
}
os.environ.update(_CACHE)
jax.config.update("jax_compilation_cache_dir", _CACHE["JAX_COMPILATION_CACHE_DIR"])
jax.config.update("jax_persistent_cache_min_compile_time_secs", 0)
jax.config.update("jax_persistent_cache_min_entry_size_bytes", 0)
sys.path.insert(0, os.path.dirname(__file__))  # tests import the shared `helpers`


@pytest.fixture(autouse=True)
def plans_round_trip_through_text(monkeypatch: pytest.MonkeyPatch) -> None:
    """Every plan any test compiles is checked to read back from its own text."""
    from piper_jax.mpmd_runtime.plans import Plans

    from piper_jax import lowering

    compile_plans = lowering.compile_plans

    def checked(*args, **kwargs):
        plans = compile_plans(*args, **kwargs)
        text = plans.to_text()
        again = Plans.from_text(text)
        assert again == plans, "plans differ after a round trip through their text"
        assert again.to_text() == text
        return plans

    monkeypatch.setattr(lowering, "compile_plans", checked)
