"""Every test sees 8 virtual CPU devices (the backend starts after this runs), and every
plan a test compiles must read back from its text."""

import os
import sys

import jax
import pytest

jax.config.update("jax_num_cpu_devices", 8)
jax.config.update("jax_platforms", "cpu")
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
