"""Decoding strategies by name: what each drafts and verifies, as plain data.

  ar                      the target alone
  chain[:k]               classic speculative decoding: k greedy drafts of the strong
                          drafter, queued on the device with the verification
  ngram                   endpoint W: the n-gram drafter builds every layer
  draft                   endpoint S: the strong drafter's chain, of the length the call
                          policy measured fastest (CallPolicy; 0 is an AR step), queued on
                          the device and verified without a readback in between
  mtp                     the target's MTP head's chain alone, priced as `draft` prices S's
  treegraft               the shared tree: the n-gram tree and the strong drafter's chain
                          beside it from the root, of the length the call policy measured
                          fastest for the n-gram plan's bucket, verified in one forward; on
                          a target with an MTP head, the head's chain instead of S's
  treegraft-learned       the paper's schedule: the family's learned scheduler decides which
                          layers the strong drafter expands with a tree-mask call (its
                          sampling-calibrated one when sampling, if the bundle has one)
  treegraft-fixed:1,3     the strong drafter expands exactly layers 1 and 3
"""

from __future__ import annotations

from dataclasses import dataclass, replace
from typing import TYPE_CHECKING, Optional

from .family import Family, TreeConfig
from .models.hybrid import SNAPSHOTS
from .sampling import SamplerSettings
from .scheduler import Schedule, parse_layers

if TYPE_CHECKING:
    from .session import Session

DEFAULT_CHAIN_K = 4
# Where `treegraft-learned` may call the strong drafter: layer 1 (the learned scheduler's
# budget b0 is 1 in both regimes on tg-tiny, and it calls at layer 1 when it calls); without
# a scheduler, the call is made on every step.
LEARNED_LAYERS = frozenset({1})


@dataclass(frozen=True)
class Strategy:
    name: str
    kind: str                                   # "ar", "chain" or "tree"
    combine_layers: frozenset[int] = frozenset()
    chain_k: int = DEFAULT_CHAIN_K
    learned: bool = False                       # the family's scheduler, if it has one
    priced: bool = False                        # call when the estimates say it pays
    ngram: bool = True                          # the n-gram drafter builds the tree
    strong_chain: bool = False                  # graft S's greedy chain from the root
    mtp_chain: bool = False                     # graft the target's MTP head's chain instead

    @property
    def ngram_only(self) -> bool:
        """Whether every draft comes from the n-gram drafter."""
        return (self.kind == "tree" and self.ngram and not self.needs_strong
                and not self.mtp_chain)

    @property
    def scores_history(self) -> bool:
        """Whether its trees hold n-gram drafts, whose estimates read the target's scores of
        the committed text (History): other strategies skip scoring, as `ar` does."""
        return self.kind == "tree" and self.ngram

    @property
    def needs_strong(self) -> bool:
        return self.kind == "chain" or (self.kind == "tree" and
                                        (bool(self.combine_layers) or self.learned
                                         or self.strong_chain))


STRATEGY_NAMES = ("ar", "chain", "ngram", "draft", "mtp", "treegraft", "treegraft-learned",
                  "treegraft-fixed:<layers>")


def parse_strategy(name: str, depth: int = 5) -> Strategy:
    if name == "ar":
        return Strategy(name, "ar")
    if name == "chain" or name.startswith("chain:"):
        k = int(name.split(":", 1)[1]) if ":" in name else DEFAULT_CHAIN_K
        if k < 1:
            raise ValueError(f"chain length must be >= 1, got {k}")
        return Strategy(name, "chain", chain_k=k)
    if name == "ngram":
        return Strategy(name, "tree")
    if name == "draft":
        return Strategy(name, "tree", ngram=False, strong_chain=True, priced=True)
    if name == "mtp":
        return Strategy(name, "tree", ngram=False, mtp_chain=True, priced=True)
    if name == "treegraft":
        return Strategy(name, "tree", strong_chain=True, priced=True)
    if name == "treegraft-learned":
        return Strategy(name, "tree", LEARNED_LAYERS, learned=True)
    if name.startswith("treegraft-fixed:"):
        return Strategy(name, "tree", parse_layers(name.split(":", 1)[1]))
    raise ValueError(f"unknown strategy {name!r}; choose from {', '.join(STRATEGY_NAMES)}")


def for_family(strategy: Strategy, has_strong: bool, has_mtp: bool) -> Strategy:
    """The strategy as a family with (or without) a strong drafter and an MTP head runs it:
    `treegraft` is the shared tree of the drafters the family has. On a target that ships
    an MTP head it grafts the head's chain (one decoder layer reading the target's own hidden
    state, far cheaper than a small LM's forward) instead of the strong drafter's
    (docs/design.md §19); on a family with neither (`--draft-model none`) it is the n-gram
    tree alone, as `ngram` builds it. Every other strategy runs as named: one that needs a
    drafter the family lacks is refused."""
    if strategy.name != "treegraft":
        return strategy
    if has_mtp:
        return replace(strategy, strong_chain=False, mtp_chain=True)
    if not has_strong:
        return replace(strategy, strong_chain=False, priced=False)
    return strategy


def runs_on(strategy: Strategy, family: Family) -> Strategy:
    """The strategy as the family runs it (for_family); a ValueError says why one its drafters
    cannot run is refused. Read from the loaded models alone, so a command refuses it before
    any cost is measured."""
    strategy = for_family(strategy, family.strong is not None, family.mtp is not None)
    if strategy.needs_strong and family.strong is None:
        raise ValueError(f"strategy {strategy.name!r} needs a strong drafter; the family has none")
    if strategy.mtp_chain and family.mtp is None:
        raise ValueError(f"strategy {strategy.name!r} needs the target's multi-token-"
                         "prediction head (Qwen 3.5 / Qwen3-Next `mtp.*` weights, which "
                         "mlx_lm's converter drops); this target has none")
    if (strategy.combine_layers or strategy.learned) and getattr(family.strong, "RECURRENT",
                                                                 False):
        raise ValueError(f"strategy {strategy.name!r} expands tree layers with the strong "
                         "drafter, which a hybrid (recurrent) drafter cannot rewind: use "
                         "draft, treegraft or chain")
    if (strategy.kind == "chain" and strategy.chain_k >= SNAPSHOTS
            and getattr(family.strong, "RECURRENT", False)):
        raise ValueError(f"chain:{strategy.chain_k} rewinds a hybrid (recurrent) drafter "
                         f"further than the {SNAPSHOTS} states its cache keeps: use a chain "
                         f"of at most {SNAPSHOTS - 1}")
    return strategy


def needs_costs(strategy: Strategy, tree: TreeConfig) -> bool:
    """Whether decoding `strategy` sizes its steps, and so needs this device's step costs."""
    return strategy.kind == "tree" and tree.adaptive


def needs_timing(strategy: Strategy, session: Session, settings: SamplerSettings,
                 schedule: Optional[Schedule]) -> bool:
    """Whether decoding runs the family's learned scheduler (no schedule given, and one for
    the regime exists), and so needs this device's T_tgt / T_mid."""
    return (schedule is None and strategy.learned
            and session.family.scheduler(not settings.greedy) is not None)
