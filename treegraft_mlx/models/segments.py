"""Several requests' rows in one forward: everything per row runs on all rows at once, attention
(and a recurrent layer's state) runs per request, each against its own cache.

A packed forward (treegraft_mlx/packed.py) passes a `Segments` where a single forward passes
its cache. A layer projects every row together, then hands its per-request step to
`Segments.each`, which calls it once per request on that request's rows with that request's
positions, mask, sliding window and cache, and concatenates the results in row order. So each
request's block is written into its own cache exactly as a forward of that request alone
would write it, and stays pending there for the caller's `commit` / `keep`.

Where every request's cache is a slot of one pool (slots.py), `pooled` writes all rows in one
scatter per layer, and the requests whose block is one AR row (no mask, no window) attend in
one call over the pool, each row masked to its own slot's length; the other requests attend
per request to their own slot. On a GPU, where every request's block is a tree or an AR row,
all of them attend in one call of the varlen kernel (kernels.varlen_tree_attention).
"""

from __future__ import annotations

from dataclasses import dataclass, field
from functools import cached_property
from typing import Any, Callable, Optional

import mlx.core as mx
import numpy as np

from ..kernels import VarlenBlocks
from ..tree import TreeMask, attention_mask


@dataclass(frozen=True)
class Segment:
    """One request's rows [start, end) as one kind of layer sees them (the sliding layers get
    their own view, with the windowed mask and first key). `shared` holds the keys and values
    a Gemma 4 KV-shared layer reads from its producer (this request's, one dict per request
    for every layer); `walk` is a hybrid's tree walk of this request's block."""

    start: int
    end: int
    cache: Any
    positions: Any                    # int (contiguous after the cache) or (rows,) array
    mask: Any                         # None, "causal", an array or a TreeMask
    first_key: int = 0
    shared: dict = field(default_factory=dict)
    walk: Optional[Any] = None

    @property
    def rows(self) -> int:
        return self.end - self.start

    @property
    def ar(self) -> bool:
        """One row attending to its whole context: what a batched call over the pool runs."""
        return (self.rows == 1 and self.mask is None and not self.first_key
                and self.walk is None and not self.shared)


class Segments:
    """The requests of a packed forward, for one kind of layer (full or sliding)."""

    def __init__(self, parts: list[Segment], pool: Any = None):
        if not parts:
            raise ValueError("a packed forward needs at least one request")
        self.parts, self.pool = parts, pool
        self.plan = pool_plan(parts, pool) if pool is not None else None
        # Every row's position, in row order (lazy): what one RoPE over all rows takes.
        self.positions = mx.concatenate([
            mx.arange(s.positions, s.positions + s.rows, dtype=mx.int32)
            if isinstance(s.positions, int) else s.positions.astype(mx.int32).reshape(-1)
            for s in parts])

    def each(self, step: Callable[..., mx.array], *arrays: Optional[mx.array],
             axis: int = 2) -> mx.array:
        """`step(segment, *rows)` for every request, each on its own rows of `arrays` (rows
        along `axis`; None passes as None), concatenated along `axis` in row order."""
        if len(self.parts) == 1:
            return step(self.parts[0], *arrays)
        cuts = [s.start for s in self.parts[1:]]
        split = [[None] * len(self.parts) if a is None else mx.split(a, cuts, axis=axis)
                 for a in arrays]
        outs = [step(s, *(rows[i] for rows in split)) for i, s in enumerate(self.parts)]
        return mx.concatenate(outs, axis=axis)

    def pooled(self, layer: int, q: mx.array, k: mx.array, v: mx.array,
               attend: Callable[..., mx.array],
               batched: Optional[Callable[..., mx.array]] = None,
               varlen: Optional[Callable[..., mx.array]] = None) -> mx.array:
        """Every request's roped q, k, v rows (1, heads, R, head dim) against its own slot of
        `self.pool`: the rows written in one scatter, then `varlen(q, keys, values, blocks)`
        over the whole pool where given and every block is a tree or an AR row; else
        `batched(q, k, v, mask)` once for the AR rows (where given, and there are two or
        more) and `attend(segment, q, k, v)` for each other request on its slot's context +
        block; (1, heads, R, head dim)."""
        plan = self.plan
        self.pool.write_rows(layer, plan.places, k, v)
        if varlen is not None and self.varlen_blocks is not None:
            return varlen(q, self.pool.keys[layer], self.pool.values[layer], self.varlen_blocks)

        def alone(s: Segment, q: mx.array) -> mx.array:
            return attend(s, q, *s.cache.read(layer))

        if batched is None or plan.ar is None:
            return self.each(alone, q)
        together = self._batched(layer, q, plan.ar, batched)
        if len(plan.ar.rows) == len(self.parts):
            return together
        others = mx.split(q, [s.start for s in self.parts[1:]], axis=2)
        outs = [together] + [alone(s, others[i]) for i, s in enumerate(self.parts)
                             if not s.ar]
        return mx.take(mx.concatenate(outs, axis=2), plan.ar.order, axis=2)

    @cached_property
    def varlen_blocks(self) -> Optional[VarlenBlocks]:
        """Each request's slot and tree mask (an AR row: a one-node tree), for the varlen
        kernel; None where a block is neither (a prefill chunk, a window, a hybrid's walk)."""
        blocks = []
        for s in self.parts:
            if s.ar:
                blocks.append((s.cache.slot, attention_mask(np.array([-1]), s.cache.offset)))
            elif (isinstance(s.mask, TreeMask) and not s.first_key and s.walk is None
                  and not s.shared):
                blocks.append((s.cache.slot, s.mask))
            else:
                return None
        return VarlenBlocks.of(blocks)

    def _batched(self, layer: int, q: mx.array, ar: "ArRows", batched) -> mx.array:
        """The AR rows' attention in one call: the pool's slots up to the longest length,
        each query in its slot's batch entry, masked to that slot's own length."""
        rows = q if ar.rows.size == len(self.parts) else mx.take(q, ar.rows_mx, axis=2)
        qs = rows.transpose(2, 1, 0, 3)                       # (AR rows, heads, 1, dim)
        if not ar.identity:
            qs = mx.take(qs, ar.row_of_slot, axis=0)          # (slots, heads, 1, dim)
        n = qs.shape[0]                                       # slots up to the last AR one
        out = batched(qs, self.pool.keys[layer][:n, :, :ar.length],
                      self.pool.values[layer][:n, :, :ar.length], ar.mask)
        if not ar.identity:
            out = mx.take(out, ar.slot_mx, axis=0)
        return out.transpose(2, 1, 0, 3)                      # (1, heads, AR rows, dim)


@dataclass(frozen=True)
class ArRows:
    """Where the AR rows of a pooled forward sit: their rows, their slots, and the batched
    call's layout (one batch entry a slot, up to the highest slot an AR row uses; a slot no
    AR row uses attends to its first position only, and its output is dropped)."""

    rows: np.ndarray          # the AR rows, in row order
    rows_mx: mx.array
    slot_mx: mx.array         # each AR row's slot
    row_of_slot: mx.array     # each batch entry's AR row (0 for an unused slot)
    identity: bool            # AR row i is in slot i, every slot up to the last is used
    length: int               # keys the call reads a slot: the longest AR context + 1
    mask: mx.array            # (slots, 1, 1, length): a slot's own positions
    order: mx.array           # row order from [AR rows..., other requests' rows...]


@dataclass(frozen=True)
class PoolPlan:
    """A pooled forward's layout, the same in every layer."""

    places: mx.array          # where each row goes in the pool (SlotPool.places)
    ar: Optional[ArRows]      # None: fewer than two AR rows


def pool_plan(parts: list[Segment], pool: Any) -> PoolPlan:
    """Each row's slot and position in the pool (its request's committed length + its row in
    the block), and the layout of the batched call over the AR rows (built once a forward)."""
    slots = np.concatenate([np.full(s.rows, s.cache.slot) for s in parts])
    places = np.concatenate([s.cache.offset + np.arange(s.rows) for s in parts])
    ar = [s for s in parts if s.ar]
    places = pool.places(slots, places)
    if len(ar) < 2:
        return PoolPlan(places, None)
    rows = np.array([s.start for s in ar])
    ar_slots = np.array([s.cache.slot for s in ar])
    entries = int(ar_slots.max()) + 1
    length = int(max(s.cache.offset for s in ar)) + 1
    lengths, row_of_slot = np.ones(entries, np.int64), np.zeros(entries, np.int64)
    lengths[ar_slots] = [s.cache.offset + 1 for s in ar]
    row_of_slot[ar_slots] = np.arange(len(ar))
    mask = np.arange(length)[None, :] < lengths[:, None]
    others = np.concatenate([np.arange(s.start, s.end) for s in parts if not s.ar] or
                            [np.zeros(0, np.int64)])
    order = np.argsort(np.concatenate([rows, others]), kind="stable")
    identity = entries == len(ar) and np.array_equal(ar_slots, np.arange(len(ar)))
    return PoolPlan(places, ArRows(
        rows, mx.array(rows, mx.int32), mx.array(ar_slots, mx.int32),
        mx.array(row_of_slot, mx.int32), bool(identity), length,
        mx.array(mask[:, None, None, :]), mx.array(order, mx.int32)))
