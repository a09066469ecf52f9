"""What every drafter offers, so that drafters of any cost plug into one tree the same way."""

from __future__ import annotations

from typing import Protocol

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
