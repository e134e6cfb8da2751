"""Programs that lower to the same module run one compiled executable.

Note [updates of identical stages]
Twin regions share their passes' programs (Note [twin regions share programs] in
twins.py), but not their updates: an optimizer may treat parameters differently by name
(`optax.masked`, `multi_transform`, adamw's mask by path), so whether two stages' updates
are one program is not known from the regions. It is known once both are lowered: two
jitted functions whose StableHLO modules for arguments of the same pytree structure are
equal text (but for the names jax gives the module and its inputs' and outputs' pytree
paths) compute the same function of those arguments, output by output, whatever Python
built them; on the same devices (which the text does not name) they are one executable,
as JAX's persistent compilation cache keys it. The text must show every input: jax.jit
drops the arguments a program does not read from its module unless it keeps them
(`keep_unused`), and two updates that pick their gradients out of one bucket of several
regions' gradients read different positions of the same inputs with no trace in the text
(a data-parallel StageMLP trained wrong until every argument was kept). Such an update
takes only its own gradients out of the bucket (`Piece.picks`: the executor passes those
positions alone and the program files them under their positions again), so that the
updates of identical stages under data parallelism or ZeRO are one program too.

`SamePrograms.resolve` lowers each update program of a group holding several (and each
optimizer state's init), jitted with `keep_unused=True`, for its arguments on its first
call; it compiles the first of every module and hands every later function of the same
module the first one's jitted function, whose cache then holds the executable. XLA
compiles the update of identical stages once, and an optimizer that treats them
differently by name gives different modules, so separate programs. A caller reads the
shared program's outputs by position, in its own structure (the first function's pytree
of outputs carries the first stage's paths). Lowering costs a few hundredths of a second
against XLA:CPU's ~0.3 s per update program of a small transformer layer: on 2 virtual
CPU devices the example GPT reached its first step in 0.79-0.85x the time under
interleaved 1F1B (8 stages; 47 XLA compilations instead of 55) and 0.77-0.96x under
DualPipeV (45 instead of 47), 3 rounds of benchmarks/twin_programs.py, with the same
losses to the last bit; the example GPT of 8 layers, one region each, data-parallel on 4
devices, in 0.78-0.82x (8.48-8.82 s against 10.72-10.88 s, 3 rounds). Where the executor
compiles ahead on several threads (Note [compiling ahead]: hosts of 4 or more cores), the
threads resolve the updates the same way, from abstract arguments: a thread whose module
another is compiling waits for it.
"""

from __future__ import annotations

import re
import threading
from collections.abc import Callable, Hashable, Sequence
from typing import Any

import jax

_MODULE_NAME = re.compile(r"^module @[\w.$-]+", re.MULTILINE)
_MAIN = re.compile(r"^ *func\.func public @main\((.*)$", re.MULTILINE)
_ARGUMENT = re.compile(r"%arg\d+:")
_PATH_NAMES = re.compile(r'jax\.(?:result|arg)_info = "(?:[^"\\]|\\.)*",? ?')


def anonymous(module_text: str) -> str:
    """A lowered module's text without the names jax gives it: the module's (after the
    function) and its inputs' and outputs' (their pytree paths)."""
    return _PATH_NAMES.sub("", _MODULE_NAME.sub("module @program", module_text, count=1))


class SamePrograms:
    """The jitted functions whose programs have been compiled (or are being compiled, on
    another thread), by their devices and lowered module."""

    def __init__(self) -> None:
        self._by_module: dict[tuple, tuple[Callable, threading.Event]] = {}
        self._lock = threading.Lock()

    def resolve(self, jitted: Any, args: Sequence[Any], devices: Hashable) -> Callable:
        """What to call for `jitted(*args)` on `devices`: an earlier jitted function whose
        program for arguments like `args` (arrays or abstract values) on the same devices
        lowered to the same module, or `jitted` itself, compiled here for `args` (its call
        then compiles nothing). `jitted` should keep its unused arguments: one whose
        module dropped some is never shared."""
        lowered = jitted.lower(*args)
        text = lowered.as_text(debug_info=False)  # every constant, no source locations
        leaves = jax.tree.leaves(args)
        main = _MAIN.search(text)
        if main is None or len(_ARGUMENT.findall(main.group(1))) != len(leaves):
            lowered.compile()
            return jitted
        # the first function is called with these arguments (their structure and weak
        # types select its compiled program) and its outputs read by position (they
        # carry its own paths)
        weak = tuple(bool(getattr(x, "weak_type", False)) for x in leaves)
        module = (devices, lowered.in_tree, weak, anonymous(text))
        with self._lock:
            first, compiled = self._by_module.setdefault(module, (jitted, threading.Event()))
        if first is not jitted:
            compiled.wait()
            return first
        if not compiled.is_set():
            try:
                lowered.compile()  # into jitted's own cache
            finally:
                compiled.set()
        return first
