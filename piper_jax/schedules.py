"""Schedule builders (see piper_jax.directives.schedules)."""

from piper_jax.directives.schedules import (
    dualpipev,
    gpipe,
    interleaved_1f1b,
    one_f_one_b,
    zero_bubble_h1,
)

__all__ = ["dualpipev", "gpipe", "interleaved_1f1b", "one_f_one_b", "zero_bubble_h1"]
