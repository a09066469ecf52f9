"""A step's work around its forward as a generator (a part), and one part driven by itself.

A part yields the rows it wants run (a RequestBlock), is sent what the forward gave them (Ran),
yields what it reads back (Read), is sent the values, and returns its result. `alone` drives a
part with a forward and a readback of its own; the batch (batch.py) drives many parts with one
packed forward and one readback between them. So a request decoded alone and one decoded in a
batch run the same code, and differ only in who runs their forward (docs/design.md §23).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Callable, Generator, Optional

import mlx.core as mx

from .readback import read_back

Part = Generator    # yields RequestBlock and Read, is sent Ran and the values read back


@dataclass(frozen=True)
class RequestBlock:
    """One request's rows: tokens (L,), its cache, positions (None: contiguous after the
    cache), mask (None: causal for several rows; a TreeMask for a tree), and the rows whose
    logits are wanted (None: all), as a forward of this request alone takes them."""

    tokens: Any                         # (L,) token ids: a list or an mx.array
    cache: Any
    positions: Optional[mx.array] = None
    mask: Any = None
    logits_rows: Any = None            # a sequence of ints or an int array

    @property
    def rows(self) -> int:
        return len(self.tokens)

    def wanted(self) -> mx.array:
        """The rows whose logits are returned, as block rows (int32, on the device: an array
        of rows is never read back)."""
        if self.logits_rows is None:
            return mx.arange(self.rows, dtype=mx.int32)
        return mx.array(self.logits_rows).astype(mx.int32).reshape(-1)

    def ids(self) -> mx.array:
        return mx.array(self.tokens).astype(mx.int32).reshape(-1)


@dataclass(frozen=True)
class Ran:
    """What a forward gave a part: the logits (n, V) of the rows its block asked for, and the
    last layer's hidden states (L, H) of all its rows (None where the target keeps them: a
    pipeline's last rank) with the head that turns them into logits."""

    logits: mx.array
    hidden: Optional[mx.array]
    head: Optional[Callable[[mx.array], mx.array]] = None
    all_logits: Optional[mx.array] = None     # every row's, where hidden is None


def run_alone(target, block: RequestBlock) -> Ran:
    """One block's forward by itself (the head over the block's wanted rows only)."""
    out = target.forward(block.ids()[None], block.cache, block.positions, block.mask)
    rows = block.logits_rows
    if out.hidden is None:
        logits = out.all_logits if rows is None else out.all_logits[mx.array(rows)]
    else:
        logits = out.head((out.hidden if rows is None else out.hidden[mx.array(rows)])[None])[0]
    return Ran(logits, out.hidden, out.head, out.all_logits)


@dataclass(frozen=True)
class Read:
    """The arrays a part reads back, in one wait with everything else read then."""

    parts: tuple


def alone(target, part: Part):
    """Drive `part` by itself: its forward on `target`, its reads in one wait each; returns
    what it returns."""
    want = next(part)
    try:
        while True:
            if isinstance(want, RequestBlock):
                want = part.send(run_alone(target, want))
            else:
                want = part.send(read_back(*want.parts) if want.parts else [])
    except StopIteration as done:
        return done.value
