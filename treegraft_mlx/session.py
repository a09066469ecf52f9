"""What survives between generations of one conversation, and the prefill that reuses it.

The target's KV cache, the history (tokens and the target's scores of them) and the drafters'
state stay alive across turns; a target's MTP head, and a Gemma 4 assistant, hear every committed
hidden state (`saw`).
A new prompt reuses the longest prefix it shares with what is committed, so a chat turn only
prefills its new tokens.
"""

from __future__ import annotations

from typing import Optional

import mlx.core as mx
import numpy as np

from .drafters import AssistantDrafter, ModelDrafter, MtpDrafter, NgramDrafter, is_assistant
from .family import Family, TreeConfig
from .history import History, as_logits
from .readback import ints
from .sampling import SamplerSettings, sample_token
from .slots import SlotPool
from .parts import Part, Ran, Read, RequestBlock, alone

PREFILL_CHUNK = 512


def common_prefix(a: list[int], b: list[int]) -> int:
    n = min(len(a), len(b))
    diff = np.flatnonzero(np.asarray(a[:n]) != np.asarray(b[:n]))
    return int(diff[0]) if diff.size else n


class Session:
    def __init__(self, family: Family, tree: Optional[TreeConfig] = None,
                 pool: Optional[SlotPool] = None):
        """`pool`: the target's cache is a slot of it (a request decoded together, slots.py)."""
        self.family = family
        self.tree = tree or family.tree
        args = family.target.args
        # Room past the context for one pending (padded) tree; its rows are never committed there.
        max_len = args.max_position_embeddings + max([self.tree.budget, *self.tree.verify_pad])
        self.cache = (pool.take(max_len) if pool is not None
                      else family.target.make_cache(max_len=max_len))
        self.history: Optional[History] = None
        t = self.tree
        self.ngram = NgramDrafter(t.n_max, t.top_k, t.depth)
        self.strong = (ModelDrafter(family.strong, "draft", t.top_k, t.depth, t.lookback)
                       if family.strong is not None and not is_assistant(family.strong)
                       else None)
        if family.strong is not None and is_assistant(family.strong):  # Gemma 4's assistant
            self.strong = AssistantDrafter(family.strong, family.target, self.cache, "draft",
                                           t.top_k, t.depth, t.lookback)
        self.mtp = (MtpDrafter(family.target, t.top_k, t.depth)
                    if family.mtp is not None else None)

    def saw(self, start: int, hidden: mx.array, rows: Optional[list[int]] = None) -> None:
        """The target's last-layer hidden states (L, H) of positions start, ..., just
        committed (`rows` of `hidden` only, where given: a tree step's accepted path): the MTP
        head's input, kept whatever the strategy (one row a position, as the history keeps
        the prompt's) so that any later turn can draft with it; a Gemma 4 assistant reads
        the last of them. Without either, nothing is gathered."""
        for drafter in (self.mtp, self.strong):
            if hasattr(drafter, "feed"):
                drafter.feed(start, hidden if rows is None else hidden[mx.array(rows)])

    def _prefilled(self, history: History, start: int, ran: Ran) -> mx.array:
        """One chunk of the prompt ran into the cache (its block asked for its last row's
        logits); its rows' scores are deferred (History.defer) where the target exposes its
        hidden states, so only the last row's logits are computed now (what `mlx_lm`
        computes); a pipeline target, whose head runs on its last rank, returns every row's
        logits, and those are deferred instead. Returns the last row's logits."""
        self.cache.commit()
        if ran.hidden is None:
            mx.eval(ran.all_logits)
            history.defer(start, ran.all_logits, as_logits)
            return ran.all_logits[-1]
        self.saw(start, ran.hidden)
        last = ran.logits[-1]
        mx.eval(ran.hidden, last)
        history.defer(start, ran.hidden, ran.head)
        return last

    def reusable(self, ids: list[int]) -> int:
        """Cached tokens the new prompt starts with (its last token is always re-run)."""
        if self.history is None:
            return 0
        committed = min(self.cache.offset, self.history.committed)
        return min(common_prefix(self.history.tokens[:committed], ids), len(ids) - 1)

    def prefill(self, ids: list[int], settings: SamplerSettings, rng: np.random.Generator) -> int:
        """Prefill what is not cached yet (its rows' scores deferred); returns the first token.

        Afterwards history = prompt + [first token] (pending) and every drafter is in sync.
        """
        return alone(self.family.target, self.prefill_part(ids, settings, rng))

    def prefill_part(self, ids: list[int], settings: SamplerSettings,
                     rng: np.random.Generator) -> Part:
        """`prefill` as a step part (parts.py): one block a chunk, then the first token's read,
        drawn on the device with a key from `rng` (only the token leaves the device)."""
        keep = self.cache.rewindable(self.reusable(ids))
        history = History(ids, capacity=len(ids) + 1024)
        if keep:
            keep = self.cache.rewindable(history.inherit(self.history, keep))
        self.cache.reset(keep)
        if self.mtp is not None:
            self.mtp.rewind(keep)
        last = None
        for start in range(keep, len(ids), PREFILL_CHUNK):
            chunk = ids[start:start + PREFILL_CHUNK]
            ran = yield RequestBlock(chunk, self.cache, logits_rows=[len(chunk) - 1])
            last = self._prefilled(history, start, ran)
        key = None if settings.greedy else mx.random.key(int(rng.integers(2**31)))
        root = ints((yield Read((sample_token(last, settings, key),)))[0])[0]
        history.extend([root])
        self.history = history
        self.ngram.reset()
        self.ngram.observe(history, len(history.tokens))
        if self.strong is not None:
            self.strong.rewind(keep)
        return root
