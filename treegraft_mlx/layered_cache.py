"""A KV cache for models whose layers hold keys and values of different shapes.

Gemma 4's sliding and full layers differ in head dim and KV heads, and its KV-shared layers
hold nothing of their own. One `KVCache` per shape holds the layers of that shape (the
producer layers only); every one of them moves in step, so `offset`, `pending`, `commit`,
`keep` and `reset` behave exactly as a single KVCache's.
"""

from __future__ import annotations

from typing import Sequence

import mlx.core as mx

from .cache import KVCache

Shape = tuple[int, int]   # (KV heads, head dim)


class LayeredCache:
    """Keys and values of the layers named in `shapes` (layer -> (KV heads, head dim))."""

    def __init__(self, shapes: dict[int, Shape], max_len: int, dtype: mx.Dtype = mx.float32):
        if not shapes:
            raise ValueError("a layered cache needs at least one layer with keys and values")
        groups: dict[Shape, list[int]] = {}
        for layer in sorted(shapes):
            groups.setdefault(tuple(shapes[layer]), []).append(layer)
        self.caches = [KVCache(len(layers), heads, dim, max_len, dtype)
                       for (heads, dim), layers in groups.items()]
        self.slot = {layer: (g, j) for g, layers in enumerate(groups.values())
                     for j, layer in enumerate(layers)}
        self.max_len, self.dtype = max_len, dtype

    @property
    def offset(self) -> int:
        return self.caches[0].offset

    @property
    def pending(self) -> int:
        return self.caches[0].pending

    def write(self, layer: int, k: mx.array, v: mx.array) -> tuple[mx.array, mx.array]:
        """Write one layer's block after the committed context; return context + block."""
        if layer not in self.slot:
            raise ValueError(f"layer {layer} holds no keys and values of its own")
        g, j = self.slot[layer]
        return self.caches[g].write(j, k, v)

    def committed(self, layer: int, first: int = 0, end: int | None = None
                  ) -> tuple[mx.array, mx.array]:
        """One layer's committed keys and values of positions [first, end) (default: to the
        committed length), (1, heads, n, dim)."""
        g, j = self.slot[layer]
        c = self.caches[g]
        end = c.offset if end is None else end
        if c.keys[j] is None or not 0 <= first <= end <= c.offset:
            raise ValueError(f"positions [{first}, {end}) are not committed ({c.offset} are)")
        return c.keys[j][..., first:end, :], c.values[j][..., first:end, :]

    def commit(self, n: int | None = None) -> None:
        for c in self.caches:
            c.commit(n)

    def keep(self, rows: Sequence[int]) -> None:
        for c in self.caches:
            c.keep(rows)

    def rewindable(self, length: int) -> int:
        return length

    def reset(self, length: int = 0) -> None:
        for c in self.caches:
            c.reset(length)

    def state(self) -> list[mx.array]:
        return [a for c in self.caches for a in c.state()]

    @property
    def nbytes(self) -> int:
        return sum(a.nbytes for a in self.state())

    @staticmethod
    def bytes_for(shapes: Sequence[Shape], length: int, dtype: mx.Dtype = mx.float32) -> int:
        """Memory the layers of these shapes need for `length` tokens, for estimates."""
        return sum(2 * heads * dim * length * dtype.size for heads, dim in shapes)
