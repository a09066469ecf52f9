"""What a step is worth and what it costs: the per-step size choice (Sizer, expected tokens
less the step's time at the long-run tokens per ms) and the length of the strong drafter's
chain (CallPolicy, measured committed tokens per ms of each length)."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Optional

import numpy as np

from .acceptance import AcceptanceModel
from .timing import StepCosts
from .tree import DraftTree, Plan, plan_verification

if TYPE_CHECKING:                 # family.py owns a Learned: no import back at run time
    from .family import TreeConfig

RATE_EMA = 0.1             # how fast the long-run tokens/ms the size choice prices time at moves
DRAFT_EXPLORE_EVERY = 4    # while drafting does not pay, still draft one step in this many


class Sizer:
    """Chooses what each step verifies (docs/design.md §7): acceptance estimates for the
    built tree, path probabilities, and the subtree that maximises expected tokens minus the step's
    measured cost priced at the long-run rate (an EMA of the planned tokens per ms)."""

    def __init__(self, acceptance: AcceptanceModel, costs: StepCosts, cfg: TreeConfig,
                 sampled: bool):
        self.acceptance, self.costs, self.cfg, self.sampled = acceptance, costs, cfg, sampled
        self.rate = 1.0 / (costs.ar_ms + costs.draft_ms)
        # What drafting a step is worth (the plan's value over the root alone's) and costs
        # (ms), as moving averages over the steps that drafted; None until one has.
        self.draft_gain: Optional[float] = None
        self.draft_ms = costs.draft_ms
        self.skipped = 0

    def plan(self, tree: DraftTree, context: int) -> Plan:
        """The best subtree to verify after `context` committed tokens."""
        if len(tree) == 1:                       # nothing drafted: an AR step
            return Plan(np.zeros(1, dtype=np.int64), 1.0, self.costs.ar_ms)
        accept = self.acceptance.estimate(tree, self.sampled, self.cfg.n_max, self.cfg.depth)
        return plan_verification(tree, accept, self.costs.step_ms(context), self.rate)

    def value(self, plan: Plan) -> float:
        """Expected tokens less the step's time priced at the long-run rate."""
        return plan.expected - self.rate * plan.step_ms

    def settle(self, plan: Plan, draft_ms: Optional[float] = None) -> None:
        """The step goes ahead with `plan`: the long-run rate moves towards its rate; a step
        that drafted (`draft_ms`) also teaches what drafting gains and costs."""
        self.rate += RATE_EMA * (plan.expected / (plan.step_ms + self.costs.draft_ms) - self.rate)
        if draft_ms is not None:
            gain = self.value(plan) - (1.0 - self.rate * self.costs.ar_ms)
            self.draft_gain = gain if self.draft_gain is None else (
                self.draft_gain + RATE_EMA * (gain - self.draft_gain))
            self.draft_ms += RATE_EMA * (draft_ms - self.draft_ms)

    def worth_drafting(self) -> bool:
        """Draft this step iff what drafting has gained (tokens, per step) exceeds its cost at
        the long-run rate; when it does not, still every DRAFT_EXPLORE_EVERY-th step, so the
        estimate follows the text (sampling rarely accepts n-gram drafts: most of its steps
        are AR steps, and on a CPU that cannot overlap drafting with the forward, drafting
        them would cost more than the few trees worth verifying gain)."""
        if self.draft_gain is None or self.draft_gain > self.rate * self.draft_ms:
            return True
        self.skipped += 1
        return self.skipped % DRAFT_EXPLORE_EVERY == 0


class CallPolicy:
    """How many drafts a strong-drafter call chains from the root, 0 being no call, chosen by
    measurement (docs/design.md §9): per bucket of the n-gram plan's expected tokens (the
    drafter helps most where the n-gram drafter found little), the committed tokens per ms
    of the steps that made each choice, as slow moving averages of tokens and of wall time.
    Throughput is unimodal in the chain length, so the search is local: no call and a chain
    of 1 are tried TRIES times first; then the best length tried is taken, and every
    EXPLORE_EVERY-th step of a bucket tries a neighbour (one shorter, one longer, in turn),
    so longer chains are reached when they pay and no estimate goes stale. Measured, not
    modelled: on a CPU a drafter forward costs a quarter of a target step and each row more
    a tenth, so chains of 1-2 pay at best; on a flat verification curve longer ones do. The
    estimates live on the family (per regime) and keep learning across generations: choices
    depend on what ran before, never on the current step's target logits (output stays
    exact). A call after a plain stretch first syncs everything the stretch committed into
    S's cache; that step is not measured (it prices the stretch, not the chain length), or
    the only calls measured would be the slow ones after stretches and the policy would
    never call again (measured: greedy `draft` called on 2% of steps, 0.95x `ar`, while a
    fixed chain of 2 ran at 1.26x)."""

    EDGES = (1.1, 1.4, 1.8, 2.5)       # bucket bounds on the n-gram plan's expected tokens
    TRIES = 4
    EXPLORE_EVERY = 6
    EMA = 0.05
    STEADY_LAG = 12     # a call that synced more committed tokens than this is not measured

    def __init__(self, max_k: int):
        shape = (len(self.EDGES) + 1, max_k + 1)
        self.tokens, self.ms = np.zeros(shape), np.zeros(shape)
        self.tries = np.zeros(shape, dtype=np.int64)
        self.steps = np.zeros(shape[0], dtype=np.int64)

    def bucket(self, expected: float) -> int:
        return int(np.searchsorted(self.EDGES, expected, side="right"))

    def rate(self, bucket: int) -> np.ndarray:
        """Measured committed tokens per ms of each choice in `bucket` (0 where untried)."""
        return np.divide(self.tokens[bucket], self.ms[bucket],
                         out=np.zeros(self.ms.shape[1]), where=self.ms[bucket] > 0)

    def peek(self, bucket: int) -> int:
        """What `choose` will answer next in `bucket`, without counting a step."""
        tries = self.tries[bucket]
        for k in (0, 1):
            if tries[k] < self.TRIES:
                return k
        rate = np.where(tries > 0, self.rate(bucket), -1.0)
        best = int(np.argmax(rate))
        step = self.steps[bucket] + 1
        if step % self.EXPLORE_EVERY:
            return best
        near = [k for k in (best - 1, best + 1) if 0 <= k < len(tries)]
        return near[(step // self.EXPLORE_EVERY) % len(near)]

    def choose(self, bucket: int) -> int:
        k = self.peek(bucket)
        self.steps[bucket] += 1
        return k

    def observe(self, bucket: int, k: int, tokens: int, ms: float) -> None:
        """A step in `bucket` that chained `k` drafts committed `tokens` in `ms` (its wall
        time: drafting, verification, acceptance)."""
        self.tries[bucket, k] += 1
        w = max(self.EMA, 1.0 / self.tries[bucket, k])
        self.tokens[bucket, k] += w * (tokens - self.tokens[bucket, k])
        self.ms[bucket, k] += w * (ms - self.ms[bucket, k])


class Fallback:
    """When to decode plainly (docs/design.md §7.9): measured committed tokens per ms of tree
    steps against plain AR stretches, whichever is faster wins the next stretch. A sampled run
    accepts nothing on most steps, and a tree step's host work (the logits row, the history's
    log-probs, drafting, sizing) then costs more than a plain AR step; a stretch does exactly
    what `ar` does. Every PROBE tree steps the rates are compared: while AR is faster the next
    stretch runs, each twice as long as the last (to MAX_STRETCH, so the probes' cost fades);
    once the tree is faster again, or a new generation starts, stretches restart short. A
    stretch also ends where the text starts to loop (the decoder checks the n-gram index).
    The AR rate starts from the cost table's AR step and is then measured. Lives on the
    family (per regime and strategy): choices depend on measured times and the committed
    text, never on the target's logits."""

    PROBE = 4
    FIRST_STRETCH = 16
    MAX_STRETCH = 256
    EMA = 0.2

    def __init__(self, ar_ms: float):
        self.tree = np.zeros(2)                 # moving averages of (tokens, ms) per tree step
        self.ar = np.array([1.0, ar_ms])        # ... per AR step, over stretches
        self.tree_steps = self.ar_stretches = 0
        self.since = 0                          # tree steps since the last decision
        self.stretch = self.FIRST_STRETCH

    def new_text(self) -> None:
        """A generation starts: its text, not the last one's, decides how long stretches get."""
        self.since, self.stretch = 0, self.FIRST_STRETCH

    def observe_tree(self, tokens: int, ms: float) -> None:
        self.tree_steps += 1
        self.since += 1
        self.tree += max(self.EMA, 1.0 / self.tree_steps) * (np.array([tokens, ms]) - self.tree)

    def observe_ar(self, tokens: int, ms: float) -> None:
        """A stretch committed `tokens` in `ms` of wall time."""
        self.ar_stretches += 1
        w = max(0.5, 1.0 / self.ar_stretches)
        self.ar += w * (np.array([1.0, ms / tokens]) - self.ar)

    def faster(self) -> bool:
        """Whether tree steps have measured faster than AR steps."""
        return self.tree[0] * self.ar[1] >= self.tree[1]

    def next_stretch(self) -> int:
        """AR steps to take now: 0 (a tree step) except every PROBE tree steps, when AR has
        measured faster."""
        if self.since < self.PROBE:
            return 0
        self.since = 0
        if self.faster():
            self.stretch = self.FIRST_STRETCH
            return 0
        n, self.stretch = self.stretch, min(2 * self.stretch, self.MAX_STRETCH)
        return n


@dataclass
class Learned:
    """What decoding learns about one family on this device while it runs, kept on the family
    across generations: the strong drafter's call policy and the plain-stretch fallback, one
    per decoding regime, tree shape and strategy."""

    call_policies: dict = field(default_factory=dict)
    fallbacks: dict = field(default_factory=dict)

    def call_policy(self, sampled: bool, tree: "TreeConfig", ngram: bool) -> CallPolicy:
        """The call policy of a priced strategy (with or without the n-gram tree)."""
        return self.call_policies.setdefault((sampled, tree, ngram), CallPolicy(tree.depth))

    def fallback(self, sampled: bool, tree: "TreeConfig", strategy: str,
                 ar_ms: float) -> Fallback:
        """The fallback of an adaptive strategy; its AR rate starts from `ar_ms`."""
        return self.fallbacks.setdefault((sampled, tree, strategy), Fallback(ar_ms))
