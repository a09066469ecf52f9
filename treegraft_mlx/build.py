"""A draft tree being built for one step: layer by layer by the drafters a schedule picks,
and the strong drafter's chain grafted in."""

from __future__ import annotations

import time
from dataclasses import dataclass, field
from typing import Iterable, Iterator

from .drafters import ChainDrafter, Drafter, Drafters
from .family import TreeConfig
from .history import History
from .scheduler import LayerState, Schedule
from .tree import DraftTree, build_cap, graft_chain


@dataclass
class TreeBuild:
    """A tree being built layer by layer, and who expanded which layer so far."""

    tree: DraftTree
    frontier: list[int]
    called: list[int]             # layers the strong drafter expanded
    used: list[str]               # drafter name per layer
    t_schedule: float = 0.0       # seconds spent in the schedule's decisions
    chain_path: list[int] = field(default_factory=list)  # the strong drafter's chain, root first

    @classmethod
    def rooted_at(cls, root: int) -> "TreeBuild":
        return cls(DraftTree.rooted_at(root), [0], [], [])

    def expand(self, layers: Iterable[int], schedule: Schedule, drafters: Drafters,
               cfg: TreeConfig, history: History) -> None:
        """Expand `layers` in order, the strong drafter on those the schedule picks.

        The schedule sees the remaining layers as the cheap drafter alone would build them
        (on copies); the build adopts the copy before the first picked layer, so the cheap
        expansions the schedule looked at are not redone. t_schedule counts the decisions,
        the copies and any look-ahead expansion that was not adopted."""
        todo = list(layers)
        while todo:
            ahead: list[TreeBuild] = [self]    # ahead[i]: the build before todo[i]
            grow_s = [0.0]                     # cheap-drafter seconds to reach ahead[i]

            def states() -> Iterator[LayerState]:
                for i, layer in enumerate(todo):
                    if i:
                        nxt = ahead[-1].copy()
                        t = time.perf_counter()
                        nxt.grow(drafters.cheap, todo[i - 1], history)
                        grow_s.append(grow_s[-1] + time.perf_counter() - t)
                        ahead.append(nxt)
                    yield ahead[i].state(layer, cfg, history)

            t0 = time.perf_counter()
            k = schedule.first_call(states(), len(drafters.expanders))
            j = len(ahead) - 1 if k is None else k
            self.t_schedule += time.perf_counter() - t0 - grow_s[j]
            self.tree, self.frontier = ahead[j].tree, ahead[j].frontier
            self.called, self.used = ahead[j].called, ahead[j].used
            if k is None:
                for layer in todo[j:]:
                    self.grow(drafters.cheap, layer, history)
                return
            self.called.append(todo[k])
            self.grow(drafters.strong, todo[k], history)
            todo = todo[k + 1:]

    def graft_chain(self, drafter: ChainDrafter, k: int, cfg: TreeConfig,
                    history: History) -> None:
        """A chain drafter (the strong drafter, or the target's MTP head) drafts k tokens
        after the root, one row per forward (cheap where a tree-mask call over many nodes is
        not), read back and grafted into the tree built so far (the tree's own nodes gain
        its evidence)."""
        chain = drafter.queue_chain(self.tree.token[0], k, history)
        if chain is not None:
            tokens, logps = chain.read()
            self.chain_path = graft_chain(self.tree, tokens, logps,
                                          build_cap(cfg.top_k, max(k, cfg.depth)))
        self.used.append(drafter.name)

    @property
    def chain(self) -> int:
        """Drafts the chain drafter chained from the root."""
        return max(0, len(self.chain_path) - 1)

    def state(self, layer: int, cfg: TreeConfig, history: History) -> LayerState:
        return LayerState(layer, cfg.depth, history.committed, self.called, self.tree,
                          self.frontier, cfg.top_k, cfg.lookback)

    def grow(self, drafter: Drafter, layer: int, history: History) -> None:
        """`drafter` expands `layer` from the frontier."""
        self.frontier = drafter.expand(self.tree, self.frontier, layer, history)
        self.used.append(drafter.name)

    def copy(self) -> "TreeBuild":
        return TreeBuild(self.tree.copy(), list(self.frontier), list(self.called),
                         list(self.used), self.t_schedule, list(self.chain_path))
