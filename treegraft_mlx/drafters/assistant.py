"""Gemma 4's assistant as the strong drafter: chains from the root, and tree layers, drafted
from the target's own states (models/gemma4_assistant.py).

The assistant holds no cache. Its rows read the target's committed store-layer keys and
values straight from the target's cache (the sliding one's last window + 1 positions, as
transformers' bidirectional sliding mask over them lets a row see), and the target's hidden
state of the position before the root, which every target forward that commits hands over
(`feed`, through Session.saw). Every row sits at the root's position and never sees another
row, so a node's row depends only on its token and its parent's carry: a chain is one row
per forward, and a tree layer (`expand`) runs all its new nodes of one depth in one forward.
Nothing is synced or rewound: a drafted row never enters any cache. Drafts follow
transformers' generator after a prefill; after a partial acceptance it reads the rows its
verification forward left beyond the accepted path, which this drafter never does.
"""

from __future__ import annotations

from typing import Optional

import mlx.core as mx
import numpy as np

from ..errors import LoadError
from ..history import History
from ..models.gemma4 import SLIDING
from .base import ChainTokens, Draw, QueuedChain
from .model import ModelDrafter, StepState, log_softmax_top_k, stack_rows

KEPT = 8    # the target's hidden states of the last positions fed, kept for a root's row


def check_pair(assistant, target) -> None:
    """A clear error where `assistant` cannot draft for `target`: another architecture, a
    different vocabulary or width, or K/V shapes its layers cannot read."""
    a = assistant.args
    stores = getattr(getattr(target, "args", None), "store_layers", None)
    if stores is None:
        raise LoadError(f"the Gemma 4 assistant drafts only for a Gemma 4 target, not "
                        f"{getattr(target, 'model_type', type(target).__name__)}")
    t = target.args
    if a.vocab_size != t.vocab_size:
        raise LoadError(f"vocabulary mismatch: the assistant has {a.vocab_size} tokens, the "
                        f"target {t.vocab_size}")
    if a.backbone_hidden_size != t.hidden_size:
        raise LoadError(f"the assistant was trained beside a target of width "
                        f"{a.backbone_hidden_size}, this target's is {t.hidden_size}")
    for kind, shape in a.reads().items():
        s = t.specs[stores[kind]] if kind in stores else None
        if s is None or (s.kv_heads, s.head_dim) != shape:
            raise LoadError(f"the assistant's {kind} layers read K/V of shape {shape} "
                            f"(heads, head dim); the target's store layer has "
                            f"{None if s is None else (s.kv_heads, s.head_dim)}")


class AssistantDrafter(ModelDrafter):
    """Drafts with `model` (a Gemma4Assistant) from `target`'s states in `cache` (the
    session's target cache)."""

    def __init__(self, model, target, cache, name: str = "draft", top_k: int = 10,
                 depth: int = 5, lookback: int = 5):
        check_pair(model, target)
        self.model, self.target, self.target_cache, self.name = model, target, cache, name
        self.top_k, self.depth, self.lookback = top_k, depth, lookback
        self.calls = 0
        self._step: Optional[StepState] = None
        self._carry: list[mx.array] = []   # per tree node run this step: its row's carry
        self._hidden: dict[int, mx.array] = {}   # position -> the target's hidden (H,)
        self.window = target.args.sliding_window

    # -- what the target hands over -------------------------------------------------------

    def feed(self, start: int, hidden: mx.array) -> None:
        """The target's last-layer hidden states (L, H) of positions start, ...: what a
        root's row reads is the one before it. The last KEPT positions are kept (a forward
        queued ahead of the committed history feeds its row before the root's turn comes);
        those after `start` are superseded."""
        L = hidden.shape[0]
        self._hidden = {p: h for p, h in self._hidden.items() if start - KEPT < p < start}
        for j in range(max(0, L - KEPT), L):
            self._hidden[start + j] = hidden[j]

    def observe(self, history: History, new_tokens: int) -> None:
        """The step ended: its tree rows are forgotten."""
        self._step, self._carry = None, []

    def lag(self, history: History) -> int:
        return 0

    def rewind(self, length: int) -> None:
        """Nothing is cached past the target's own cache: only the step is forgotten."""
        self.observe(None, 0)

    def restore(self, state: Optional[StepState]) -> None:
        if state is None:
            self.observe(None, 0)
        else:
            self._step, self._carry = state.copy(), self._carry[:state.done]

    # -- the assistant's rows -------------------------------------------------------------

    def _root_hidden(self, history: History) -> Optional[mx.array]:
        """The target's final-norm hidden state of the position before the root, or None
        where it was not handed over."""
        last = self._hidden.get(history.committed - 1)
        return None if last is None else self.target.model.norm(last)

    def _kv(self, committed: int) -> dict:
        """The target's store-layer K/V of positions before `committed` (the root's), per
        layer type: rows a forward queued ahead wrote after them are not read."""
        out = {}
        for kind, layer in self.target.args.store_layers.items():
            first = max(0, committed - self.window - 1) if kind == SLIDING and self.window else 0
            out[kind] = self.target_cache.committed(layer, first, committed)
        return out

    def _rows(self, tokens: mx.array, hidden: mx.array, position: int, kv: dict):
        """One assistant forward over rows [embedding of tokens (R,), hidden (R, H)]."""
        embedded = self.target.token_embedding(tokens[None])[0]
        self.calls += 1
        return self.model(mx.concatenate([embedded, hidden.astype(embedded.dtype)], -1),
                          position, kv)

    def queue_chain(self, root: int, k: int, history: History,
                    draw: Optional[Draw] = None) -> Optional[QueuedChain]:
        """k tokens after the root, one row per forward, queued on the device (greedy, or
        drawn with `draw`); each row's input is the last token and the previous row's carry.
        None where the target's hidden state before the root was not handed over."""
        self.observe(history, 0)
        hidden = self._root_hidden(history)
        if hidden is None:
            return None
        c = history.committed
        kv, tok, chain = self._kv(c), mx.array([root]), ChainTokens(draw)
        hidden = hidden[None]
        for _ in range(k):
            logits, hidden = self._rows(tok, hidden, c, kv)
            tok = chain.add(logits[0]).reshape(1)
            mx.async_eval(tok)
        return chain.queued()

    def _run_new_nodes(self, tree, history: History) -> StepState:
        """The rows of the tree nodes not run this step, depth by depth (a node's row needs
        its parent's carry); ModelDrafter.expand rescores and grafts from them."""
        step = self._step
        if step is None:
            step = self._step = StepState(history.committed)
        done, n = step.done, len(tree)
        if done == n:
            return step
        hidden = self._root_hidden(history)
        if hidden is None:
            raise ValueError("the assistant needs the target's hidden state before the root; "
                             "none was handed over (Session.saw)")
        c, kv = history.committed, self._kv(history.committed)
        carry = {i: self._carry[i] for i in range(done)}
        parent = np.asarray(tree.parent)
        logits: dict[int, mx.array] = {}
        todo = list(range(done, n))
        while todo:
            ready = [v for v in todo if v == 0 or parent[v] in carry]
            rows = mx.stack([hidden if v == 0 else carry[int(parent[v])] for v in ready])
            out, carries = self._rows(mx.array([tree.token[v] for v in ready]), rows, c, kv)
            for j, v in enumerate(ready):
                logits[v], carry[v] = out[j], carries[j]
            todo = [v for v in todo if v not in logits]
        self._carry = [carry[i] for i in range(n)]
        new = mx.stack([logits[v] for v in range(done, n)]).astype(mx.float32)
        logp, top_ids, top_lp = log_softmax_top_k(new, self.top_k)
        step.logp = stack_rows(step.logp, logp)
        step.top_ids = np.concatenate([step.top_ids, top_ids]) if done else top_ids
        step.top_lp = np.concatenate([step.top_lp, top_lp]) if done else top_lp
        step.done = n
        return step


def is_assistant(model) -> bool:
    """Whether a loaded drafter model is a Gemma 4 assistant (drafts from the target)."""
    return getattr(model, "ASSISTANT", False)


