"""The known sequence (committed tokens + the pending root) and what the target thought of it.

Drafters read from here: the tokens for n-gram matching and, per position, the target's
log-prob of the token that actually followed it (an n-gram match proposes exactly the tokens
that followed an earlier occurrence, so that is the only score it reads). A position whose
token fell outside the target's top-10 scores the 10th value minus OUTSIDE_TOP_PENALTY: what
the acceptance estimates were calibrated with, when the history kept whole top-10 rows.

The prompt's rows are kept as the target's final hidden states and scored only where a drafter
reads them (`prefetch`): a row's logits cost a pass over the whole vocabulary, and the first
token should not wait for them. A prefetch is queued on the device, never read at once: its
scores leave with the step's one readback (`pending`, `collect`), and until then those
positions read as unscored. Rows the decoding itself produced arrive scored: the step that
verified them queued their scores with its verdict (`keep`).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Callable, Optional, Sequence

import mlx.core as mx
import numpy as np

from .device import on_gpu

TOP_RANKS = 10             # a followed token outside the target's top-10 ...
OUTSIDE_TOP_PENALTY = 5.0  # ... scores the 10th value minus this
LAZY_BLOCK = 16            # deferred rows scored together on first read

Head = Callable[[mx.array], mx.array]      # final hidden states (L, H) -> logits (L, V)


def as_logits(rows: mx.array) -> mx.array:
    """The head of rows that already are logits (a pipeline target's, whose head runs remotely)."""
    return rows


class History:
    def __init__(self, tokens: list[int], capacity: int):
        self.tokens: list[int] = list(tokens)
        self.lp = np.full(capacity, np.nan, dtype=np.float32)   # NaN: not scored
        # Deferred rows by block (position // LAZY_BLOCK): (start, hidden, head) parts.
        self._deferred: dict[int, list[tuple[int, mx.array, Head]]] = {}
        self._pending: list[tuple[list[int], QueuedScores]] = []   # queued prefetches
        self._queued: set[int] = set()                         # their positions
        self._prefetched = np.zeros(2)                         # their scores' sum, count

    @property
    def committed(self) -> int:
        """Tokens in the target's cache: everything but the pending root."""
        return len(self.tokens) - 1

    @property
    def root(self) -> int:
        return self.tokens[-1]

    def record(self, start: int, logits: mx.array, following: Sequence[int]) -> None:
        """Score positions start, ... from their logits rows (L, V); `following[i]` is the
        token that followed position start + i."""
        self.keep(start, followed_logprobs(logits, np.asarray(following, dtype=np.int64)))

    def keep(self, start: int, logprobs: np.ndarray) -> None:
        """Scores of positions start, ..., already computed."""
        end = start + len(logprobs)
        if end > len(self.lp):
            grow = max(end, 2 * len(self.lp)) - len(self.lp)
            self.lp = np.concatenate([self.lp, np.full(grow, np.nan, np.float32)])
        self.lp[start:end] = logprobs

    def defer(self, start: int, hidden: mx.array, head: Head) -> None:
        """Rows start, ... as evaluated final hidden states (L, H): scored when a position of
        their block is first read (the following tokens are known by then)."""
        end = start + hidden.shape[0]
        pos = start
        while pos < end:
            stop = min(end, (pos // LAZY_BLOCK + 1) * LAZY_BLOCK)
            self._deferred.setdefault(pos // LAZY_BLOCK, []).append(
                (pos, hidden[pos - start:stop - start], head))
            pos = stop

    def inherit(self, old: "History", keep: int) -> int:
        """What `old` knew of the first `keep` positions (a reused prefix), deferred rows
        included; returns where the prefill must start. The last of them is scored against
        the token that follows it now: where that token changed and `old` already scored it,
        its row is gone, so the prefill re-runs it (keep - 1)."""
        same = keep < min(len(old.tokens), len(self.tokens)) and old.tokens[keep] == self.tokens[keep]
        scored = keep if same else keep - 1
        self.lp[:scored] = old.lp[:scored]
        deferred = False
        for block, parts in old._deferred.items():
            for start, hidden, head in parts:
                if start < keep:
                    deferred |= start + hidden.shape[0] >= keep
                    self._deferred.setdefault(block, []).append(
                        (start, hidden[:keep - start], head))
        return keep if same or deferred else keep - 1

    def scores(self, end: int) -> np.ndarray:
        """Scores of positions [0, end), deferred rows computed (NaN where never scored)."""
        for block in [b for b in self._deferred if b * LAZY_BLOCK < end]:
            self._compute(block)
        return self.lp[:end]

    def _compute(self, block: int) -> None:
        """One evaluation per head for the whole block (AR steps defer one row a step)."""
        parts = self._deferred.pop(block, [])
        for head in {id(h): h for _, _, h in parts}.values():
            mine = [(start, hidden) for start, hidden, h in parts if h is head]
            logits = head(mx.concatenate([h for _, h in mine]))
            following = np.concatenate([self.tokens[s + 1:s + 1 + h.shape[0]] for s, h in mine])
            lps = followed_logprobs(logits, following.astype(np.int64))
            at = 0
            for start, hidden in mine:
                n = hidden.shape[0]
                self.keep(start, lps[at:at + n])
                at += n

    def prefetch(self, positions: Sequence[int]) -> None:
        """Queue the scores of the deferred rows among `positions`, and only those, in one
        evaluation per head: a drafter that reads rows scattered over a long prompt would
        otherwise compute one 16-row block per position read, each a pass over the head's
        weights. Nothing is read back here (`pending`)."""
        wanted = {p for p in positions if 0 <= p < len(self.lp) and self.lp[p] != self.lp[p]
                  and p not in self._queued and p // LAZY_BLOCK in self._deferred
                  and p + 1 < len(self.tokens)}
        rows: dict[int, tuple[Head, list[int], list[mx.array]]] = {}
        for block in {p // LAZY_BLOCK for p in wanted}:
            for start, hidden, head in self._deferred[block]:
                mine = [p for p in range(start, start + hidden.shape[0]) if p in wanted]
                if mine:
                    entry = rows.setdefault(id(head), (head, [], []))
                    entry[1].extend(mine)
                    entry[2].append(hidden[mx.array(mine) - start])
        for head, where, parts in rows.values():
            following = mx.array([self.tokens[p + 1] for p in where])
            self._pending.append((where, queue_scores(head(mx.concatenate(parts)), following)))
            self._queued.update(where)

    def pending(self) -> list[mx.array]:
        """The queued prefetches' scores, for the step's readback to carry."""
        return [queued.part for _, queued in self._pending]

    def collect(self, values: Sequence[np.ndarray]) -> None:
        """The values of `pending()`, read back: those positions are scored now."""
        for (where, queued), value in zip(self._pending, values):
            scores = queued.finish(value, [self.tokens[p + 1] for p in where])
            self.lp[where] = scores
            self._prefetched += (float(np.sum(scores)), len(scores))
        self._pending, self._queued = [], set()

    def logprob(self, position: int) -> float:
        """The target's log-prob of the token that followed `position`. A prefetch still
        queued reads as the mean score of the prompt's rows read back so far: 0.0 there (a
        certain token) would make the n-gram drafts of every first read look sure, and
        sampled steps verify trees that lose to plain steps (benchmarks/RESULTS.md). A row
        never read is 0.0."""
        lp = self.lp[position]
        if lp == lp:
            return float(lp)
        total, count = self._prefetched
        return total / count if position in self._queued and count else 0.0

    def extend(self, tokens: list[int]) -> None:
        self.tokens.extend(int(t) for t in tokens)


def followed_logprobs(logits: mx.array, following: np.ndarray) -> np.ndarray:
    """Per row, the log-prob of the token that followed (History's score, top-10 rule
    included): on a GPU in MLX (only the scores leave it); on MLX's CPU backend in numpy,
    whose `exp` is vectorised (measured 2.5 against 8.8 ms for 64 rows of 8192)."""
    if on_gpu():
        x = logits.astype(mx.float32)
        return np.array(scores_of(x, mx.array(following), mx.logsumexp(x, axis=-1)))
    return host_followed_logprobs(np.array(logits.astype(mx.float32)), following)


def scores_of(x: mx.array, tokens: mx.array, lse: mx.array) -> mx.array:
    """History's score of `tokens[i]` after row i of float32 logits `x` whose logsumexp is
    `lse`, lazily on the device (the top-10 rule included): what a step queues with its
    verification, so that the score leaves the device with the step's one readback."""
    own = mx.take_along_axis(x, tokens.astype(mx.int32)[:, None], -1)[:, 0]
    inside = (x > own[:, None]).sum(-1) < TOP_RANKS
    top = min(TOP_RANKS, x.shape[-1])
    tenth = mx.topk(x, top, axis=-1).min(-1)
    return mx.where(inside, own, tenth - OUTSIDE_TOP_PENALTY) - lse


@dataclass(frozen=True)
class QueuedScores:
    """History scores of the tokens after some logits rows, queued for a step's readback:
    on a GPU the scores themselves (scores_of: a few floats leave the device); on MLX's CPU
    backend the float32 rows, scored in numpy once read (host and device are one processor
    and one memory there, and numpy's vectorised exp is far faster than MLX's CPU one)."""

    part: mx.array          # what the readback carries
    on_host: bool

    def finish(self, value: np.ndarray, tokens: Sequence[int]) -> np.ndarray:
        """The scores, from the part read back and the tokens that followed each row."""
        if not self.on_host:
            return value
        tokens = np.asarray(tokens, dtype=np.int64)
        return host_followed_logprobs(value.reshape(len(tokens), -1), tokens)


def queue_scores(logits: mx.array, tokens: Optional[mx.array] = None) -> QueuedScores:
    """Queue the scores of `tokens` (lazy, on the device) after `logits` rows (L, V)."""
    x = logits.astype(mx.float32)
    if on_gpu():
        return QueuedScores(scores_of(x, tokens, mx.logsumexp(x, axis=-1)), False)
    return QueuedScores(x, True)


def host_logsumexp(x: np.ndarray) -> np.ndarray:
    """log(sum(exp(x))) over the last axis, in numpy (MLX's CPU `exp` is scalar)."""
    m = x.max(-1)
    return m + np.log(np.exp(x - m[..., None]).sum(-1))


def host_followed_logprobs(rows: np.ndarray, following: np.ndarray) -> np.ndarray:
    """`followed_logprobs` of rows on the host: one exp pass per row; a partition only for the
    rare rows whose token fell outside the top-10."""
    x = np.asarray(rows, dtype=np.float32)
    own = x[np.arange(len(x)), following]
    out = own - host_logsumexp(x)
    outside = np.flatnonzero((x > own[:, None]).sum(-1) >= TOP_RANKS)
    if outside.size:
        tenth = np.partition(x[outside], -TOP_RANKS, axis=-1)[:, -TOP_RANKS]
        out[outside] += tenth - own[outside] - OUTSIDE_TOP_PENALTY
    return out.astype(np.float32)
