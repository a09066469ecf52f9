"""The strong drafter: a small LM of the target's family that rescores and grafts onto the tree.

One forward covers every node of the tree (tree mask), preceded by the committed tokens its own
cache has not seen yet (lazy sync). Tree rows never persist in its cache.
"""

from __future__ import annotations

import mlx.core as mx
import numpy as np

from ..history import History
from ..tree import DraftTree, attention_mask, build_cap, positions


class ModelDrafter:
    """Strong drafter S: rescore all nodes, reselect graft parents within the lookback window
    (root and shallow nodes included), graft top-k children without deleting anything."""

    def __init__(self, model, name: str = "draft", top_k: int = 10, depth: int = 5,
                 lookback: int = 5):
        self.model, self.name = model, name
        self.top_k, self.depth, self.lookback = top_k, depth, lookback
        self.cache = model.make_cache()
        self.calls = 0

    def observe(self, history: History, new_tokens: int) -> None:
        """Nothing to do now: the cache catches up lazily at the next call."""

    def rewind(self, length: int) -> None:
        """The history was rewritten after `length` tokens: drop what the cache holds past it."""
        self.cache.reset(min(self.cache.offset, length))

    def _forward(self, tokens: list[int], parent: list[int], history: History) -> mx.array:
        """Log-probs (float32) at every tree node, after syncing the committed prefix."""
        prefix = history.tokens[self.cache.offset:history.committed]
        ctx, m, n = self.cache.offset, len(prefix), len(tokens)
        ids = mx.array([prefix + tokens])
        logits = self.model(ids, cache=self.cache, positions=positions(parent, ctx, m),
                            mask=attention_mask(parent, ctx, m),
                            logits_rows=mx.arange(m, m + n))[0]
        self.cache.commit(m)
        self.calls += 1
        return logits.astype(mx.float32) - mx.logsumexp(logits.astype(mx.float32), -1, keepdims=True)

    def expand(self, tree: DraftTree, frontier: list[int], layer: int, history: History) -> list[int]:
        logp = self._forward(tree.token, tree.parent, history)
        parent = np.asarray(tree.parent)
        edge = mx.take_along_axis(logp[mx.array(np.maximum(parent, 0))],
                                  mx.array(tree.token)[:, None], -1)[:, 0]
        k = self.top_k
        top_ids = mx.argpartition(-logp, k - 1, axis=-1)[:, :k]
        top_lp = mx.take_along_axis(logp, top_ids, -1)
        mx.eval(edge, top_ids, top_lp)
        edge, top_ids, top_lp = np.array(edge), np.array(top_ids), np.array(top_lp)

        # Rescore: every node's score becomes S's cumulative path log-prob (float32).
        score = np.zeros(len(tree), dtype=np.float32)
        for v in range(1, len(tree)):
            score[v] = score[parent[v]] + edge[v]
        tree.score = [float(s) for s in score]

        # Reselect graft parents among all nodes within the lookback of the frontier.
        depth = np.asarray(tree.depth)
        d_max = max(tree.depth[f] for f in frontier) if frontier else layer - 1
        cand = np.flatnonzero((depth >= d_max - self.lookback) & (depth <= d_max) &
                              (depth < self.depth))
        chosen = cand[np.lexsort((cand, -score[cand]))][:k]

        # Graft: S's top-k children under each chosen parent; existing children are updated.
        cap = build_cap(self.top_k, self.depth)
        grafted: list[int] = []
        for p in chosen:
            for tok, lp in zip(top_ids[p], top_lp[p]):
                if len(tree) >= cap and tree.child(int(p), int(tok)) < 0:
                    continue
                c = tree.add(int(p), int(tok), float(score[p] + lp))
                if c not in grafted:
                    grafted.append(c)
        grafted.sort(key=lambda i: (-tree.score[i], i))
        return grafted if layer == 1 else grafted[:k]

    def draft_chain(self, root: int, k: int, history: History) -> list[int]:
        """Classic speculative decoding: k greedy tokens after the root, one forward each."""
        committed = history.committed
        prefix = history.tokens[self.cache.offset:committed] + [root]
        out: list[int] = []
        for _ in range(k):
            logits = self.model(mx.array([prefix]), cache=self.cache,
                                logits_rows=mx.array([len(prefix) - 1]))
            self.cache.commit()
            tok = int(mx.argmax(logits[0, -1]).item())
            out.append(tok)
            prefix = [tok]
        self.cache.reset(committed)
        self.calls += k
        return out
