"""What a step is worth and what it costs: the per-step size choice (Sizer, expected tokens
less the step's time at the long-run tokens per ms), whether to call the strong drafter and
how long its chain runs (CallPolicy: measured tokens per ms of each chain length), and when
to decode plainly (Fallback)."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Optional

import numpy as np

from .acceptance import AcceptanceModel
from .timing import StepCosts
from .tree import DraftTree, Plan, Reach, path_probability, plan_verification

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

    def plan(self, tree: DraftTree, context: int, chain: int = 0) -> Plan:
        """The best subtree to verify after `context` committed tokens, given every node's
        acceptance estimate, beside a queued `chain` of that many rows (which the step
        verifies whatever the plan: the tree's rows are priced after the chain's)."""
        if len(tree) == 1 and not chain:         # nothing drafted: an AR step
            return Plan(np.zeros(1, dtype=np.int64), 1.0, self.costs.ar_ms)
        return plan_verification(tree, self.accept(tree), self.costs.step_ms(context)[chain:],
                                 self.rate)

    def candidate(self, tree: DraftTree, context: int, chain: int = 0) -> "Candidate":
        """`tree` offered to a joint plan (plan_jointly) instead of planned alone."""
        prob = path_probability(tree.parent, self.accept(tree))
        return Candidate(prob, np.asarray(tree.depth), 1 + chain, context, self.rate,
                         self.costs)

    def accept(self, tree: DraftTree) -> np.ndarray:
        """a(v) for every node of `tree` (acceptance.py)."""
        return self.acceptance.estimate(tree, self.sampled, self.cfg.n_max, self.cfg.depth)

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


@dataclass(frozen=True)
class Candidate:
    """One request's tree offered to a joint plan: every node's path probability and depth,
    the rows it runs whatever is kept (its root, and a queued chain's), its committed context,
    its Sizer's long-run rate (tokens per ms) and the device's step costs."""

    prob: np.ndarray
    depth: np.ndarray
    forced: int
    context: int
    rate: float
    costs: StepCosts


@dataclass(frozen=True)
class Company:
    """The other requests sharing a batch's forward, as one request's call policy sees them:
    the tokens they commit a step (summed; each a moving average) and the batch's step time
    (ms, a moving average)."""

    tokens: float
    ms: float


def plan_jointly(candidates: list[Candidate], other_rows: int = 0) -> list[Plan]:
    """One plan for a batch's forward (docs/design.md §23): every candidate's forced rows and
    the `other_rows` of requests that run fixed blocks (an AR row, a prefill chunk) are kept;
    the drafted nodes of all candidates, ranked together by path probability (ties: shallower,
    then the earlier request, then the earlier node), are added while expected tokens less the
    forward's time at the batch's rate (the sum of the requests' rates) grow, up to the
    largest measured block less the candidates' forced rows (a request alone drafts no more),
    priced at the mean context of the candidates. Each request's
    share of a ranked prefix is ancestor-closed (a child is never more probable than its
    parent). With one candidate and nothing else this is exactly plan_verification: a batch
    of one plans as a request alone. Returns each candidate's Plan, with the shared forward's
    time as its step_ms."""
    forced = other_rows + sum(c.forced for c in candidates)
    table = candidates[0].costs.step_ms(int(np.mean([c.context for c in candidates])))
    pool = sorted((-c.prob[v], c.depth[v], i, v) for i, c in enumerate(candidates)
                  for v in range(1, len(c.prob)))
    pool = pool[:max(0, len(table) - sum(c.forced for c in candidates))]
    ms = rows_ms(table, forced + len(pool))
    expected = len(candidates) + np.concatenate([[0.0], np.cumsum([-g[0] for g in pool])])
    rate = sum(c.rate for c in candidates)
    n = int(np.argmax(expected - rate * ms[forced - 1:forced + len(pool)]))
    kept: list[list[int]] = [[0] for _ in candidates]
    for _, _, i, v in pool[:n]:
        kept[i].append(v)
    step_ms = float(ms[forced - 1 + n])
    return [Plan(np.sort(np.array(k, dtype=np.int64)), float(c.prob[k].sum()), step_ms)
            for k, c in zip(kept, candidates)]


def rows_ms(step_ms: np.ndarray, rows: int) -> np.ndarray:
    """[r - 1]: ms of a forward of r rows for r up to `rows`: the measured table, then on the
    line through its last two entries (a batch may run more rows than a request's largest
    measured block)."""
    if rows <= len(step_ms):
        return step_ms[:rows]
    slope = step_ms[-1] - step_ms[-2] if len(step_ms) > 1 else step_ms[-1]
    more = step_ms[-1] + slope * np.arange(1, rows - len(step_ms) + 1)
    return np.concatenate([step_ms, more])


class CallPolicy:
    """How long a step's chain from the root runs, 0 being no call (docs/design.md §9).

    Priced per bucket of the n-gram plan's expected tokens (the drafter helps most where the
    n-gram drafter found little) as expected committed tokens over measured wall time. The
    time of each length is measured: a slow moving average of the steady steps that ran it.
    The tokens of a chain of any length come from one model fed by every chain step of the
    bucket, whatever its length (`expected`): how often the chain's token at each depth
    matched the target's there, given the tokens above it did, and how deep the n-gram
    drafts verified beside it reached. Measuring each length's own tokens compared lengths
    on different stretches of text, a few noisy steps each (measured: greedy `draft` at
    0.080 tokens a ms against 0.092 for a fixed chain of 2, its estimates ranking 1 above 3
    after 341 steady steps of 3 had run at 0.092 against 0.076 for 1); one model compares
    them on the same steps. The chain is queued on the device with the verification,
    nothing read back between them, so its length is chosen before any of its tokens is
    seen, as `mlx_lm`'s num_draft_tokens is, but per bucket and by measurement: a hill climb
    from START. The best priced length and its neighbours are timed TRIES times each
    first; then the best is taken, and after EXPLORE_EVERY steps of a bucket a run of RUN
    steps of a neighbour (shorter and longer in turn), so the times stay current and a
    policy that stopped calling still sees the drafter's tokens. Each exploration that
    finds the best where the last one did doubles the wait before the next (up to
    EXPLORE_MAX): where one length clearly wins (no call, on most sampled steps) exploring
    every EXPLORE_EVERY steps cost a fifth of the steps (measured: sampled `treegraft`
    0.88-0.90x `ar` against 0.91-0.96x for the policy before).

    Only steady steps are timed: those whose step before ran the same length. A change
    of length costs the step after it (a call after a step without one syncs the drafter's
    cache; a step without one after a call cannot be pipelined), so timing every step
    prices the mixture, not the length (measured: every length 0-3 of greedy `draft` at
    0.064-0.065 tokens a ms, while a chain of 2 on every step ran at 0.086).

    The estimates live on the family (per regime) and keep learning across generations:
    choices depend on what ran before, never on the current step's target logits (output
    stays exact). A call after a plain stretch first syncs everything the stretch committed
    into the drafter's cache; that step is not timed (it prices the stretch, not the
    call), or the only calls timed would be the slow ones after stretches and the policy
    would never call again (measured: greedy `draft` called on 2% of steps, 0.95x `ar`,
    while a fixed chain of 2 ran at 1.26x)."""

    EDGES = (1.1, 1.4, 1.8, 2.5)       # bucket bounds on the n-gram plan's expected tokens
    LONGEST = 6                        # chain lengths 0..LONGEST
    START = 2                          # where the climb starts (mlx_lm's default)
    TRIES = 3
    EXPLORE_EVERY = 12
    EXPLORE_MAX = 192
    RUN = 3
    EMA = 0.05
    MATCH_PRIOR = 0.5   # a depth's match rate before the chain has reached it
    USUAL_EMA = 0.01    # the long-run match rates ...
    RELAX = 0.02        # ... which the current ones return to, a step without a call
    STEADY_LAG = 12     # a call that synced more committed tokens than this is not timed

    def __init__(self):
        shape = (len(self.EDGES) + 1, self.LONGEST + 1)     # [bucket, chain length / depth]
        self.ms = np.zeros(shape)                           # time of a steady step
        self.tries = np.zeros(shape, dtype=np.int64)        # steady steps timed
        self.plain = np.zeros(shape[0])                     # tokens of a step without a call
        self.match = np.full(shape, self.MATCH_PRIOR)   # [b, d]: S's token at depth d matched
        self.usual = np.full(shape, self.MATCH_PRIOR)   # ... over the long run
        self.reached = np.zeros(shape, dtype=np.int64)      # ... chain steps that saw depth d
        self.ngram = np.zeros(shape)            # [b, d]: the n-gram drafts reached depth d
        self.chain_steps = np.zeros(shape[0], dtype=np.int64)
        self.runs: dict[int, tuple[int, int]] = {}    # bucket -> (length, steps left)
        self.last = -1                                  # the length the last step ran
        self.wait = np.full(shape[0], self.EXPLORE_EVERY)   # steps between explorations
        self.since = np.zeros(shape[0], dtype=np.int64)     # steps since the last one
        self.explored = np.zeros(shape[0], dtype=np.int64)  # explorations so far
        self.found = np.full(shape[0], -1)                  # the best when the last began

    def bucket(self, expected: float) -> int:
        return int(np.searchsorted(self.EDGES, expected, side="right"))

    def expected(self, bucket: int) -> np.ndarray:
        """Expected committed tokens of each chain length in `bucket`: the bonus, plus the
        accepted depth, the deeper of the chain's and the n-gram drafts' (each depth reached
        by either), the two taken as independent within the bucket. Length 0 is what steps
        without a call committed."""
        seen = self.reached[bucket] > 0
        rates = np.where(seen, self.match[bucket], np.nan)[1:]
        rates = _fill_forward(rates, self.MATCH_PRIOR)
        chain = np.concatenate([[1.0], np.cumprod(rates)])      # P(chain reaches depth d)
        either = 1.0 - (1.0 - self.ngram[bucket]) * (1.0 - chain)
        either[0] = 0.0
        out = 1.0 + np.array([either[1:k + 1].sum() + self.ngram[bucket, k + 1:].sum()
                              for k in range(self.LONGEST + 1)])
        out[0] = self.plain[bucket]
        return out

    def rate(self, bucket: int) -> np.ndarray:
        """Expected committed tokens per measured ms of each chain length in `bucket` (0
        untimed)."""
        return np.divide(self.expected(bucket), self.ms[bucket],
                         out=np.zeros(self.LONGEST + 1), where=self.ms[bucket] > 0)

    def best(self, bucket: int) -> int:
        """The fastest length tried TRIES times in `bucket` (START before any was)."""
        tried = self.tries[bucket] >= self.TRIES
        if not tried.any():
            return self.START
        return int(np.argmax(np.where(tried, self.rate(bucket), -1.0)))

    def shared(self, bucket: int, company: Company) -> int:
        """The length for a step whose forward `company` shares: the one that makes the whole
        batch fastest, (company's tokens + this request's) over (the batch's step + the time
        the length adds to a step without a call). A chain's drafter forwards and rows delay
        every request in the forward, so the tokens it wins must pay for the company's time
        too: a request's own rate would count the company's time as bought by nobody, and
        call more the bigger the batch. With no company (0 tokens, the time of a step without
        a call) and that step timed, this is `best`. Lengths are priced on what requests
        alone measured (steps in a batch are not timed: their time is the batch's). Where a
        step without a call was never timed, its time is the line through the timed lengths'
        at 0; with fewer than two lengths timed, no call."""
        tried = np.flatnonzero(self.tries[bucket] >= self.TRIES)
        ms = self.ms[bucket].copy()
        if 0 not in tried:
            if len(tried) < 2:
                return 0
            ms[0] = np.polyfit(tried, ms[tried], 1)[1]
            tried = np.concatenate([[0], tried])
        tokens = self.expected(bucket)
        if tokens[0] <= 0:      # no step without a call yet: its tokens as the model has them
            tokens[0] = 1.0 + self.ngram[bucket, 1:].sum()
        value = (company.tokens + tokens[tried]) / (company.ms + ms[tried] - ms[0])
        return int(tried[np.argmax(value)])

    def _around(self, bucket: int) -> list[int]:
        """The best length in `bucket` and its neighbours, best first."""
        best = self.best(bucket)
        return [k for k in (best, best - 1, best + 1) if 0 <= k <= self.LONGEST]

    def _due(self, bucket: int) -> bool:
        """Whether the next step of `bucket` starts an exploration run."""
        return (bucket not in self.runs and self.since[bucket] + 1 >= self.wait[bucket]
                and all(self.tries[bucket, k] >= self.TRIES for k in self._around(bucket)))

    def peek(self, bucket: int) -> int:
        """What `choose` will answer next in `bucket`, without counting a step."""
        if bucket in self.runs:
            return self.runs[bucket][0]
        around = self._around(bucket)
        for k in around:
            if self.tries[bucket, k] < self.TRIES:
                return k
        if self._due(bucket):
            return around[1 + self.explored[bucket] % (len(around) - 1)]
        return around[0]

    def pass_by(self, bucket: int) -> None:
        """A step of `bucket` ran without asking (its forward was queued ahead on the bet of
        no call): it counts towards the next exploration, or a policy that stopped calling
        would never explore again (measured: greedy `draft` ran whole generations without a
        call once its best length was 0). Where `choose` would have answered 0 (the bet was
        its answer), the step is that answer, bookkeeping included: an exploration of 0
        (the best being a call) queues every step ahead, so only steps passed by ran it, and
        it never ended (measured: sampled `draft` on the real pair and the fixture stopped
        calling for good after 9 steps, its best length 1 priced above 0 all along)."""
        if self.peek(bucket) == 0:
            self.choose(bucket)
        else:
            self.since[bucket] += 1

    def choose(self, bucket: int) -> int:
        k, due = self.peek(bucket), self._due(bucket)
        self.since[bucket] += 1
        if bucket in self.runs:
            left = self.runs.pop(bucket)[1] - 1
            if left > 0:
                self.runs[bucket] = (k, left)
        elif due:
            best = self.best(bucket)
            self.wait[bucket] = (min(2 * self.wait[bucket], self.EXPLORE_MAX)
                                 if best == self.found[bucket] else self.EXPLORE_EVERY)
            self.found[bucket], self.since[bucket] = best, 0
            self.explored[bucket] += 1
            self.runs[bucket] = (k, self.RUN - 1)
        return k

    def observe(self, bucket: int, length: int, tokens: int, ms: float,
                reach: Optional[Reach] = None, timed: bool = True) -> None:
        """A step in `bucket` that ran a chain of `length` (0: no call) committed `tokens` in
        `ms` (its wall time: drafting, verification, acceptance), timed if steady and not
        told otherwise; `reach`: how far its drafts matched what it committed (a chain
        step's). A step without a call is `timed` only inside a pipelined run (its forward
        queued by the step before, the next one queued by it): the last before a call
        reads a forward its predecessor paid for and queues none, and measured so the steps
        without a call looked faster than plain `ar` (11.1 against 12.1 ms a token)."""
        steady, self.last = length == self.last, length
        if length == 0:
            n = self.tries[bucket, 0] + 1
            self.plain[bucket] += max(self.EMA, 1.0 / n) * (tokens - self.plain[bucket])
            self.match[bucket] += self.RELAX * (self.usual[bucket] - self.match[bucket])
        elif reach is not None:
            self._learn_reach(bucket, reach)
        if not (steady and timed):
            return
        self.tries[bucket, length] += 1
        w = max(self.EMA, 1.0 / self.tries[bucket, length])
        self.ms[bucket, length] += w * (ms - self.ms[bucket, length])

    def _learn_reach(self, bucket: int, reach: Reach) -> None:
        """Each depth the chain was seen at matched or not; the n-gram drafts reached or not
        each depth. While no chain runs, the match rates drift back to their long-run values
        (RELAX, in `observe`): a bad stretch of text, which stopped the calls, would
        otherwise price them until the next exploration, up to EXPLORE_MAX steps later
        (measured: greedy `draft` ran 250-step stretches without calls, each followed by
        calls of 1 that ran at 0.094 tokens a ms against 0.078 without)."""
        self.chain_steps[bucket] += 1
        depth = np.arange(1, self.LONGEST + 1)
        w = max(self.EMA, 1.0 / self.chain_steps[bucket])
        self.ngram[bucket, 1:] += w * ((depth <= reach.ngram) - self.ngram[bucket, 1:])
        for d in range(1, min(reach.chain + 1, reach.seen) + 1):
            self.reached[bucket, d] += 1
            hit, n = d <= reach.chain, self.reached[bucket, d] + 1    # the prior: one step
            self.match[bucket, d] += max(self.EMA, 1.0 / n) * (hit - self.match[bucket, d])
            self.usual[bucket, d] += max(self.USUAL_EMA, 1.0 / n) * (hit - self.usual[bucket, d])


def _fill_forward(values: np.ndarray, first: float) -> np.ndarray:
    """`values` with each NaN replaced by the last value before it (`first` at the start)."""
    out, last = values.copy(), first
    for i, v in enumerate(out):
        if np.isnan(v):
            out[i] = last
        else:
            last = v
    return out


class Fallback:
    """When to decode plainly (docs/design.md §7.9): measured committed tokens per ms of tree
    steps against plain AR stretches, whichever is faster wins the next stretch. A sampled run
    accepts nothing on most steps, and a tree step's host work (the logits row, the history's
    log-probs, drafting, sizing) then costs more than a plain AR step; a stretch does exactly
    what `ar` does. Every PROBE tree steps the rates are compared: while AR is faster the next
    stretch runs, each twice as long as the last (to MAX_STRETCH, so the probes' cost fades,
    also across generations); once the tree is faster again, stretches restart short. A
    stretch also ends where the text starts to loop (the decoder checks the n-gram index), as
    long as tree steps begun inside a loop have not measured slower than AR (`loop_pays`).
    With `shadow` (drafts from the n-gram drafter alone), a stretch that ran to its end is
    followed by the next one at once, without probing, when the n-gram drafter's top guesses
    during it (`observe_shadow`) say a tree step cannot beat AR; a new generation then
    starts with a stretch too, once tree steps have measured slower (docs/design.md §7.9).
    The AR rate starts from the cost table's AR step and is then measured. Lives on the
    family (per regime and strategy): choices depend on measured times and the committed
    text, never on the target's logits."""

    PROBE = 4
    FIRST_STRETCH = 16
    MAX_STRETCH = 256
    EMA = 0.2

    def __init__(self, ar_ms: float, depth: int = 0):
        """`depth` > 0 turns on the shadow rule for trees of that depth."""
        self.tree = np.zeros(2)                 # moving averages of (tokens, ms) per tree step
        self.loop = np.zeros(2)                 # ... of tree steps begun inside a loop
        self.loop_steps = 0
        self.ar = np.array([1.0, ar_ms])        # ... per AR step, over stretches
        self.tree_steps = self.ar_stretches = 0
        self.since = 0                          # tree steps since the last decision
        self.stretch = self.FIRST_STRETCH
        self.depth = depth
        self.handed = 0                         # the length of the stretch handed out last
        self.ran = 0                            # ... and how many of its steps ran
        self.shadow = np.zeros(2)               # (hits, guesses) of the n-gram guess in it

    def new_text(self) -> None:
        """A generation starts. Where tree steps have measured slower, it starts with a
        stretch, as long as the last one handed out doubled (the probes' cost would otherwise
        restart with every generation: 16, 32 and 64-step stretches and their probes in each
        128-token reply); else stretches restart short."""
        self.since, self.handed = 0, 0
        if self.tree_steps >= self.PROBE and not self.faster():
            self.since = self.PROBE
        else:
            self.stretch = self.FIRST_STRETCH

    def observe_tree(self, tokens: int, ms: float, looping: bool = False,
                     measured: bool = True) -> None:
        """A tree step committed `tokens` in `ms`; `looping`: it began inside a loop. Not
        `measured`, it only counts towards the next decision."""
        self.since += 1
        if not measured:
            return
        self.tree_steps += 1
        step = np.array([tokens, ms])
        self.tree += max(self.EMA, 1.0 / self.tree_steps) * (step - self.tree)
        if looping:
            self.loop_steps += 1
            self.loop += max(self.EMA, 1.0 / self.loop_steps) * (step - self.loop)

    def loop_pays(self) -> bool:
        """Whether a stretch should end where the text starts to loop: tree steps begun inside
        a loop have measured faster than AR, or too few have been measured to tell."""
        return self.loop_steps < self.PROBE or self.loop[0] * self.ar[1] >= self.loop[1]

    def observe_ar(self, tokens: int, ms: float) -> None:
        """A stretch committed `tokens` in `ms` of wall time."""
        self.ran = tokens
        self.ar_stretches += 1
        w = max(0.5, 1.0 / self.ar_stretches)
        self.ar += w * (np.array([1.0, ms / tokens]) - self.ar)

    def faster(self) -> bool:
        """Whether tree steps have measured faster than AR steps."""
        return self.tree[0] * self.ar[1] >= self.tree[1]

    def observe_shadow(self, hit: bool) -> None:
        """A stretch's AR step: whether the n-gram drafter's top guess for it
        (NgramIndex.guess, made before the token was read) was the token."""
        self.shadow += (hit, 1)

    def shadow_says_ar(self) -> bool:
        """Whether the last stretch's guesses show that a tree step cannot beat AR: a
        chain of top guesses accepted at the stretch's hit rate h (Laplace-smoothed) commits
        (1 - h^(depth+1)) / (1 - h) tokens a step, which AR takes less time for than a tree
        step has measured. That chain bounds what sampled n-gram trees accept here (measured:
        0.09 drafts a tree step against h = 0.17), so the rule errs towards probing."""
        if not self.depth or self.tree_steps < self.PROBE:
            return False
        h = (self.shadow[0] + 1) / (self.shadow[1] + 2)
        tokens = (1 - h ** (self.depth + 1)) / (1 - h)
        return tokens * self.ar[1] < self.tree[1]

    def next_stretch(self) -> int:
        """AR steps to take now: 0 (a tree step) except every PROBE tree steps, when AR has
        measured faster, or right after a stretch whose guesses say so (shadow rule)."""
        ran_out = 0 < self.handed <= self.ran       # the last stretch ran to its end
        self.handed = 0
        if ran_out and self.shadow_says_ar():
            return self._stretch()
        if self.since < self.PROBE:
            return 0
        self.since = 0
        if self.faster():
            self.stretch = self.FIRST_STRETCH
            return 0
        return self._stretch()

    def _stretch(self) -> int:
        """Hand out the next stretch; the one after it is twice as long."""
        n, self.stretch = self.stretch, min(2 * self.stretch, self.MAX_STRETCH)
        self.handed, self.ran, self.shadow = n, 0, np.zeros(2)
        return n


@dataclass
class Learned:
    """What decoding learns about one family on this device while it runs, kept on the family
    across generations: the strong drafter's call policy and the plain-stretch fallback, one
    per decoding regime, tree shape and strategy."""

    call_policies: dict = field(default_factory=dict)
    fallbacks: dict = field(default_factory=dict)

    def call_policy(self, sampled: bool, tree: "TreeConfig", ngram: bool,
                    drafter: str) -> CallPolicy:
        """The call policy of a priced strategy (with or without the n-gram tree) and of the
        drafter whose chain it prices (the strong drafter, or the MTP head)."""
        return self.call_policies.setdefault((sampled, tree, ngram, drafter), CallPolicy())

    def fallback(self, sampled: bool, tree: "TreeConfig", strategy: str,
                 ar_ms: float, shadow: bool = False) -> Fallback:
        """The fallback of an adaptive strategy; its AR rate starts from `ar_ms`; `shadow`:
        its drafts come from the n-gram drafter alone (Fallback's shadow rule)."""
        return self.fallbacks.setdefault((sampled, tree, strategy),
                                         Fallback(ar_ms, tree.depth if shadow else 0))
