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
from .model import More, Sample, chain_token


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

    def _forward(self, tokens: list[int], hidden: mx.array, position: int) -> mx.array:
        """The head over rows pairing `hidden` (L, H) with the embeddings of `tokens`, from
        `position` on, committed to its cache; (1, L, H)."""
        out = self.target.mtp(self.target.embed(mx.array([tokens])), hidden[None], self.cache,
                              position)
        self.cache.commit()
        self.calls += 1
        return out

    def draft_chain(self, root: int, k: int, history: History, more: Optional[More] = None,
                    sample: Optional[Sample] = None) -> tuple[list[int], list[float]]:
        """Up to k tokens after the root and the head's log-prob of each, one head forward per
        token (ModelDrafter.draft_chain's contract: `more` ends the chain where it no longer
        pays, `sample` draws each token from the head's processed distribution). None where
        the head lacks the target's hidden state before the root."""
        c, start = history.committed, self.synced
        if not 0 <= c - 1 - start < self._fed():
            return [], []
        target_hidden = self.target.model.norm(self._rows(c - start))
        h = self._forward(history.tokens[start + 1:c] + [root], target_hidden, start)[:, -1:]
        ids: list[int] = []
        lps: list[float] = []
        for i in range(k):
            toks, tok_lps, q = chain_token(self.target.logits(h)[0, -1], self.top_k, sample)
            ids.append(toks[0])
            lps.append(tok_lps[0])
            if i + 1 == k or (more is not None and not more(toks, tok_lps, q)):
                break
            h = self._forward([toks[0]], h[0], c + i)
        self.cache.reset(c - 1 - self.base)
        self._hidden = [mx.concatenate(self._hidden)[c - 1 - start:]]
        return ids, lps
