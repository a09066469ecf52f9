"""The keys and values of requests decoded together, one slot each in one array per layer.

A batch's requests each need a cache (their own committed context, their own pending block),
and a packed forward must write and read all of them. With one `KVCache` per request, a layer
writes and attends once per request: on a Mac a dispatch per request and layer, on a CPU a
small op each. A `SlotPool` holds every request's keys and values in one array per layer,
(slots, KV heads, capacity, head dim); a request's `SlotCache` is its slot, and behaves as a
`KVCache` does (write, commit, keep, reset). So a packed forward writes every request's rows
in one scatter per layer (`write_rows`), and the requests' AR rows attend in one call, each to
its own slot up to its own length (models/segments.py): no row ever reads another slot, nor
the stale tail of its own past its length.

Slots are taken as requests join and given back as they leave; the pool grows in slots and in
chunks of length as needed (every slot has the capacity of the longest), and drops its
buffers when every slot is free.
"""

from __future__ import annotations

from typing import Optional, Sequence

import mlx.core as mx
import numpy as np

from .cache import Committed


class SlotPool:
    """Keys and values of `slots` requests for a model of `num_layers` layers."""

    def __init__(self, num_layers: int, n_kv_heads: int, head_dim: int,
                 dtype: mx.Dtype = mx.float32, chunk: int = 256):
        self.num_layers, self.n_kv_heads, self.head_dim = num_layers, n_kv_heads, head_dim
        self.dtype, self.chunk = dtype, chunk
        self.keys: list[Optional[mx.array]] = [None] * num_layers
        self.values: list[Optional[mx.array]] = [None] * num_layers
        self.slots = 0            # slots the buffers hold
        self.capacity = 0         # positions each slot holds
        self.taken: dict[int, SlotCache] = {}    # slot -> the cache that holds it

    def take(self, max_len: int) -> "SlotCache":
        """A free slot's cache of at most `max_len` positions (the lowest free slot; the
        buffers grow to hold it at its first write)."""
        slot = min(set(range(len(self.taken) + 1)) - set(self.taken))
        self.taken[slot] = SlotCache(self, slot, max_len)
        return self.taken[slot]

    def give(self, cache: "SlotCache") -> None:
        """`cache`'s slot is free again; with every slot free the buffers are dropped."""
        if self.taken.get(cache.slot) is not cache:
            raise ValueError("this slot is not taken from this pool")
        del self.taken[cache.slot]
        if not self.taken:
            self.keys, self.values = [None] * self.num_layers, [None] * self.num_layers
            self.slots = self.capacity = 0

    def reserve(self, slot: int, needed: int) -> None:
        """Room for `slot` and `needed` positions in every slot (whole chunks); what the
        slots hold is kept."""
        slots = max(self.slots, slot + 1)
        cap = max(self.capacity, -(-needed // self.chunk) * self.chunk)
        if slots == self.slots and cap == self.capacity:
            return
        shape = (slots, self.n_kv_heads, cap, self.head_dim)
        for i in range(self.num_layers):
            for buffers in (self.keys, self.values):
                grown = mx.zeros(shape, self.dtype)
                if buffers[i] is not None:
                    grown[: self.slots, :, : self.capacity] = buffers[i]
                buffers[i] = grown
        self.slots, self.capacity = slots, cap

    def write_rows(self, layer: int, flat: mx.array, k: mx.array, v: mx.array) -> None:
        """Rows of k, v (1, KV heads, R, head dim) into the places `flat` names (`places`):
        one scatter each, for every request of a packed forward (room reserved beforehand).
        The scatter goes through a flat view of the buffer, where MLX updates it in place."""
        dim = self.head_dim
        for buffers, new in ((self.keys, k), (self.values, v)):
            rows = buffers[layer].reshape(-1, dim)
            rows[flat] = new[0].transpose(1, 0, 2).reshape(-1, dim)
            buffers[layer] = rows.reshape(self.slots, self.n_kv_heads, self.capacity, dim)

    def places(self, slots: np.ndarray, positions: np.ndarray) -> mx.array:
        """The flat places (R x KV heads,) of rows at `positions` of `slots`, head by head,
        for `write_rows`."""
        heads = np.arange(self.n_kv_heads)
        flat = (slots[:, None] * self.n_kv_heads + heads[None, :]) * self.capacity
        return mx.array((flat + positions[:, None]).reshape(-1), mx.int32)

    def state(self) -> list[mx.array]:
        return [a for a in self.keys + self.values if a is not None]


class SlotCache(Committed):
    """One request's slot of a pool, with a `KVCache`'s interface (cache.py): `offset` is
    the committed length, a forward's block stays pending for `commit` / `keep`."""

    def __init__(self, pool: SlotPool, slot: int, max_len: int):
        self.pool, self.slot, self.max_len = pool, slot, max_len
        self.num_layers = pool.num_layers
        self.offset = 0
        self.pending = 0

    def pend(self, rows: int) -> None:
        """A block of `rows` is pending (a packed forward writes it with `write_rows`)."""
        self.fits(self.offset + rows, self.max_len)
        self.pool.reserve(self.slot, self.offset + rows)
        self.pending = rows

    def write(self, layer: int, k: mx.array, v: mx.array) -> tuple[mx.array, mx.array]:
        """Write one layer's block after the committed context; return context + block."""
        end = self.offset + k.shape[2]
        if layer == 0:
            self.pend(k.shape[2])
        pool, s = self.pool, self.slot
        pool.keys[layer][s, :, self.offset:end, :] = k[0]
        pool.values[layer][s, :, self.offset:end, :] = v[0]
        return pool.keys[layer][s:s + 1, :, :end, :], pool.values[layer][s:s + 1, :, :end, :]

    def read(self, layer: int) -> tuple[mx.array, mx.array]:
        """Context + pending block of `layer` (after a packed forward's `write_rows`)."""
        end, s = self.offset + self.pending, self.slot
        return (self.pool.keys[layer][s:s + 1, :, :end, :],
                self.pool.values[layer][s:s + 1, :, :end, :])

    def keep(self, rows: Sequence[int]) -> None:
        """Commit the given rows of the pending block (ascending), packed contiguously."""
        rows = self.kept(rows)
        n = len(rows)
        if n and not np.array_equal(rows, np.arange(n)):
            src, s, o = mx.array(rows + self.offset), self.slot, self.offset
            for buffers in (self.pool.keys, self.pool.values):
                for i in range(self.num_layers):
                    buffers[i][s, :, o:o + n, :] = buffers[i][s][:, src, :]
        self.offset += n
        self.pending = 0

    def state(self) -> list[mx.array]:
        return self.pool.state()

    @property
    def nbytes(self) -> int:
        """This slot's share of the pool's buffers."""
        return sum(a.nbytes for a in self.pool.state()) // max(1, self.pool.slots)


def pool_of(blocks: Sequence) -> Optional[SlotPool]:
    """The pool every block's cache is a slot of, or None (then each attends on its own)."""
    caches = [b.cache for b in blocks]
    if not caches or not all(isinstance(c, SlotCache) for c in caches):
        return None
    pools = {id(c.pool) for c in caches}
    return caches[0].pool if len(pools) == 1 else None
