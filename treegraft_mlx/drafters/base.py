"""What every drafter offers, so that drafters of any cost plug into one tree the same way."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Optional, Protocol

from ..history import History
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


class ChainDrafter(Protocol):
    """Drafts a chain from the root, one forward per token (ModelDrafter.draft_chain's
    contract), grafted into the tree by TreeBuild.graft_chain."""

    name: str
    calls: int

    def draft_chain(self, root: int, k: int, history: History, more=None, sample=None
                    ) -> tuple[list[int], list[float]]:
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

    def observe(self, history: History, new_tokens: int) -> None:
        """Every drafter learns of the tokens just committed."""
        for d in self.all:
            d.observe(history, new_tokens)
