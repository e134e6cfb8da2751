"""Character-level training data from text every machine has offline: CPython's stdlib.

The standard library's own `.py` sources are real, varied text that needs no download,
so examples and tests train on the same corpus everywhere.
"""

from __future__ import annotations

import os
from collections.abc import Iterator
from pathlib import Path

import numpy as np

VOCAB_SIZE = 128
UNKNOWN_ID = ord("?")


def load_corpus(max_chars: int = 2_000_000) -> str:
    """Concatenate stdlib `.py` files in sorted order (deterministic) up to `max_chars`."""
    parts: list[str] = []
    total = 0
    for path in sorted(Path(os.__file__).parent.glob("*.py")):
        text = path.read_text(encoding="utf-8", errors="replace")
        parts.append(text[: max_chars - total])
        total += len(parts[-1])
        if total >= max_chars:
            break
    return "".join(parts)


def encode(text: str) -> np.ndarray:
    """Map chars to ids in [0, 128): ASCII code points; anything else becomes '?'."""
    ids = np.frombuffer(text.encode("utf-32-le"), dtype=np.uint32)
    return np.where(ids < VOCAB_SIZE, ids, UNKNOWN_ID).astype(np.int32)


def decode(ids: np.ndarray) -> str:
    """Inverse of `encode` for ASCII ids."""
    return "".join(chr(int(i)) for i in np.asarray(ids).reshape(-1))


def batches(
    ids: np.ndarray, batch_size: int, seq_len: int, seed: int = 0
) -> Iterator[dict[str, np.ndarray]]:
    """Endless random windows: {"tokens": (B, T), "targets": tokens shifted by one}, int32."""
    ids = np.asarray(ids, dtype=np.int32)
    if ids.size < seq_len + 1:
        raise ValueError(f"corpus has {ids.size} ids, need at least seq_len + 1 = {seq_len + 1}")
    rng = np.random.default_rng(seed)
    offsets = np.arange(seq_len + 1)
    while True:
        starts = rng.integers(0, ids.size - seq_len, size=batch_size)
        windows = ids[starts[:, None] + offsets]
        yield {"tokens": windows[:, :-1], "targets": windows[:, 1:]}


def split_held_out(ids: np.ndarray, fraction: float = 0.05) -> tuple[np.ndarray, np.ndarray]:
    """(training ids, held-out ids): the last `fraction` of the corpus is never trained on."""
    cut = int(len(ids) * (1 - fraction))
    return ids[:cut], ids[cut:]


def fixed_batches(ids: np.ndarray, batch_size: int, seq_len: int, count: int) -> list[dict]:
    """`count` batches of windows at evenly spaced offsets: the same every call, for a
    validation loss comparable across steps and runs."""
    ids = np.asarray(ids, dtype=np.int32)
    starts = np.linspace(0, ids.size - seq_len - 1, batch_size * count).astype(np.int64)
    windows = ids[starts[:, None] + np.arange(seq_len + 1)]
    return [{"tokens": w[:, :-1], "targets": w[:, 1:]} for w in np.split(windows, count)]
