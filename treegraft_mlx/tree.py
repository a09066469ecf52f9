"""The shared draft tree as plain arrays, and the pure functions the verifier and drafters need.

Node 0 is the root (the pending bonus token, parent -1); parents always precede children, so
creation order is a valid topological order. Nodes are never deleted while a tree is built:
pruning to the verification budget returns a new, smaller tree.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from typing import NamedTuple, Optional, Sequence

import mlx.core as mx
import numpy as np


NEG_INF = float("-inf")


NAN = float("nan")


# Which drafters proposed a node (DraftTree.drafted_by, a bit per drafter), and what a
# committed draft is called by the drafters that proposed it (Decoder.sources).
NGRAM, STRONG = 1, 2
SOURCES = {NGRAM: "ngram", STRONG: "draft", NGRAM | STRONG: "both"}


@dataclass(frozen=True, eq=False)
class TreeMask:
    """Row i of a block sees [0, context) and the block columns whose bit is set in bits[i]:
    the compact form a tree's mask travels in (the kernels read the bits directly)."""

    context: int
    bits: np.ndarray  # (rows, words) uint32, little-endian bit order within each word

    @classmethod
    def from_bool(cls, block: np.ndarray, context: int) -> "TreeMask":
        """From a (rows, rows) boolean block mask."""
        rows = block.shape[0]
        words = max(1, -(-rows // 32))
        padded = np.zeros((rows, words * 32), dtype=bool)
        padded[:, :rows] = block
        packed = np.packbits(padded, axis=1, bitorder="little")
        return cls(context, np.ascontiguousarray(packed).view(np.uint32).reshape(rows, words))

    @property
    def rows(self) -> int:
        return self.bits.shape[0]

    def block(self) -> np.ndarray:
        """The (rows, rows) boolean block mask these bits encode."""
        unpacked = np.unpackbits(self.bits.view(np.uint8), axis=1, bitorder="little")
        return unpacked[:, :self.rows].astype(bool)

    def dense(self) -> np.ndarray:
        """(rows, context + rows) boolean: every committed position, then the block."""
        m = np.ones((self.rows, self.context + self.rows), dtype=bool)
        m[:, self.context:] = self.block()
        return m


@dataclass
class DraftTree:
    """Token, parent, depth and cumulative score per node, plus the drafters' evidence.

    The evidence is what the per-step size choice estimates acceptance from (acceptance.py):
    the n-gram drafter's match length, votes (continuations through the node) and the target's
    recorded log-prob of the token where the match was seen; the strong drafter's log-prob of
    the token at its parent and its rank there, once it has run on the parent (NaN before).
    `drafted_by` says which drafters proposed each node (NGRAM, STRONG bits; 0: the root),
    so that every committed token can be shown with where it came from."""

    token: list[int] = field(default_factory=list)
    parent: list[int] = field(default_factory=list)
    depth: list[int] = field(default_factory=list)
    score: list[float] = field(default_factory=list)
    match_len: list[int] = field(default_factory=list)   # longest n-gram match that proposed it
    match_pos: list[int] = field(default_factory=list)   # most recent matched position, -1 if none
    terminated: list[bool] = field(default_factory=list)  # n-gram search found too few branches
    ngram_lp: list[float] = field(default_factory=list)   # target's recorded log-prob at the match
    votes: list[int] = field(default_factory=list)        # n-gram continuations through the node
    draft_lp: list[float] = field(default_factory=list)   # strong drafter's log-prob (NaN: not run)
    draft_rank: list[int] = field(default_factory=list)   # its rank among the drafter's top-k
    drafted_by: list[int] = field(default_factory=list)   # NGRAM | STRONG bits
    children: dict[tuple[int, int], int] = field(default_factory=dict)  # (parent, token) -> node
    kids: dict[int, list[int]] = field(default_factory=dict)  # parent -> children, in order
    # Sampled drafts: nodes whose token a drafter drew from its distribution q at the parent
    # (a queued chain's, when sampling); the target accepts one with min(1, p/q), tested on
    # the device against the chain's q (verify.queue_verdict).
    drawn: set[int] = field(default_factory=set)

    NODE_FIELDS = ("token", "parent", "depth", "score", "match_len", "match_pos", "terminated",
                   "ngram_lp", "votes", "draft_lp", "draft_rank", "drafted_by")

    @classmethod
    def rooted_at(cls, token: int) -> "DraftTree":
        t = cls()
        t._append(token, -1, 0, 0.0)
        return t

    def __len__(self) -> int:
        return len(self.token)

    def _append(self, token: int, parent: int, depth: int, score: float, match_len: int = 0,
                match_pos: int = -1, ngram_lp: float = NAN, votes: int = 0,
                draft_lp: float = NAN, draft_rank: int = -1, drafted_by: int = 0) -> int:
        self.token.append(int(token))
        self.parent.append(int(parent))
        self.depth.append(int(depth))
        self.score.append(float(score))
        self.match_len.append(int(match_len))
        self.match_pos.append(int(match_pos))
        self.terminated.append(False)
        self.ngram_lp.append(float(ngram_lp))
        self.votes.append(int(votes))
        self.draft_lp.append(float(draft_lp))
        self.draft_rank.append(int(draft_rank))
        self.drafted_by.append(int(drafted_by))
        return len(self.token) - 1

    def copy(self) -> "DraftTree":
        """An independent copy (to try another way of building the rest of it)."""
        return DraftTree(*(list(getattr(self, f)) for f in self.NODE_FIELDS),
                         dict(self.children), {p: list(c) for p, c in self.kids.items()},
                         set(self.drawn))

    def child(self, parent: int, token: int) -> int:
        """Index of parent's child carrying `token`, or -1."""
        return self.children.get((parent, int(token)), -1)

    def add(self, parent: int, token: int, score: float, match_len: int = 0,
            match_pos: int = -1, ngram_lp: Optional[float] = None, by: int = 0) -> int:
        """Add a child, or merge into the existing one: it keeps the max score and best match,
        and `drafted_by` gains `by` (the proposing drafter's bit).
        `ngram_lp` (given by the n-gram drafter) counts one vote and keeps the best log-prob."""
        i = self.child(parent, token)
        if i < 0:
            i = self._append(token, parent, self.depth[parent] + 1, score, match_len, match_pos,
                             drafted_by=by)
            self._link(parent, i)
        else:
            self.drafted_by[i] |= by
            self.score[i] = max(self.score[i], float(score))
            if (match_len, match_pos) > (self.match_len[i], self.match_pos[i]):
                self.match_len[i], self.match_pos[i] = int(match_len), int(match_pos)
        if ngram_lp is not None:
            self.votes[i] += 1
            old = self.ngram_lp[i]
            self.ngram_lp[i] = float(ngram_lp) if math.isnan(old) else max(old, float(ngram_lp))
        return i

    def _link(self, parent: int, child: int) -> None:
        """Link a child; `child` finds the first of siblings that carry the same token."""
        self.children.setdefault((parent, self.token[child]), child)
        self.kids.setdefault(parent, []).append(child)

    def append_chain(self, tokens: Sequence[int], by: int, drawn: bool = False) -> list[int]:
        """Hang a chain from the root as new nodes, one below the other, even where a sibling
        already carries the same token: the chain was verified on the device before its
        tokens were read back (a queued chain, docs/design.md §9), so its rows are its own.
        A twin sibling and the chain node each gain the other's drafter bit (both proposed
        that token there). `drawn`: the tokens were drawn from the drafter's distribution (sampled
        drafts). Returns the chain's nodes."""
        nodes, parent = [], 0
        for i, tok in enumerate(tokens):
            twin = self.child(parent, tok)
            both = by | (self.drafted_by[twin] if twin >= 0 else 0)
            node = self._append(tok, parent, self.depth[parent] + 1, 0.0, drafted_by=both)
            if twin >= 0:
                self.drafted_by[twin] |= by
            self._link(parent, node)
            if drawn:
                self.drawn.add(node)
            nodes.append(node)
            parent = node
        return nodes

    def children_of(self, node: int) -> list[int]:
        return self.kids.get(node, [])

    def path_tokens(self, node: int) -> list[int]:
        """Tokens from the root down to `node`, inclusive."""
        return [self.token[i] for i in path_to(self.parent, node)]

    def subtree(self, keep: np.ndarray) -> "DraftTree":
        """A new tree of the kept nodes (ancestor-closed, ascending), reindexed."""
        new_index = {int(old): new for new, old in enumerate(keep)}
        t = DraftTree()
        for old in keep:
            old = int(old)
            p = self.parent[old]
            values = [getattr(self, f)[old] for f in self.NODE_FIELDS]
            values[1] = new_index.get(p, -1)
            for f, v in zip(self.NODE_FIELDS, values):
                getattr(t, f).append(v)
            if values[1] >= 0:
                t._link(values[1], len(t) - 1)
        t.drawn = {new_index[v] for v in self.drawn if v in new_index}
        return t

    def rerooted(self, node: int) -> "DraftTree":
        """The subtree below `node` (inclusive) as a tree of its own, `node` its root: what is
        left to verify once the target has committed the path to `node`."""
        inside = np.zeros(len(self), dtype=bool)
        inside[node] = True
        for v in range(node + 1, len(self)):
            inside[v] = self.parent[v] >= 0 and inside[self.parent[v]]
        t = self.subtree(np.flatnonzero(inside))
        base = t.depth[0]
        t.depth = [d - base for d in t.depth]
        return t


class Reach(NamedTuple):
    """How deep a step's drafts matched what it committed (CallPolicy learns from it)."""

    ngram: int          # the n-gram drafts' deepest matching path
    chain: int          # the chain's matching prefix
    seen: int           # the chain's depths the committed tokens show


def reach(tree: DraftTree, chain_from: int, block: Sequence[int]) -> Reach:
    """How far the drafts of a verified `tree` matched `block`, the tokens committed after
    its root: the n-gram drafts (nodes before `chain_from`) and the chain hung from the root
    (the nodes from `chain_from` on, one below the other). A draft matches where it is the
    token the target committed there, accepted or not (a greedy target's tokens are those a
    chain would have had to match; sampled, a chain token is accepted only if it matches)."""
    node, ngram = 0, 0
    while ngram < len(block):
        kids = [c for c in tree.children_of(node)
                if c < chain_from and tree.token[c] == block[ngram]]
        if not kids:
            break
        node, ngram = kids[0], ngram + 1
    chain = [int(t) for t in tree.token[chain_from:]]
    seen = min(len(chain), len(block))
    matched = next((i for i in range(seen) if chain[i] != block[i]), seen)
    return Reach(ngram, matched, seen)


def graft_chain(tree: DraftTree, tokens: Sequence[int], logps: Sequence[float],
                cap: int) -> list[int]:
    """Graft the strong drafter's chain (its greedy tokens after the root, with its log-prob
    of each) into `tree` from the root down. A token some drafter already proposed there is
    the same node and gains S's evidence; new nodes are added while the tree has room (`cap`
    nodes). Returns the chain's nodes, root first."""
    path, score = [0], tree.score[0]
    for tok, lp in zip(tokens, logps):
        if len(tree) >= cap and tree.child(path[-1], int(tok)) < 0:
            break
        score += float(lp)
        node = tree.add(path[-1], int(tok), score, by=STRONG)
        tree.draft_lp[node], tree.draft_rank[node] = float(lp), 0
        path.append(node)
    return path


def reselect(tree: DraftTree, top_k: int, lookback: int, max_depth: int,
             d_max: int) -> list[int]:
    """Graft parents a combine layer picks (docs/design.md §4.3): the top_k nodes by score (ties: lower
    index) among all nodes within `lookback` of the deepest frontier depth `d_max` that may
    still get children. Plain Python: trees here are small and this runs before every layer."""
    depth = tree.depth
    lo, hi = d_max - lookback, min(d_max, max_depth - 1)
    cand = [i for i, d in enumerate(depth) if lo <= d <= hi]
    # A stable sort on score alone keeps ties in index order.
    return sorted(cand, key=tree.score.__getitem__, reverse=True)[:top_k]


def build_cap(top_k: int, depth: int) -> int:
    """Most nodes a tree may reach while being built: 1 + k + depth * k^2."""
    return 1 + top_k + depth * top_k * top_k


def prune(tree: DraftTree, budget: int) -> np.ndarray:
    """Node indices (ascending, root included) of the best ancestor-closed tree within budget.

    Non-root nodes are ranked by (score desc, depth asc, index asc); each is added together
    with its missing ancestors if the whole chain still fits. Scores need not decrease along
    paths, hence the closure.
    """
    n = len(tree)
    if n <= budget:
        return np.arange(n)
    score = np.asarray(tree.score[1:])
    order = np.lexsort((np.arange(1, n), np.asarray(tree.depth[1:]), -score)) + 1
    kept = np.zeros(n, dtype=bool)
    kept[0] = True
    count = 1
    for v in order:
        if count >= budget:
            break
        if kept[v]:
            continue
        chain = []
        u = int(v)
        while not kept[u]:
            chain.append(u)
            u = tree.parent[u]
        if count + len(chain) <= budget:
            kept[chain] = True
            count += len(chain)
    return np.flatnonzero(kept)


def path_probability(parent, accept: np.ndarray) -> np.ndarray:
    """P(v) = product of the acceptance estimates a(u) on the path root..v (P(root) = 1): the
    probability that v is committed, given a(u) = P(u accepted | its parent accepted)."""
    prob = np.array(accept, dtype=np.float64)
    prob[0] = 1.0
    for v in range(1, len(prob)):
        prob[v] *= prob[parent[v]]
    return prob


@dataclass(frozen=True)
class Plan:
    """What a step verifies: node indices (ascending, root first) and the tokens it expects to
    commit (E(S) = 1 + the path probabilities of the drafts in S)."""

    keep: np.ndarray
    expected: float
    step_ms: float


def plan_verification(tree: DraftTree, accept: np.ndarray, step_ms: np.ndarray,
                      rate: float) -> Plan:
    """The ancestor-closed set S that maximises E(S) - rate * step_ms[|S| - 1] (docs/design.md §7.3).

    Adding nodes best-first by path probability (ties: shallower, then earlier) gives the best
    set of every size, and each prefix is ancestor-closed since a child is never more probable
    than its parent. `rate` is the long-run tokens per ms: maximising E - rate * time per step
    maximises the long-run rate (a step that expects little is not made to look good by its
    own ratio). S = {root} (an AR step) is always a candidate."""
    prob = path_probability(tree.parent, accept)
    order = np.lexsort((np.arange(len(tree)), np.asarray(tree.depth), -prob))[:len(step_ms)]
    expected = np.cumsum(prob[order])
    ms = np.asarray(step_ms[:len(order)], dtype=np.float64)
    n = 1 + int(np.argmax(expected - rate * ms))
    return Plan(np.sort(order[:n]), float(expected[n - 1]), float(ms[n - 1]))


def ancestor_mask(parent) -> np.ndarray:
    """(N, N) boolean: row i is True at i's ancestors and at i itself."""
    parent = np.asarray(parent)
    n = len(parent)
    m = np.zeros((n, n), dtype=bool)
    for i in range(n):
        if parent[i] >= 0:
            if parent[i] >= i:
                raise ValueError(f"node {i} has parent {parent[i]}: parents must precede children")
            m[i] = m[parent[i]]
        m[i, i] = True
    return m


def depths(parent) -> np.ndarray:
    """Depth of every node (root = 0)."""
    return ancestor_mask(parent).sum(1) - 1


def attention_mask(parent, context: int, prefix: int = 0) -> TreeMask:
    """Compact mask for a block of [prefix committed tokens, then tree nodes] after `context`.

    The prefix rows are causal among themselves; each tree row sees all committed tokens and
    its own ancestry.
    """
    n = len(parent)
    rows = prefix + n
    block = np.zeros((rows, rows), dtype=bool)
    block[:prefix, :prefix] = np.tril(np.ones((prefix, prefix), dtype=bool))
    block[prefix:, :prefix] = True
    block[prefix:, prefix:] = ancestor_mask(parent)
    return TreeMask.from_bool(block, context)


def positions(parent, context: int, prefix: int = 0) -> mx.array:
    """Positions of [prefix tokens, tree nodes]: contiguous, then committed length + depth."""
    base = np.arange(context, context + prefix)
    return mx.array(np.concatenate([base, context + prefix + depths(parent)]).astype(np.int32))


def path_to(parent, node: int) -> list[int]:
    """Node indices from the root down to `node`, inclusive."""
    path = []
    while node != -1:
        path.append(int(node))
        node = int(parent[node])
    return path[::-1]
