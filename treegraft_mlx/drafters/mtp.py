"""The target's own MTP head as a drafter: a chain from the root, drafted from the target's
hidden states at the committed positions (models/mtp.py, docs/design.md §19).

The head's KV cache holds one row per committed position p: the target's hidden state at p
paired with the token at p + 1. Every target forward that commits positions hands their
hidden states over (`feed`: the prefill, AR steps, the accepted path of a tree step); a chain
first runs, in one forward, the rows its cache lacks up to the root (the last pairs the
position before the root with the root), whose last row gives the first draft. Deeper drafts
chain on the head's own output in place of the target's hidden state; their rows are cut
from the cache after the chain, as is the root's row, whose pairing the next chain re-runs.
"""

from __future__ import annotations

from typing import Optional

import mlx.core as mx

from ..history import History
from ..tree import build_cap
from .base import ChainTokens, Draw, QueuedChain


class MtpDrafter:
    """Chains drafts with the target's MTP head (`target.mtp`), the target's embedding and
    lm_head. Its cache rows are positions base, base + 1, ...: a gap in what it was fed (a
    commit whose hidden states nobody handed over) restarts it at the position after."""

    name = "mtp"

    def __init__(self, target, top_k: int = 10, depth: int = 5):
        self.target, self.top_k = target, top_k
        a = target.args
        self.cache = target.mtp.make_cache(a.num_key_value_heads, a.head_dim,
                                           a.max_position_embeddings + build_cap(top_k, depth),
                                           target.model.norm.weight.dtype)
        self.calls = 0                   # head forwards run
        self.base = 0                    # the position of the cache's first row
        self._hidden: list[mx.array] = []   # the target's, of positions `synced` on (L, H)

    @property
    def synced(self) -> int:
        """The first position whose row the cache lacks."""
        return self.base + self.cache.offset

    def _fed(self) -> int:
        return sum(h.shape[0] for h in self._hidden)

    def feed(self, start: int, hidden: mx.array) -> None:
        """The target's last-layer hidden states (L, H) of positions start, ... (committed)."""
        end = self.synced + self._fed()
        if start < end:
            self.rewind(start)
        elif start > end:
            self.cache.reset(0)
            self.base, self._hidden = start, []
        self._hidden.append(hidden)

    def rewind(self, length: int) -> None:
        """The history was rewritten after `length` tokens: forget every row past it."""
        if length < self.synced:
            self.cache.reset(max(0, length - self.base))
            self.base, self._hidden = min(self.base, length), []
        elif self._hidden:
            self._hidden = [self._rows(length - self.synced)] if length > self.synced else []

    def observe(self, history: History, new_tokens: int) -> None:
        """Committed tokens reach the head with their hidden states (`feed`): nothing to do."""

    def lag(self, history: History) -> int:
        """Committed positions whose rows the next chain runs first."""
        return history.committed - self.synced

    def _rows(self, n: int) -> mx.array:
        """The first n fed hidden states."""
        return mx.concatenate(self._hidden)[:n]

    def _forward(self, tokens: mx.array, hidden: mx.array, position: int) -> mx.array:
        """The head over rows pairing `hidden` (L, H) with the embeddings of `tokens` (1, L),
        from `position` on, committed to its cache; (1, L, H)."""
        out = self.target.mtp(self.target.embed(tokens), hidden[None], self.cache, position)
        self.cache.commit()
        self.calls += 1
        return out

    def queue_chain(self, root: int, k: int, history: History, draw: Optional[Draw] = None
                    ) -> Optional[QueuedChain]:
        """k tokens after the root, one head forward per token, queued on the device
        (ModelDrafter.queue_chain's contract: greedy, or drawn with `draw`). None where the
        head lacks the target's hidden state before the root."""
        c, start = history.committed, self.synced
        if not 0 <= c - 1 - start < self._fed():
            return None
        target_hidden = self.target.model.norm(self._rows(c - start))
        h = self._forward(mx.array([history.tokens[start + 1:c] + [root]]), target_hidden,
                          start)[:, -1:]
        chain = ChainTokens(draw)
        for i in range(k):
            tok = chain.add(self.target.logits(h)[0, -1])
            if i + 1 < k:
                h = self._forward(tok.reshape(1, 1), h[0], c + i)
        self.cache.reset(c - 1 - self.base)
        self._hidden = [mx.concatenate(self._hidden)[c - 1 - start:]]
        return chain.queued()
