"""Verification: one target forward over the pruned tree, then lossless acceptance.

Greedy acceptance follows the target's argmax down the tree. Sampling acceptance treats each
node's distinct children as deterministic proposals. Recursive rejection over them (accept
child x with probability p(x) under the processed target distribution; on rejection zero p(x)
and renormalise; when all are rejected draw the bonus from the residual) accepts each child
with probability exactly p(x) and otherwise draws the bonus from p: the same as drawing one
token y ~ p and following the child that carries y, if any. That is what runs, one draw per
node on the accepted path, on the host: only the rows the walk visits leave the device. The
output is therefore distributed exactly as the target's own samples.

A sampled draft x (drawn from a drafter's distribution q, `DraftTree.proposal`) is tried
first at its parent, as in speculative sampling: accepted with probability min(1, p(x)/q(x));
on rejection the target's distribution becomes the residual max(p - q, 0), renormalised, and
the deterministic siblings follow on it as above. The token committed at that position is
then distributed exactly as p (the standard argument: min(p, q) from the draft, the rest from
the residual), and x is accepted with probability 1 - TV(p, q) instead of p(x).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Optional

import mlx.core as mx
import numpy as np

from .cache import KVCache
from .drafters import QueuedChain
from .sampling import SamplerSettings, draw, host_probs
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
    ctx, n = cache.offset, len(tree) + (len(chain) if chain is not None else 0)
    pad = max(0, rows - n)
    parent = tree.parent + chain_parents(len(tree), n - len(tree)) + [-1] * pad
    tokens = mx.array(tree.token, dtype=mx.int32)
    if chain is not None:
        tokens = mx.concatenate([tokens, chain.tokens])
    if pad:
        tokens = mx.concatenate([tokens, mx.full((pad,), tree.token[0], dtype=mx.int32)])
    block = dict(cache=cache, positions=positions(parent, ctx), mask=attention_mask(parent, ctx))
    if not hasattr(target, "run_layers"):
        return target(tokens[None], **block)[0, :n], None
    hidden = target.run_layers(target.embed(tokens[None]), **block)[0, :n]
    return target.head(hidden[None])[0], hidden


def chain_parents(first: int, k: int) -> list[int]:
    """Parents of a k-token chain from the root appended at node `first`."""
    return [0] + list(range(first, first + k - 1)) if k else []


def accept_greedy(tree: DraftTree, logits: mx.array) -> Acceptance:
    """Longest path whose drafts all equal the target's argmax; bonus = argmax after it.
    Siblings may carry the same token (a queued chain beside the tree's own drafts): each
    is followed, and the path that accepts most wins (the first such, on a tie)."""
    best = np.array(mx.argmax(logits, axis=-1)).tolist()

    def longest(node: int) -> list[int]:
        below = [longest(c) for c in tree.children_of(node) if tree.token[c] == best[node]]
        return [node] + max(below, key=len, default=[])

    path = longest(0)
    return Acceptance(path, best[path[-1]])
def accept_sample(tree: DraftTree, logits: mx.array, settings: SamplerSettings,
                  rng: np.random.Generator) -> Acceptance:
    """Draw the target's token at each node from the root down (from the residual, after a
    sampled draft there was tried and rejected); follow the child that carries it (exactly
    lossless, see the module docstring); the first draw no child carries is the bonus."""
    node, path = 0, [0]
    while True:
        p = host_probs(np.array(logits[node].astype(mx.float32)), settings)
        sampled = next((c for c in tree.children_of(node) if c in tree.proposal), -1)
        if sampled >= 0:
            q, x = tree.proposal[sampled], tree.token[sampled]
            if rng.random() * q[x] < p[x]:           # accepted with min(1, p(x) / q(x))
                node = sampled
                path.append(node)
                continue
            p = residual(p, q)
        y = draw(p, rng)
        nxt = tree.child(node, y)
        if nxt < 0:
            return Acceptance(path, y)
        node = nxt
        path.append(node)


def residual(p: np.ndarray, q: np.ndarray) -> np.ndarray:
    """What the target still owes after rejecting a draft drawn from q: max(p - q, 0),
    renormalised. It has mass wherever p > q, which a rejection implies (p(x) < q(x))."""
    r = np.maximum(p - q, 0.0)
    return r / r.sum()


def accept(tree: DraftTree, logits: mx.array, settings: SamplerSettings,
           rng: np.random.Generator) -> Acceptance:
    """The regime's rule: greedy or lossless sampled acceptance."""
    if settings.greedy:
        return accept_greedy(tree, logits)
    return accept_sample(tree, logits, settings, rng)


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
