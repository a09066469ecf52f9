"""A target forward as every loop reads it: the last layer's hidden states, where the model
exposes them, and the logits of chosen rows.

One shape for every target (`Model.forward`, `PipelineTarget.forward`), so the decoding loop,
the verification and the prefill never ask what kind of target they hold. The head is applied
only to the rows asked for: a prefill wants one row's logits and keeps the rest deferred, and
MLX computes what is asked, not what could be.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Callable, Optional

import mlx.core as mx


@dataclass(frozen=True)
class Forward:
    """One forward's output (unevaluated): `hidden` (L, H), or None where the states stay
    elsewhere (a pipeline's last rank, which returns every row's logits instead)."""

    hidden: Optional[mx.array]
    head: Optional[Callable[[mx.array], mx.array]] = None   # (1, n, H) -> (1, n, V)
    all_logits: Optional[mx.array] = None                   # (L, V), where hidden is None

    def logits(self, rows: Optional[slice] = None) -> mx.array:
        """Logits (n, V) of `rows` (all by default)."""
        if self.hidden is None:
            return self.all_logits if rows is None else self.all_logits[rows]
        h = self.hidden if rows is None else self.hidden[rows]
        return self.head(h[None])[0]
