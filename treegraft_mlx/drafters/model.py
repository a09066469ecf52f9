"""The strong drafter: a small LM of the target's family that rescores and grafts onto the tree.

Each call runs, in one forward with a tree mask, the committed tokens its own cache has not
seen yet (lazy sync) and the tree nodes it has not run this step. Tree rows never outlive the
step in its cache.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Optional, Union

import mlx.core as mx
import numpy as np

from ..device import on_gpu
from ..history import History, host_logsumexp
from .base import ChainTokens, Draw, QueuedChain
from ..tree import (NAN, STRONG, DraftTree, ancestor_mask, attention_mask, build_cap, positions,
                    reselect)


LogProbs = Union[mx.array, np.ndarray]   # (rows, V): on the device on a GPU, else on the host


def log_softmax_top_k(logits: mx.array, k: int) -> tuple[LogProbs, np.ndarray, np.ndarray]:
    """Each row's log-probs and its k best tokens with theirs, where that is cheapest: on a GPU
    in MLX (only the top-k leave it); on MLX's CPU backend in numpy, whose `exp` is vectorised
    (docs/design.md §4.1)."""
    if on_gpu():
        logp = logits - mx.logsumexp(logits, -1, keepdims=True)
        top_ids = mx.argpartition(-logp, k - 1, axis=-1)[:, :k]
        top_lp = mx.take_along_axis(logp, top_ids, -1)
        mx.eval(logp, top_ids, top_lp)
        return logp, np.array(top_ids), np.array(top_lp)
    rows = np.array(logits)
    logp = rows - host_logsumexp(rows)[:, None]
    top_ids = np.argpartition(-logp, k - 1, axis=-1)[:, :k]
    return logp, top_ids, np.take_along_axis(logp, top_ids, -1)


def token_logprobs(logp: LogProbs, rows: np.ndarray, tokens: np.ndarray) -> np.ndarray:
    """logp[rows[i], tokens[i]] for every i, gathered where logp lives."""
    if isinstance(logp, np.ndarray):
        return logp[rows, tokens]
    return np.array(mx.take_along_axis(logp[mx.array(rows)], mx.array(tokens)[:, None], -1)[:, 0])


def stack_rows(old: Optional[LogProbs], new: LogProbs) -> LogProbs:
    if old is None:
        return new
    return np.concatenate([old, new]) if isinstance(new, np.ndarray) else mx.concatenate([old, new])


@dataclass
class StepState:
    """What S computed for the current step's tree: nodes [0, done) are in its cache."""

    committed: int
    done: int = 0
    logp: Optional[LogProbs] = None                  # (done, V) log-probs after each node
    top_ids: Optional[np.ndarray] = None             # (done, top_k) S's best next tokens
    top_lp: Optional[np.ndarray] = None

    def copy(self) -> "StepState":
        return StepState(self.committed, self.done, self.logp, self.top_ids, self.top_lp)


class ModelDrafter:
    """Strong drafter S: rescore all nodes, reselect graft parents within the lookback window
    (root and shallow nodes included), graft top-k children without deleting anything.

    Within one step S's cache holds [committed tokens][tree nodes it has already run], so a
    later combine layer runs only the nodes added since (a node's log-probs depend only on
    its ancestors, which never change). `observe` ends the step and drops the tree rows.
    """

    def __init__(self, model, name: str = "draft", top_k: int = 10, depth: int = 5,
                 lookback: int = 5):
        self.model, self.name = model, name
        self.top_k, self.depth, self.lookback = top_k, depth, lookback
        self.cache = model.make_cache(max_len=model.args.max_position_embeddings
                                      + build_cap(top_k, depth))
        self.calls = 0
        self._step: Optional[StepState] = None

    def observe(self, history: History, new_tokens: int) -> None:
        """The step ended: forget its tree rows (the accepted ones sync lazily next call)."""
        if self._step is not None:
            self.cache.reset(self._step.committed)
            self._step = None

    def lag(self, history: History) -> int:
        """Committed tokens its cache has not seen yet: the next call's prefix to sync."""
        return history.committed - self.cache.offset

    def rewind(self, length: int) -> None:
        """The history was rewritten after `length` tokens: drop what the cache holds past it."""
        self.observe(None, 0)
        self.cache.reset(self.cache.rewindable(min(self.cache.offset, length)))

    def snapshot(self) -> Optional["StepState"]:
        """This step's state, to explore another branch and come back (calibration)."""
        return None if self._step is None else self._step.copy()

    def restore(self, state: Optional["StepState"]) -> None:
        if state is None:
            self.observe(None, 0)
        else:
            self._step = state.copy()
            self.cache.reset(state.committed + state.done)

    def _run_new_nodes(self, tree: DraftTree, history: History) -> StepState:
        """Run S on the tree nodes it has not seen this step (after syncing the prefix)."""
        step = self._step
        if step is None:
            step = self._step = StepState(history.committed)
        c, done, n = step.committed, step.done, len(tree)
        if done == n:
            return step
        prefix = history.tokens[self.cache.offset:c] if done == 0 else []
        m, start = len(prefix), self.cache.offset
        if done == 0:
            # [committed tokens not synced yet][the whole tree]: the compact tree mask (the
            # fused kernel on a GPU) covers it.
            mask, pos = attention_mask(tree.parent, start, m), positions(tree.parent, start, m)
        else:
            # Only the new nodes; they see the committed context and their ancestors among
            # the tree rows already in the cache.
            dense = np.zeros((n - done, c + n), dtype=bool)
            dense[:, :c] = True
            dense[:, c:] = ancestor_mask(tree.parent)[done:n]
            mask = mx.array(dense)
            pos = mx.array((c + np.asarray(tree.depth[done:n])).astype(np.int32))
        logits = self.model(mx.array([prefix + tree.token[done:n]]), cache=self.cache,
                            positions=pos, mask=mask,
                            logits_rows=mx.arange(m, m + n - done))[0].astype(mx.float32)
        self.cache.commit()
        self.calls += 1
        logp, top_ids, top_lp = log_softmax_top_k(logits, self.top_k)
        step.logp = stack_rows(step.logp, logp)
        step.top_ids = np.concatenate([step.top_ids, top_ids]) if done else top_ids
        step.top_lp = np.concatenate([step.top_lp, top_lp]) if done else top_lp
        step.done = n
        return step

    def expand(self, tree: DraftTree, frontier: list[int], layer: int, history: History) -> list[int]:
        step = self._run_new_nodes(tree, history)
        parent = np.asarray(tree.parent)
        edge = token_logprobs(step.logp, np.maximum(parent, 0), np.asarray(tree.token))

        # Rescore: every node's score becomes S's cumulative path log-prob (float32).
        score = np.zeros(len(tree), dtype=np.float32)
        for v in range(1, len(tree)):
            score[v] = score[parent[v]] + edge[v]
        tree.score = [float(s) for s in score]
        # S's evidence per node, for the acceptance estimates: its log-prob of the token at the
        # parent and how many of its top-k tokens there it ranks below.
        rank = (step.top_lp[parent[1:]] > edge[1:, None] + 1e-6).sum(1)
        tree.draft_lp = [NAN] + edge[1:].tolist()
        tree.draft_rank = [-1] + rank.tolist()

        # Reselect graft parents among all nodes within the lookback of the frontier.
        d_max = max(tree.depth[f] for f in frontier) if frontier else layer - 1
        chosen = reselect(tree, self.top_k, self.lookback, self.depth, d_max)

        # Graft: S's top-k children under each chosen parent; existing children are updated.
        cap = build_cap(self.top_k, self.depth)
        grafted: list[int] = []
        for p in chosen:
            ranks = (step.top_lp[p][None, :] > step.top_lp[p][:, None] + 1e-6).sum(1)
            for tok, lp, r in zip(step.top_ids[p], step.top_lp[p], ranks):
                if len(tree) >= cap and tree.child(int(p), int(tok)) < 0:
                    continue
                c = tree.add(int(p), int(tok), float(score[p] + lp), by=STRONG)
                tree.draft_lp[c], tree.draft_rank[c] = float(lp), int(r)
                if c not in grafted:
                    grafted.append(c)
        grafted.sort(key=lambda i: (-tree.score[i], i))
        return grafted if layer == 1 else grafted[:self.top_k]

    def queue_chain(self, root: int, k: int, history: History,
                    draw: Optional[Draw] = None) -> QueuedChain:
        """k tokens after the root, one forward per token, queued on the device and not read
        back: each token feeds the next forward lazily, as `mlx_lm`'s speculative decoding
        drafts, so the target's verification can be queued on them before any leaves the
        device. Greedy (S's argmax) or, with `draw`, drawn from S's processed distribution.
        The chain's rows never outlive the call in S's cache; the accepted ones sync with the
        next call's prefix."""
        self.observe(history, 0)            # a layer call's tree rows, if any, are stale
        committed = history.committed
        block = mx.array([history.tokens[self.cache.offset:committed] + [root]])
        chain = ChainTokens(draw)
        for _ in range(k):
            logits = self.model(block, cache=self.cache,
                                logits_rows=mx.array([block.shape[1] - 1]))[0, 0]
            self.cache.commit()
            block = chain.add(logits).reshape(1, 1)
            mx.async_eval(block)
        self.cache.reset(committed)
        self.calls += k
        return chain.queued()
