"""One target forward and what follows it: verify, accept and commit a tree, or queue an AR step.

Each step waits on the device once (docs/design.md §20): a tree step reads its verdict, its
chain's tokens and the history's queued scores in one readback; an AR step reads its token
and that token's score together.

Both run as parts (parts.py), so the batch (batch.py) runs the very same code.
"""

from __future__ import annotations

import time
from dataclasses import dataclass
from typing import Callable, Optional

import mlx.core as mx
import numpy as np

from . import verify
from .drafters import Drafters, QueuedChain
from .history import History, QueuedScores, queue_scores
from .parts import Part, Ran, Read, RequestBlock, alone, run_alone
from .readback import ints, pack, read_back, unpack
from .sampling import SamplerSettings, sample_token
from .session import Session
from .tree import STRONG, DraftTree
from .verify import Acceptance, tree_block


@dataclass
class StepStats:
    """What one target forward after the prefill did: what was built, verified and accepted,
    and where its time went (the bench's columns and the trace's line)."""

    accepted: int                 # drafts accepted (committed tokens this step - 1)
    nodes_verified: int
    nodes_built: int
    layers: list[str]             # which drafter expanded each layer
    t_draft: float
    t_verify: float
    t_accept: float
    t_schedule: float = 0.0       # part of t_draft spent deciding (the learned scheduler)
    rows: int = 1                 # rows the target's forward ran (nodes verified, padded)
    expected: float = 1.0         # committed tokens the size choice expected (adaptive steps)
    chain: int = 0                # drafts the strong drafter chained from the root

    def trace(self, step: int) -> str:
        """One line of the run-time trace (TREEGRAFT_TRACE=1): what the step decided."""
        if self.nodes_built == 1 and not self.layers and self.t_verify == 0:
            return f"step {step}: ar"
        return (f"step {step}: built {self.nodes_built} verified {self.nodes_verified} "
                f"rows {self.rows} expected {self.expected:.2f} chain {self.chain} "
                f"accepted {self.accepted} | draft {1000 * self.t_draft:.1f} verify "
                f"{1000 * self.t_verify:.1f} accept {1000 * self.t_accept:.1f} ms")


AR_STEP = StepStats(accepted=0, nodes_verified=1, nodes_built=1, layers=[], t_draft=0.0,
                    t_verify=0.0, t_accept=0.0)   # a plain AR step (its stats never change)


@dataclass
class Queued:
    """A target forward of one token, queued: its next token (lazy) and, where the history
    is scored, that token's score after this row (queued: history.queue_scores), packed for
    the readback when they were queued (readback.pack)."""

    token: mx.array
    score: Optional[QueuedScores] = None
    packed: Optional[mx.array] = None    # pack(token, score.part), queued with the forward

    def read(self, history: Optional[History] = None) -> int:
        """The next token, in one wait. With `history` (a scored one), the same readback
        carries the row's score, kept at the root's position, and the history's queued
        prefetches, if any: those are packed now, so nothing may be queued behind this
        forward then (Decoder._ar_step queues no next forward while prefetches wait)."""
        if history is None or self.score is None:
            return int(self.token.item())
        if history.pending():
            return self.finish(read_back(*self.parts(history)), history)
        return self.finish(unpack(np.array(self.packed), (self.token, self.score.part)), history)

    def parts(self, history: Optional[History] = None) -> tuple:
        """What `read` reads back, for a readback shared with other requests' (batch.py)."""
        if history is None or self.score is None:
            return (self.token,)
        return (self.token, self.score.part, *history.pending())

    def finish(self, got: list[np.ndarray], history: Optional[History] = None) -> int:
        """The token from the values of `parts`; the score and prefetches go to `history`."""
        token = ints(got[0])[0]
        if history is not None and self.score is not None:
            history.collect(got[2:])
            history.keep(history.committed, self.score.finish(got[1], [token]))
        return token


class ArForward:
    """Queues one AR forward: the token's logits, the next token drawn on the device (argmax,
    or the processed distribution with the next key) and, where `scores`, the history's score
    of it from the same logits row, all evaluated asynchronously, so the host can queue the
    following forward or draft while it runs. The token's hidden state goes to `saw`
    (Session.saw: an MTP head drafts from it)."""

    def __init__(self, target, cache, settings: SamplerSettings, key: mx.array,
                 saw: Callable[[int, mx.array], None], scores: bool = False):
        self.target, self.cache, self.settings, self.key = target, cache, settings, key
        self.saw, self.scores = saw, scores

    def __call__(self, token: mx.array) -> Queued:
        return self.queue(run_alone(self.target, self.block(token)))

    def block(self, token) -> RequestBlock:
        """The AR row of `token` (an int or a lazy token on the device)."""
        return RequestBlock(mx.array(token).reshape(1), self.cache, logits_rows=[0])

    def queue(self, ran: Ran) -> Queued:
        """The forward of `block` ran (queued): commit its row, queue the next token."""
        logits = ran.logits[-1]
        if ran.hidden is not None:
            self.saw(self.cache.offset, ran.hidden)
        self.cache.commit()
        sub = None
        if not self.settings.greedy:    # a key split is an op a step, too: greedy needs none
            self.key, sub = mx.random.split(self.key)
        nxt = sample_token(logits, self.settings, sub)
        if not self.scores:
            mx.async_eval(nxt)
            return Queued(nxt)
        score = queue_scores(logits[None], nxt.reshape(1))
        packed = pack(nxt, score.part)
        mx.async_eval(nxt, packed)
        return Queued(nxt, score, packed)


def commit(session: Session, drafters: Drafters, tree: DraftTree, walked: verify.Walked,
           hidden: Optional[mx.array] = None, scores: bool = True) -> list[int]:
    """Commit the accepted path: compact the target cache, hand the path's `hidden` states
    (if the target exposed them) to the session, keep the path's scores (where `scores`:
    they came back with the step's verdict), extend the history and tell the drafters.
    Returns what the history gained: the accepted drafts, then the bonus."""
    history, acc = session.history, walked.acceptance
    session.cache.keep(acc.path)
    if hidden is not None:
        session.saw(history.committed, hidden, acc.path)
    block = [tree.token[i] for i in acc.path]
    following = block[1:] + [acc.bonus]
    if scores:
        history.keep(history.committed, np.array(walked.scores, dtype=np.float32))
    history.extend(following)
    drafters.observe(history, len(block))
    return following


@dataclass
class VerifiedStep:
    """One tree step after its forward: what it committed and how long each part took."""

    block: list[int]              # committed after the root: accepted drafts, then the bonus
    acceptance: Acceptance
    logits: mx.array              # the target's logits of every verified row
    t_verify: float
    t_accept: float


def tree_step(session: Session, drafters: Drafters, tree: DraftTree, rows: int,
              settings: SamplerSettings, rng: np.random.Generator,
              clock: Callable[[], float] = time.perf_counter,
              chain: Optional[QueuedChain] = None, scores: bool = True) -> VerifiedStep:
    """The step every loop shares (decoding and both calibrations): verify `tree` in one
    forward of `rows` rows, accept by the regime's rule, commit (keeping the path's scores
    where `scores`), by itself (tree_part)."""
    return alone(session.family.target, tree_part(session, drafters, tree, rows, settings, rng,
                                                  clock, chain, scores))


def tree_part(session: Session, drafters: Drafters, tree: DraftTree, rows: int,
              settings: SamplerSettings, rng: np.random.Generator,
              clock: Callable[[], float] = time.perf_counter,
              chain: Optional[QueuedChain] = None, scores: bool = True) -> Part:
    """tree_step as a part. The host waits once: the verdict of every row
    (verify.queue_verdict), a `chain` queued on the device beside the tree (verified in the
    same forward, as a branch from the root) and the history's queued prefetches come back in
    one readback; then the chain joins `tree` (DraftTree.append_chain) and the host walks it."""
    t0 = clock()
    history, n_tree = session.history, len(tree)
    block = tree_block(session.cache, tree, rows, chain)
    ran = yield block
    n = len(block.logits_rows)
    logits, hidden = ran.logits, (ran.hidden[:n] if ran.hidden is not None else None)
    seed = None if settings.greedy else int(rng.integers(2**31))
    drafts = verify.SampledDrafts.of_chain(chain, n_tree)
    verdict = verify.queue_verdict(logits, settings, seed, drafts, scores)
    parts = [*verdict.parts] + ([chain.tokens] if chain is not None else [])
    got = yield Read((*parts, *history.pending()))
    history.collect(got[len(parts):])
    if chain is not None:
        tree.append_chain(ints(got[len(parts) - 1]), STRONG, drawn=drafts is not None)
    t1 = clock()
    walked = verify.walk(tree, verdict.finish(got[:len(verdict.parts)]), settings)
    block = commit(session, drafters, tree, walked, hidden, scores)
    return VerifiedStep(block, walked.acceptance, logits, t1 - t0, clock() - t1)
