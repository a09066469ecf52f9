"""One host wait a step: everything the host reads of a step, packed and read back at once.

Each readback with nothing queued behind it idles a Mac's GPU for the whole host gap
(waits.py), so a step queues every result it needs (the verdict of each verified row, the
chain's tokens, the history's scores) and reads them all in one conversion. Tokens travel as
float32, which holds every integer below 2**24 exactly, far above any vocabulary.
"""

from __future__ import annotations

import mlx.core as mx
import numpy as np

EXACT_INTS = 2 ** 24


def pack(*parts: mx.array) -> mx.array:
    """The parts flattened to float32 and joined, lazily: one array to read back. Built when
    the parts are queued, it is queued with them: built at read time, it would be a new op
    behind whatever was queued since (the next AR forward), and reading it would wait for
    that forward too."""
    flat = [p.astype(mx.float32).reshape(-1) for p in parts]
    return mx.concatenate(flat) if len(flat) > 1 else flat[0]


def unpack(values: np.ndarray, parts: tuple[mx.array, ...]) -> list[np.ndarray]:
    """A packed readback split back into its parts (flat float32)."""
    return np.split(values, np.cumsum([p.size for p in parts])[:-1])


def read_back(*parts: mx.array) -> list[np.ndarray]:
    """The parts, evaluated and read in one wait, each flattened to float32 in numpy."""
    return unpack(np.array(pack(*parts)), parts)


def ints(values: np.ndarray) -> list[int]:
    """Token ids read back as float32."""
    return values.astype(np.int64).tolist()
