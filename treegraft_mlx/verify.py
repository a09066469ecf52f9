"""Verification: one target forward over the pruned tree, then lossless acceptance.

Greedy acceptance follows the target's argmax down the tree. Sampling acceptance treats each
node's distinct children as deterministic proposals. Recursive rejection over them (accept
child x with probability p(x) under the processed target distribution; on rejection zero p(x)
and renormalise; when all are rejected draw the bonus from the residual) accepts each child
with probability exactly p(x) and otherwise draws the bonus from p: the same as drawing one
token y ~ p and following the child that carries y, if any. The output is therefore
distributed exactly as the target's own samples.

A sampled draft x (drawn from a drafter's distribution q, `DraftTree.drawn`) is tried first
at its parent, as in speculative sampling: accepted with probability min(1, p(x)/q(x)); on
rejection the target's distribution becomes the residual max(p - q, 0), renormalised, and
the deterministic siblings follow on it as above. The token committed at that position is
then distributed exactly as p (the standard argument: min(p, q) from the draft, the rest from
the residual), and x is accepted with probability 1 - TV(p, q) instead of p(x).

Both rules run in two halves so that a step waits on the device once: every verified row's
draw, test and scores are queued on the device with the verification (`queue_verdict`),
nothing of vocabulary size leaves it, and the host walks the tree over those few scalars
(`walk`).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Callable, Optional

import mlx.core as mx
import numpy as np

from .cache import KVCache
from .drafters import QueuedChain
from .device import on_gpu
from .parts import RequestBlock, run_alone
from .history import host_followed_logprobs, host_logsumexp, scores_of
from .sampling import SamplerSettings, draw, host_probs, processed_logits
from .tree import DraftTree, attention_mask, positions


@dataclass
class Acceptance:
    path: list[int]   # tree nodes committed this step: the root, then the accepted drafts
    bonus: int        # the target's own next token after the path: the next root


def verify(target, cache: KVCache, tree: DraftTree, rows: int = 0) -> mx.array:
    """Target logits (N, V) for every node of the tree; the tree stays pending in the cache.

    `rows` > N pads the block with inert rows (the root's token at the root's position,
    seeing only the context and itself) when a bigger block is faster on this device; their
    logits are dropped and `cache.keep` never keeps them.
    """
    return verify_hidden(target, cache, tree, rows)[0]


def verify_hidden(target, cache: KVCache, tree: DraftTree, rows: int = 0,
                  chain: Optional[QueuedChain] = None) -> tuple[mx.array, Optional[mx.array]]:
    """`verify`'s logits, and the target's last-layer hidden states (N, H) of every node
    where the target exposes them (None else: a pipeline target's stay on its last rank):
    what an MTP head drafts from. The same forward as `verify`'s. With a `chain` queued on
    the device, its k tokens follow the tree's N nodes as a branch from the root (rows
    N..N+k-1, not read back: the forward is queued on them), and the rows returned are N + k."""
    block = tree_block(cache, tree, rows, chain)
    ran = run_alone(target, block)
    n = len(block.logits_rows)
    return ran.logits, (ran.hidden[:n] if ran.hidden is not None else None)


def tree_block(cache: KVCache, tree: DraftTree, rows: int = 0,
               chain: Optional[QueuedChain] = None) -> RequestBlock:
    """The rows that verify `tree` (and a queued `chain` after it) after the cache: tokens,
    positions, the tree mask, padded to `rows` with inert rows (see `verify`); the logits
    wanted are the tree's and the chain's, never the pad's."""
    ctx, n = cache.offset, len(tree) + (len(chain) if chain is not None else 0)
    pad = max(0, rows - n)
    parent = tree.parent + chain_parents(len(tree), n - len(tree)) + [-1] * pad
    tokens = mx.array(tree.token, dtype=mx.int32)
    if chain is not None:
        tokens = mx.concatenate([tokens, chain.tokens.astype(mx.int32)])
    if pad:
        tokens = mx.concatenate([tokens, mx.full((pad,), tree.token[0], dtype=mx.int32)])
    return RequestBlock(tokens, cache, positions(parent, ctx), attention_mask(parent, ctx),
                        list(range(n)))


def chain_parents(first: int, k: int) -> list[int]:
    """Parents of a k-token chain from the root appended at node `first`."""
    return [0] + list(range(first, first + k - 1)) if k else []


# Fields of each verified row's verdict (queue_verdict), by regime.
GREEDY_FIELDS = ("token", "score")                        # the argmax and its score
SAMPLED_FIELDS = ("token", "took", "score", "took_score")  # the draw y, whether the row's
# sampled child x passed min(1, p/q), the score of y, the score of x


@dataclass(frozen=True)
class SampledDrafts:
    """Drafts drawn from a drafter's distribution q, at most one below each row: the rows
    they hang from, their tokens and each one's q, on the device (nothing read back)."""

    rows: list[int]
    tokens: mx.array      # (m,) int32
    q: mx.array           # (m, V)

    @classmethod
    def of_chain(cls, chain: Optional[QueuedChain], n_tree: int) -> Optional["SampledDrafts"]:
        """A sampled chain's drafts, verified after `n_tree` tree rows: the first hangs from
        the root, each next one from the chain's row before it."""
        if chain is None or chain.drawn_from is None:
            return None
        return cls([0] + list(range(n_tree, n_tree + len(chain) - 1)), chain.tokens,
                   chain.drawn_from)


@dataclass(frozen=True)
class Verdict:
    """A step's verdict, queued: the arrays its readback carries, and how the host turns
    them into the (R, F) table of the regime's fields that the walk reads."""

    parts: tuple[mx.array, ...]
    finish: Callable[[list[np.ndarray]], np.ndarray]


def queue_verdict(logits: mx.array, settings: SamplerSettings, seed: Optional[int],
                  drafts: Optional[SampledDrafts] = None, scores: bool = True) -> Verdict:
    """Everything acceptance needs of the verified rows (R of them), queued with the
    verification: a few scalars a row. Greedy: each row's argmax and the history's score of
    it. Sampled: each row's draw y from the processed distribution p (from the residual
    max(p - q, 0) at a row whose sampled draft x ~ q failed its test), whether x passed
    (u q(x) < p(x)), and the scores of y and x. Every row draws, visited or not: draws at
    different rows are independent, so the walk (walk_sampled) commits exactly what drawing
    node by node would. `seed` seeds the draws (None when greedy); `scores` False leaves the
    scores 0 (nobody reads them).

    Where it runs: on a GPU, on the device (device_table), so nothing of vocabulary size
    leaves it; on MLX's CPU backend, in numpy on the rows read back (host_table): host and
    device are one processor and one memory there, and numpy's vectorised exp and partition
    are an order of magnitude faster than MLX's CPU kernels. Either way the step reads back
    once."""
    rows = logits.shape[0]
    if on_gpu():
        table = device_table(logits, settings, seed, drafts, scores)
        return Verdict((table,), lambda values: values[0].reshape(rows, -1))
    parts = [logits.astype(mx.float32)]
    if drafts is not None and not settings.greedy:
        parts += [drafts.q.astype(mx.float32), drafts.tokens]
    return Verdict(tuple(parts), lambda values: host_table(
        values, rows, settings, seed, drafts.rows if len(parts) > 1 else [], scores))


def device_table(logits: mx.array, settings: SamplerSettings, seed: Optional[int],
                 drafts: Optional[SampledDrafts], scores: bool) -> mx.array:
    """queue_verdict's table, lazily on the device: (R, F) float32."""
    x = logits.astype(mx.float32)
    lse = mx.logsumexp(x, axis=-1) if scores else None
    if settings.greedy:
        best = mx.argmax(x, axis=-1)
        score = mx.max(x, axis=-1) - lse if scores else mx.zeros(best.shape)
        return mx.stack([best.astype(mx.float32), score], axis=1)
    p = mx.softmax(processed_logits(x, settings), axis=-1)
    key_u, key_y = mx.random.split(mx.random.key(seed))
    dist, took, child = p, mx.zeros(p.shape[0]), mx.zeros(p.shape[0], dtype=mx.int32)
    if drafts is not None:
        which = np.full(p.shape[0], -1)       # each row's sampled draft (-1: none)
        which[drafts.rows] = np.arange(len(drafts.rows))
        has, at = mx.array(which >= 0), mx.array(np.maximum(which, 0))
        q, xs = drafts.q.astype(mx.float32)[at], drafts.tokens.astype(mx.int32)[at]
        px = mx.take_along_axis(p, xs[:, None], -1)[:, 0]
        qx = mx.take_along_axis(q, xs[:, None], -1)[:, 0]
        passed = has & (mx.random.uniform(shape=px.shape, key=key_u) * qx < px)
        dist = mx.where((has & ~passed)[:, None], residual(p, q), p)
        took, child = passed.astype(mx.float32), xs
    y = mx.random.categorical(mx.log(dist), key=key_y)
    zero = mx.zeros(y.shape)
    return mx.stack([y.astype(mx.float32), took,
                     scores_of(x, y, lse) if scores else zero,
                     scores_of(x, child, lse) if scores else zero], axis=1)


def host_table(values: list[np.ndarray], rows: int, settings: SamplerSettings,
               seed: Optional[int], drafted: list[int], scores: bool):
    """queue_verdict's table in numpy, from the rows read back (then q and the sampled
    drafts' tokens, where `drafted` names their rows). Greedy: every row at once, (R, 2).
    Sampled: each row computed when the walk first reads it (HostRows), since the filters
    cost a pass over the vocabulary a row and the walk visits a few."""
    x = values[0].reshape(rows, -1)
    if settings.greedy:
        best = x.argmax(axis=-1)
        score = x.max(axis=-1) - host_logsumexp(x) if scores else np.zeros(rows)
        return np.stack([best, score], axis=1)
    q = values[1].reshape(len(drafted), -1) if drafted else None
    tokens = values[2].astype(np.int64) if drafted else None
    which = {r: i for i, r in enumerate(drafted)}

    def row(r: int) -> np.ndarray:
        """Row r's fields; its draws come from its own generator (seed, r), so they do not
        depend on the order the walk reads rows in."""
        rng, dist = np.random.default_rng([seed, r]), host_probs(x[r], settings)
        took, child = 0.0, 0
        if r in which:
            qr, child = q[which[r]].astype(np.float64), int(tokens[which[r]])
            took = float(rng.random() * qr[child] < dist[child])
            dist = dist if took else residual(dist, qr)
        y = draw(dist, rng)
        if not scores:
            return np.array([y, took, 0.0, 0.0])
        own = host_followed_logprobs(x[r:r + 1].repeat(2, 0), np.array([y, child]))
        return np.array([y, took, own[0], own[1]])

    return HostRows(row, rows)


class HostRows:
    """A sampled verdict's table whose rows are computed on first read: indexed and copied
    as the (R, 4) array it stands for."""

    def __init__(self, row: Callable[[int], np.ndarray], rows: int):
        self._row, self._rows = row, [None] * rows

    def _get(self, r: int) -> np.ndarray:
        if self._rows[r] is None:
            self._rows[r] = self._row(r)
        return self._rows[r]

    def __len__(self) -> int:
        return len(self._rows)

    def __getitem__(self, at: tuple[int, int]) -> float:
        return self._get(at[0])[at[1]]

    def __setitem__(self, at: tuple[int, int], value: float) -> None:
        self._get(at[0])[at[1]] = value

    def copy(self) -> "HostRows":
        out = HostRows(self._row, len(self))
        out._rows = [None if r is None else r.copy() for r in self._rows]
        return out


def residual(p, q):
    """What the target still owes after rejecting a draft drawn from q: max(p - q, 0),
    renormalised, per row (numpy or MLX arrays alike). It has mass wherever p > q, which a
    rejection implies (p(x) < q(x)); rows whose draft passed are not read."""
    lib = np if isinstance(p, np.ndarray) else mx
    r = lib.maximum(p - q, 0.0)
    return r / lib.maximum(r.sum(axis=-1, keepdims=True), 1e-30)


@dataclass
class Walked:
    """What acceptance committed, and the history's score of each committed token."""

    acceptance: Acceptance
    scores: list[float]   # the score of each token after a path node: drafts, then bonus


def walk_greedy(tree: DraftTree, verdict: np.ndarray) -> Walked:
    """Longest path whose drafts all equal the target's argmax; bonus = argmax after it.
    Siblings may carry the same token (a queued chain beside the tree's own drafts): each
    is followed, and the path that accepts most wins (the first such, on a tie)."""
    best = verdict[:, 0].astype(np.int64).tolist()

    def longest(node: int) -> list[int]:
        below = [longest(c) for c in tree.children_of(node) if tree.token[c] == best[node]]
        return [node] + max(below, key=len, default=[])

    path = longest(0)
    return Walked(Acceptance(path, best[path[-1]]), verdict[path, 1].tolist())


def walk_sampled(tree: DraftTree, verdict: np.ndarray) -> Walked:
    """From the root down: a node whose sampled child passed its test goes to it; else the
    row's draw y (from the residual where that child failed) picks the child carrying it,
    and the first y that no child carries is the bonus (exactly lossless, see the module
    docstring)."""
    node, path, scores = 0, [0], []
    while True:
        if any(c in tree.drawn for c in tree.children_of(node)) and verdict[node, 1]:
            node = next(c for c in tree.children_of(node) if c in tree.drawn)
            scores.append(float(verdict[path[-1], 3]))
            path.append(node)
            continue
        y = int(verdict[node, 0])
        scores.append(float(verdict[node, 2]))
        nxt = tree.child(node, y)
        if nxt < 0:
            return Walked(Acceptance(path, y), scores)
        node = nxt
        path.append(node)


def walk(tree: DraftTree, verdict: np.ndarray, settings: SamplerSettings) -> Walked:
    """The regime's rule over a verdict read back (queue_verdict)."""
    if settings.greedy:
        return walk_greedy(tree, verdict)
    return walk_sampled(tree, verdict)


def accept(tree: DraftTree, logits: mx.array, settings: SamplerSettings,
           rng: np.random.Generator, drafts: Optional[SampledDrafts] = None) -> Acceptance:
    """Acceptance of verified `logits` in one readback (tests, calibration): the verdict
    seeded from `rng`, then the walk. `drafts`: the sampled drafts among `tree`'s nodes
    (marked in `tree.drawn`)."""
    seed = None if settings.greedy else int(rng.integers(2**31))
    verdict = queue_verdict(logits, settings, seed, drafts, scores=False)
    table = verdict.finish([np.array(p) for p in verdict.parts])
    return walk(tree, table, settings).acceptance


def accept_greedy(tree: DraftTree, logits: mx.array) -> Acceptance:
    return accept(tree, logits, SamplerSettings(), np.random.default_rng(0))


def accept_sample(tree: DraftTree, logits: mx.array, settings: SamplerSettings,
                  rng: np.random.Generator, drafts: Optional[SampledDrafts] = None
                  ) -> Acceptance:
    return accept(tree, logits, settings, rng, drafts)


def expected_path_length(tree: DraftTree, probs: np.ndarray) -> float:
    """Expected len(path) (root + accepted drafts) of the acceptance rules above, given the
    processed target distribution per node (N, V): a child is accepted exactly when the
    target's draw at its parent is its token, i.e. with probability p_parent(token), whatever
    the order the siblings are tried in. Greedy (one-hot rows) gives the greedy path length.
    E(u) = sum over u's children c of p_u(token_c) * (1 + E(c)); nodes are visited deepest
    first (children always follow their parents)."""
    below = np.zeros(len(tree))
    for u in range(len(tree) - 1, -1, -1):
        below[u] = sum(probs[u, tree.token[c]] * (1.0 + below[c]) for c in tree.children_of(u))
    return 1.0 + float(below[0])
