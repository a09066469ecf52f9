"""What every drafter offers, so that drafters of any cost plug into one tree the same way."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Callable, Optional, Protocol

import mlx.core as mx
import numpy as np

from ..history import History, host_logsumexp
from ..tree import DraftTree


class Drafter(Protocol):
    """Expands one layer of the shared tree.

    `expand` adds children below (or, for drafters that reselect, anywhere within their
    lookback of) the frontier and returns the next frontier. It never deletes nodes.
    """

    name: str

    def expand(self, tree: DraftTree, frontier: list[int], layer: int, history: History) -> list[int]:
        ...

    def observe(self, history: History, new_tokens: int) -> None:
        """The last `new_tokens` of history were just appended (prompt or accepted tokens)."""
        ...


# A logits row -> (a token drawn from its processed distribution q, q), both on the device.
Draw = Callable[[mx.array], tuple[mx.array, mx.array]]


@dataclass(frozen=True)
class QueuedChain:
    """A chain of drafts from the root, queued on the device and not read back yet."""

    tokens: mx.array                  # (k,) int32
    rows: mx.array                    # (k, V) the drafter's logits at each chain position
    drawn_from: Optional[mx.array]    # (k, V) q of each sampled token; None: greedy drafts

    def __len__(self) -> int:
        return self.tokens.shape[0]

    def read(self) -> tuple[list[int], list[float]]:
        """The tokens and the drafter's log-prob of each, read back; the log-softmax runs on
        the host (MLX's CPU `exp` is scalar; a chain has a few rows)."""
        ids, rows = np.array(self.tokens), np.array(self.rows.astype(mx.float32))
        return ids.tolist(), (rows[np.arange(len(ids)), ids] - host_logsumexp(rows)).tolist()


class ChainTokens:
    """A chain being drafted on the device: each position's token from its logits row (the
    argmax, or drawn with `draw`), kept lazily with the row (and q) it came from."""

    def __init__(self, draw: Optional[Draw] = None):
        self.draw = draw
        self.tokens: list[mx.array] = []
        self.rows: list[mx.array] = []
        self.drawn_from: list[mx.array] = []

    def add(self, logits: mx.array) -> mx.array:
        """The next token, from its position's logits (V,): lazy, to feed the next forward."""
        if self.draw is None:
            tok = mx.argmax(logits)
        else:
            tok, q = self.draw(logits)
            self.drawn_from.append(q)
        self.tokens.append(tok)
        self.rows.append(logits)
        return tok

    def queued(self) -> QueuedChain:
        return QueuedChain(mx.stack(self.tokens).astype(mx.int32), mx.stack(self.rows),
                           mx.stack(self.drawn_from) if self.drawn_from else None)


class ChainDrafter(Protocol):
    """Drafts a chain from the root, one forward per token, queued on the device
    (ModelDrafter.queue_chain's contract): verified with the tree in the same evaluation, or
    read back and grafted into it (TreeBuild.graft_chain)."""

    name: str
    calls: int

    def queue_chain(self, root: int, k: int, history: History, draw: Optional[Draw] = None
                    ) -> Optional[QueuedChain]:
        """None where the drafter cannot draft from this root."""
        ...

    def lag(self, history: History) -> int:
        """Committed tokens the next chain syncs first."""
        ...

    def observe(self, history: History, new_tokens: int) -> None:
        ...


@dataclass(frozen=True)
class Drafters:
    """The drafters one decoding runs, by role: the cheap one builds every layer the schedule
    leaves to it, the strong one (if any) expands the layers it picks and drafts chains, the
    target's MTP head (if the strategy runs it) drafts chains only."""

    cheap: Drafter
    strong: Optional[Drafter] = None
    mtp: Optional["ChainDrafter"] = None     # the MTP head: chains only

    @property
    def expanders(self) -> list[Drafter]:
        """The drafters a schedule may pick to expand a layer."""
        return [self.cheap] + ([self.strong] if self.strong is not None else [])

    @property
    def all(self) -> list:
        return self.expanders + ([self.mtp] if self.mtp is not None else [])

    def forwards(self) -> int:
        """Model-drafter forwards (strong drafter, MTP head) run so far."""
        return sum(getattr(d, "calls", 0) for d in self.all)

    def observe(self, history: History, new_tokens: int) -> None:
        """Every drafter learns of the tokens just committed."""
        for d in self.all:
            d.observe(history, new_tokens)
