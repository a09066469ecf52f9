"""The known sequence (committed tokens + the pending root) and the target's view of it.

Drafters read from here: the tokens for n-gram matching and the target's top-10 log-probs
per position, kept from prefill and from every verification, so that matches anywhere in the
prompt or the generated text carry real scores. A prompt's rows are kept as the target's final
hidden states and turned into top log-probs only where a drafter first reads them: a row's
logits cost a pass over the whole vocabulary, and the first token should not wait for them.
"""

from __future__ import annotations

from typing import Callable

import mlx.core as mx
import numpy as np

from .device import on_gpu

TOP_LOGPROBS = 10
OUTSIDE_TOP_PENALTY = 5.0  # a token outside the top-10 scores the 10th value minus this
LAZY_BLOCK = 64            # deferred prompt rows computed together on first read

Head = Callable[[mx.array], mx.array]      # final hidden states (L, H) -> logits (L, V)


class History:
    def __init__(self, tokens: list[int], capacity: int):
        self.tokens: list[int] = list(tokens)
        self.top_ids = np.full((capacity, TOP_LOGPROBS), -1, dtype=np.int64)
        self.top_lp = np.full((capacity, TOP_LOGPROBS), -np.inf, dtype=np.float32)
        # position -> ({token: log-prob}, score of any other token): the n-gram drafter asks
        # thousands of times per generation; a dict lookup beats a numpy search per call.
        self._rows: dict[int, tuple[dict[int, float], float]] = {}
        # Deferred prompt rows by block (position // LAZY_BLOCK): (start, hidden, head) parts.
        self._deferred: dict[int, list[tuple[int, mx.array, Head]]] = {}

    @property
    def committed(self) -> int:
        """Tokens in the target's cache: everything but the pending root."""
        return len(self.tokens) - 1

    @property
    def root(self) -> int:
        return self.tokens[-1]

    def record(self, start: int, ids: np.ndarray, logprobs: np.ndarray) -> None:
        """Keep top-10 (ids, log-probs) rows, from `top_logprobs`, for positions start, ..."""
        k = TOP_LOGPROBS
        order = np.argsort(-logprobs, axis=-1, kind="stable")
        end = start + len(ids)
        if end > len(self.top_ids):
            grow = max(end, 2 * len(self.top_ids)) - len(self.top_ids)
            self.top_ids = np.concatenate([self.top_ids, np.full((grow, k), -1, np.int64)])
            self.top_lp = np.concatenate([self.top_lp, np.full((grow, k), -np.inf, np.float32)])
        self.top_ids[start:end] = np.take_along_axis(ids, order, -1)
        self.top_lp[start:end] = np.take_along_axis(logprobs, order, -1)
        for p in range(start, end):
            self._rows.pop(p, None)

    def defer(self, start: int, hidden: mx.array, head: Head) -> None:
        """Rows start, ... as evaluated final hidden states (L, H): their top log-probs are
        computed when a position of their block is first read."""
        end = start + hidden.shape[0]
        pos = start
        while pos < end:
            stop = min(end, (pos // LAZY_BLOCK + 1) * LAZY_BLOCK)
            self._deferred.setdefault(pos // LAZY_BLOCK, []).append(
                (pos, hidden[pos - start:stop - start], head))
            pos = stop

    def inherit(self, old: "History", keep: int) -> None:
        """The target's view of the first `keep` positions from `old` (a reused prefix),
        deferred rows included."""
        self.top_ids[:keep], self.top_lp[:keep] = old.top_ids[:keep], old.top_lp[:keep]
        for block, parts in old._deferred.items():
            for start, hidden, head in parts:
                if start < keep:
                    self._deferred.setdefault(block, []).append(
                        (start, hidden[:keep - start], head))

    def top(self, end: int) -> tuple[np.ndarray, np.ndarray]:
        """Top-10 ids and log-probs of positions [0, end), deferred rows computed."""
        for block in [b for b in self._deferred if b * LAZY_BLOCK < end]:
            self._compute(block)
        return self.top_ids[:end], self.top_lp[:end]

    def _compute(self, block: int) -> None:
        """One evaluation per head for the whole block (AR stretches defer one row a step)."""
        parts = self._deferred.pop(block, [])
        for head in {id(h): h for _, _, h in parts}.values():
            mine = [(start, hidden) for start, hidden, h in parts if h is head]
            ids, lps = top_logprobs(head(mx.concatenate([h for _, h in mine])))
            at = 0
            for start, hidden in mine:
                n = hidden.shape[0]
                self.record(start, ids[at:at + n], lps[at:at + n])
                at += n

    def logprob(self, position: int, token: int) -> float:
        """Target log-prob of `token` following `position` (0.0 where nothing was recorded)."""
        row = self._rows.get(position)
        if row is None:
            if self._deferred:
                self._compute(position // LAZY_BLOCK)
            ids = self.top_ids[position]
            if ids[0] < 0:
                return 0.0
            lp = self.top_lp[position].tolist()
            row = self._rows[position] = (dict(zip(ids.tolist(), lp)), lp[-1] - OUTSIDE_TOP_PENALTY)
        return row[0].get(token, row[1])

    def extend(self, tokens: list[int]) -> None:
        self.tokens.extend(int(t) for t in tokens)


def top_logprobs(logits: mx.array, k: int = TOP_LOGPROBS) -> tuple[np.ndarray, np.ndarray]:
    """Top-k token ids and their log-probs per row: on a GPU in MLX (only k values leave it);
    on MLX's CPU backend in numpy, whose `exp` is vectorised (measured 13 against 23 ms for
    64 rows of 8192)."""
    if not on_gpu():
        return host_top_logprobs(np.array(logits.astype(mx.float32)), k)
    x = logits.astype(mx.float32)
    lp = x - mx.logsumexp(x, axis=-1, keepdims=True)
    ids = mx.argpartition(-lp, k - 1, axis=-1)[..., :k]
    return np.array(ids), np.array(mx.take_along_axis(lp, ids, -1))


def host_logsumexp(x: np.ndarray) -> np.ndarray:
    """log(sum(exp(x))) over the last axis, in numpy (MLX's CPU `exp` is scalar)."""
    m = x.max(-1)
    return m + np.log(np.exp(x - m[..., None]).sum(-1))


def host_top_logprobs(rows: np.ndarray, k: int = TOP_LOGPROBS) -> tuple[np.ndarray, np.ndarray]:
    """`top_logprobs` of a few rows already on the host (an accepted path): a partition and one
    exp pass per row in numpy, instead of another device evaluation."""
    x = np.asarray(rows, dtype=np.float32)
    lse = host_logsumexp(x)[..., None]
    ids = np.argpartition(-x, k - 1, axis=-1)[..., :k]
    return ids, np.take_along_axis(x, ids, -1) - lse
