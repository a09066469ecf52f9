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


@dataclass(frozen=True)
class Drafters:
    """The drafters one decoding runs, by role: the cheap one builds every layer the schedule
    leaves to it, the strong one (if any) expands the layers it picks and drafts chains. A
    third role (a drafter the target ships with, such as an MTP head) would be one more
    field here."""

    cheap: Drafter
    strong: Optional[Drafter] = None

    @property
    def all(self) -> list[Drafter]:
        return [self.cheap] + ([self.strong] if self.strong is not None else [])

    def observe(self, history: History, new_tokens: int) -> None:
        """Every drafter learns of the tokens just committed."""
        for d in self.all:
            d.observe(history, new_tokens)
