"""The model's parameter tree, cut to the leaves one update holds.

The optimizer of a parameter group sees the same tree `nnx.Optimizer` would give it for
the whole model, with only the group's leaves (paths unchanged), plus the global-norm
carrier at the top when the step clips by the global norm (mpmd_runtime/global_norm.py).
"""

from __future__ import annotations

import functools
from collections.abc import Sequence
from typing import Any

import jax
from flax import nnx

from piper_jax.mpmd_runtime.global_norm import CARRIER


def leaf_name(path: tuple) -> str:
    """A parameter leaf's name, as errors and checkpoints print it: ['blocks'][0]['fc1']['bias']."""
    return jax.tree_util.keystr(path).removesuffix(".value")


class ParamTree:
    """Cut trees of an nnx.State of parameters, by leaf name."""

    def __init__(self, params: nnx.State):
        self._entries = {
            "".join(f"[{k!r}]" for k in path): (path, variable)
            for path, variable in nnx.to_flat_state(params)
        }

    @functools.cache  # noqa: B019 - a few cuts per step, kept for its life
    def _cut(self, names: tuple[str, ...], carrier: bool) -> tuple[Any, list[str]]:
        flat = [self._entries[n] for n in names]
        if carrier:
            flat.append(((CARRIER,), jax.numpy.zeros(())))
        leaves, treedef = jax.tree_util.tree_flatten_with_path(nnx.from_flat_state(flat))
        order = [leaf_name(p) for p, _ in leaves]
        return treedef, [CARRIER if n == f"[{CARRIER!r}]" else n for n in order]

    def __call__(self, names: Sequence[str], carrier: bool) -> tuple[Any, list[str]]:
        """(treedef, leaf names in tree order) of the tree cut to `names` (+ carrier)."""
        return self._cut(tuple(names), carrier)
