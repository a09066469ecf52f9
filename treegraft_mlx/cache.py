"""A preallocated key/value cache that can keep an arbitrary subset of the last block.

Speculative decoding writes a whole draft tree into the cache, then commits only the accepted
path. Rows are committed by moving them to the contiguous positions after the committed
context (`keep`), so the committed cache is always a prefix and never needs a mask of holes.
"""

from __future__ import annotations

from typing import Sequence

import mlx.core as mx
import numpy as np


class Committed:
    """A cache's committed length (`offset`) and pending block, and the rules that move them
    (a KVCache's, and a slot's of a pool, slots.py)."""

    offset: int = 0
    pending: int = 0

    def commit(self, n: int | None = None) -> None:
        """Commit the first n rows of the pending block (all of it by default)."""
        n = self.pending if n is None else n
        if not 0 <= n <= self.pending:
            raise ValueError(f"cannot commit {n} of {self.pending} pending rows")
        self.offset += n
        self.pending = 0

    def kept(self, rows: Sequence[int]) -> np.ndarray:
        """`rows` as `keep` takes them: ascending rows of the pending block (else it raises)."""
        rows = np.asarray(rows, dtype=np.int64)
        if len(rows) and (rows.min() < 0 or rows.max() >= self.pending
                          or np.any(np.diff(rows) <= 0)):
            raise ValueError(f"rows {rows.tolist()} are not ascending rows of a "
                             f"{self.pending}-row block")
        return rows

    def fits(self, needed: int, max_len: int) -> None:
        """Raises unless a context of `needed` tokens fits the limit `max_len`."""
        if needed > max_len:
            raise ValueError(f"context of {needed} tokens exceeds the limit of {max_len}")

    def rewindable(self, length: int) -> int:
        """The longest committed length at most `length` that `reset` can return to: any
        (a hybrid model's recurrent state cannot say the same, models/hybrid.py)."""
        return length

    def reset(self, length: int = 0) -> None:
        """Truncate the committed context to `length` tokens."""
        if not 0 <= length <= self.offset:
            raise ValueError(f"cannot reset a cache of {self.offset} tokens to {length}")
        self.offset, self.pending = length, 0


class KVCache(Committed):
    """Keys and values of all layers of one model.

    `offset` is the committed length. A forward writes its block at [offset, offset + L) and
    leaves it *pending*; `commit`, `keep` or the next forward decide its fate.
    """

    def __init__(self, num_layers: int, n_kv_heads: int, head_dim: int, max_len: int,
                 dtype: mx.Dtype = mx.float32, chunk: int = 256):
        self.num_layers, self.n_kv_heads, self.head_dim = num_layers, n_kv_heads, head_dim
        self.max_len, self.dtype, self.chunk = max_len, dtype, chunk
        self.keys: list[mx.array | None] = [None] * num_layers
        self.values: list[mx.array | None] = [None] * num_layers
        self.offset = 0
        self.pending = 0
        self.capacity = 0

    def _grow(self, needed: int) -> None:
        """Grow every layer's buffers in whole chunks, up to the context limit."""
        self.fits(needed, self.max_len)
        new_cap = min(self.max_len, -(-needed // self.chunk) * self.chunk)
        shape = (1, self.n_kv_heads, new_cap - self.capacity, self.head_dim)
        for i in range(self.num_layers):
            extra_k, extra_v = mx.zeros(shape, self.dtype), mx.zeros(shape, self.dtype)
            if self.keys[i] is None:
                self.keys[i], self.values[i] = extra_k, extra_v
            else:
                self.keys[i] = mx.concatenate([self.keys[i][..., : self.capacity, :], extra_k], 2)
                self.values[i] = mx.concatenate([self.values[i][..., : self.capacity, :], extra_v], 2)
        self.capacity = new_cap

    def write(self, layer: int, k: mx.array, v: mx.array) -> tuple[mx.array, mx.array]:
        """Write one layer's block after the committed context; return context + block."""
        L = k.shape[2]
        end = self.offset + L
        if layer == 0:
            if end > self.capacity:
                self._grow(end)
            self.pending = L
        self.keys[layer][..., self.offset:end, :] = k
        self.values[layer][..., self.offset:end, :] = v
        return self.keys[layer][..., :end, :], self.values[layer][..., :end, :]

    def pend(self, rows: int) -> None:
        """A block of `rows` is pending: `write` says so at layer 0; a cache of no layers (a
        hybrid model whose layers all carry recurrent states) is told by its owner, so that
        `commit` and `keep` still count the committed length."""
        self.pending = rows

    def keep(self, rows: Sequence[int]) -> None:
        """Commit the given rows of the pending block (ascending), packed contiguously."""
        rows = self.kept(rows)
        n = len(rows)
        if n and not np.array_equal(rows, np.arange(n)):
            src = mx.array(rows + self.offset)
            for i in range(self.num_layers):
                self.keys[i][..., self.offset:self.offset + n, :] = self.keys[i][..., src, :]
                self.values[i][..., self.offset:self.offset + n, :] = self.values[i][..., src, :]
        self.offset += n
        self.pending = 0

    def state(self) -> list[mx.array]:
        """Arrays to evaluate so that pending writes and moves are materialised."""
        return [a for a in self.keys + self.values if a is not None]

    @property
    def nbytes(self) -> int:
        """Bytes held by the preallocated buffers (what the cache costs in memory)."""
        return sum(a.nbytes for a in self.state())

    @staticmethod
    def bytes_for(num_layers: int, n_kv_heads: int, head_dim: int, length: int,
                  dtype: mx.Dtype = mx.float32) -> int:
        """Memory a cache of `length` tokens needs, for estimates before loading."""
        return 2 * num_layers * n_kv_heads * head_dim * length * dtype.size
