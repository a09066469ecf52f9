"""The shared draft tree as plain arrays, and the pure functions the verifier and drafters need.

Node 0 is the root (the pending bonus token, parent -1); parents always precede children, so
creation order is a valid topological order. Nodes are never deleted while a tree is built:
pruning to the verification budget returns a new, smaller tree.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import mlx.core as mx
import numpy as np

from .kernels import TreeMask

NEG_INF = float("-inf")


@dataclass
class DraftTree:
    """Token, parent, depth and cumulative score per node, plus what the n-gram drafter keeps."""

    token: list[int] = field(default_factory=list)
    parent: list[int] = field(default_factory=list)
    depth: list[int] = field(default_factory=list)
    score: list[float] = field(default_factory=list)
    match_len: list[int] = field(default_factory=list)   # longest n-gram match that proposed it
    match_pos: list[int] = field(default_factory=list)   # most recent matched position, -1 if none
    terminated: list[bool] = field(default_factory=list)  # n-gram search found too few branches
    children: dict[tuple[int, int], int] = field(default_factory=dict)  # (parent, token) -> node
    kids: dict[int, list[int]] = field(default_factory=dict)  # parent -> children, in order

    @classmethod
    def rooted_at(cls, token: int) -> "DraftTree":
        t = cls()
        t._append(token, -1, 0, 0.0, 0, -1)
        return t

    def __len__(self) -> int:
        return len(self.token)

    def _append(self, token, parent, depth, score, match_len, match_pos) -> int:
        self.token.append(int(token))
        self.parent.append(int(parent))
        self.depth.append(int(depth))
        self.score.append(float(score))
        self.match_len.append(int(match_len))
        self.match_pos.append(int(match_pos))
        self.terminated.append(False)
        return len(self.token) - 1

    def copy(self) -> "DraftTree":
        """An independent copy (to try another way of building the rest of it)."""
        return DraftTree(list(self.token), list(self.parent), list(self.depth), list(self.score),
                         list(self.match_len), list(self.match_pos), list(self.terminated),
                         dict(self.children), {p: list(c) for p, c in self.kids.items()})

    def child(self, parent: int, token: int) -> int:
        """Index of parent's child carrying `token`, or -1."""
        return self.children.get((parent, int(token)), -1)

    def add(self, parent: int, token: int, score: float, match_len: int = 0,
            match_pos: int = -1) -> int:
        """Add a child, or merge into the existing one: it keeps the max score and best match."""
        i = self.child(parent, token)
        if i >= 0:
            self.score[i] = max(self.score[i], float(score))
            if (match_len, match_pos) > (self.match_len[i], self.match_pos[i]):
                self.match_len[i], self.match_pos[i] = int(match_len), int(match_pos)
            return i
        i = self._append(token, parent, self.depth[parent] + 1, score, match_len, match_pos)
        self._link(parent, i)
        return i

    def _link(self, parent: int, child: int) -> None:
        self.children[(parent, self.token[child])] = child
        self.kids.setdefault(parent, []).append(child)

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
            t._append(self.token[old], new_index[p] if p >= 0 else -1, self.depth[old],
                      self.score[old], self.match_len[old], self.match_pos[old])
            if p >= 0:
                t._link(new_index[p], len(t) - 1)
        return t


def reselect(tree: DraftTree, top_k: int, lookback: int, max_depth: int,
             d_max: int) -> list[int]:
    """Graft parents a combine layer picks (design 4.3): the top_k nodes by score (ties: lower
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
