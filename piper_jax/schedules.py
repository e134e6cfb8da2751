"""Schedule builders (see piper_jax.directives.schedules)."""

from piper_jax.directives.schedules import gpipe, one_f_one_b

__all__ = ["gpipe", "one_f_one_b"]
