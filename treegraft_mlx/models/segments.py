"""Several requests' rows in one forward: everything per row runs on all rows at once, attention
(and a recurrent layer's state) runs per request, each against its own cache.

A packed forward (treegraft_mlx/packed.py) passes a `Segments` where a single forward passes
its cache. A layer projects every row together, then hands its per-request step to
`Segments.each`, which calls it once per request on that request's rows with that request's
positions, mask, sliding window and cache, and concatenates the results in row order. So each
request's block is written into its own cache exactly as a forward of that request alone
would write it, and stays pending there for the caller's `commit` / `keep`.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Callable, Optional

import mlx.core as mx


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


class Segments:
    """The requests of a packed forward, for one kind of layer (full or sliding)."""

    def __init__(self, parts: list[Segment]):
        if not parts:
            raise ValueError("a packed forward needs at least one request")
        self.parts = parts
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
