"""The reference for History's scores: a plain forward over the tokens, scored token by token."""

from __future__ import annotations

import mlx.core as mx
import numpy as np


def reference_scores(target, tokens: list[int], n: int) -> np.ndarray:
    """Scores of positions [0, n): the log-softmax of a plain forward's row at the token that
    followed, or the row's 10th value minus 5 where that token ranks below the 10th."""
    logits = np.array(target(mx.array([tokens[:n]]))[0].astype(mx.float32), dtype=np.float64)
    out = np.empty(n)
    for p, row in enumerate(logits):
        lp = row - row.max() - np.log(np.exp(row - row.max()).sum())
        order = np.argsort(-lp, kind="stable")
        rank = int(np.flatnonzero(order == tokens[p + 1])[0])
        out[p] = lp[tokens[p + 1]] if rank < 10 else lp[order[9]] - 5.0
    return out
