"""The array assembler of the runtime's transfers (JAX's checked constructor on the first
call, the same arrays without the checks after), and jaxpr rewrites run in place of a
function."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax.sharding import Mesh, NamedSharding
from jax.sharding import PartitionSpec as P
from piper_jax.ir import jax_compat


def _sharding() -> NamedSharding:
    return NamedSharding(Mesh(np.array(jax.devices()[:2]), ("u",)), P("u"))


def test_assembled_arrays_equal_jax_constructor_on_every_call():
    sharding = _sharding()
    assemble = jax_compat.array_assembler((2, 3), sharding)
    for step in range(3):  # the first call checks, the later ones do not
        rows = [
            jnp.full((1, 3), 10 * step + i, jnp.float32, device=d)
            for i, d in enumerate(jax.devices()[:2])
        ]
        got = assemble(rows)
        want = jax.make_array_from_single_device_arrays((2, 3), sharding, rows)
        assert got.sharding == want.sharding and got.shape == want.shape
        assert got.dtype == want.dtype and not got.weak_type
        np.testing.assert_array_equal(np.asarray(got), np.asarray(want))
        doubled = jax.jit(lambda x: x * 2)(got)  # a program takes it like any array
        np.testing.assert_array_equal(np.asarray(doubled), 2 * np.asarray(want))


def test_first_call_checks_the_arrays():
    assemble = jax_compat.array_assembler((2, 3), _sharding())
    wrong = [jnp.zeros((1, 4), device=d) for d in jax.devices()[:2]]
    with pytest.raises(ValueError):
        assemble(wrong)


class _Pullback:
    """A callable without a code object, like a `jax.vjp` pullback, that counts how often
    it is printed (printing a pullback prints its whole jaxpr)."""

    printed = 0

    def __call__(self, x: jax.Array) -> jax.Array:
        return jnp.sin(x) * 2

    def __str__(self) -> str:
        _Pullback.printed += 1
        return "pullback"

    __repr__ = __str__


def test_run_rewritten_runs_the_rewrite_without_printing_the_function():
    fn = _Pullback()
    seen = []

    def rewrite(closed):
        seen.append([e.primitive.name for e in closed.jaxpr.eqns])
        return closed

    x = jnp.arange(3.0)
    got = jax.jit(jax_compat.run_rewritten(fn, rewrite))(x)
    np.testing.assert_allclose(np.asarray(got), np.sin(np.arange(3.0)) * 2, rtol=1e-6)
    assert seen == [["sin", "mul"]]
    assert _Pullback.printed == 0


def test_an_output_of_a_nested_call_that_reads_no_marked_input_is_free_of_it():
    """`jnp.where` is a jit call: its zeros output reads none of its inputs, so it is
    free of the marked input although the call reads it, and the slice computing it takes
    the unmarked input only."""

    def fn(w, x):
        where = jax.jit(lambda m, s: (jnp.where(m, s, 0.0), jnp.zeros_like(s)))
        selected, zeros = where(w > 0, x * w)
        return selected, zeros + w, x

    closed = jax.make_jaxpr(fn)(jnp.ones(3), jnp.ones(3))
    assert jax_compat.outputs_free_of(closed, [False, True]) == [False, True, False]
    sliced, reads = jax_compat.output_slice(closed, [False, True, False])
    assert reads == [True, False]
    w = jnp.arange(3.0)
    np.testing.assert_array_equal(jax_compat.run_jaxpr(sliced)(w)[0], w)
