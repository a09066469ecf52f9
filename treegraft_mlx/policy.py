"""What each step runs: the one object the decoding loop asks before a step and tells after it.

The loop (decoder.py) asks `Policy.next` for a StepPlan (a tree and a chain to verify, one
AR step, or a plain stretch of AR steps), runs it, and tells the policy what it committed
(`Policy.learn`). The policy owns the tree build and everything that learns from measured
time: the Sizer (what a step verifies), the CallPolicy (how long the chain drafter's chain
runs), the Fallback (when to decode plainly) and the one clock they share. Deciding stays
apart from running so that a server can run several requests' plans through one forward
(docs/design.md §22). Decisions depend on measured times and the committed text, never on
the current step's target logits, so output stays exactly the target's.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from typing import Callable, Optional

import mlx.core as mx

from .build import TreeBuild
from .drafters import Drafters, QueuedChain
from .history import History
from .pricing import CallPolicy, Candidate, Company, Fallback, Sizer
from .sampling import DeviceDraws, SamplerSettings
from .scheduler import FixedSchedule, LearnedSchedule, Schedule
from .session import Session
from .step import StepStats
from .strategy import Strategy, needs_costs, needs_timing
from .timing import StepCosts, Timing
from .tree import DraftTree, Plan, prune, reach

NO_CALLS = FixedSchedule(frozenset())

VERIFY, AR, STRETCH = "verify", "ar", "stretch"     # what a StepPlan runs


@dataclass(frozen=True)
class StepPlan:
    """One step, decided before its forward: a tree (and a chain queued beside it) to verify,
    one AR step, or a plain stretch of AR steps."""

    runs: str                                 # VERIFY, AR or STRETCH
    tree: DraftTree                           # what a VERIFY step verifies
    built: DraftTree                          # what was drafted (an AR step may carry a child)
    chain: Optional[QueuedChain] = None       # the chain drafter's chain, on the device
    rows: int = 1                             # rows the forward runs (padded)
    layers: tuple[str, ...] = ()              # which drafter expanded each layer
    expected: float = 1.0                     # committed tokens the size choice expects
    chained: int = 0                          # drafts a chain grafted into the tree itself
    started: float = 0.0                      # the clock when planning began
    t_draft: float = 0.0                      # seconds planning took (drafting included)
    t_schedule: float = 0.0                   # ... of it spent deciding
    choice: Optional[tuple[int, int]] = None  # (bucket, chain length) the call policy learns
    looping: bool = False                     # planned inside a loop (Fallback.loop_pays)
    ahead: bool = False                       # an AR step: queue the next AR forward first
    stretch: int = 0                          # a STRETCH's AR steps
    offer: Optional[Candidate] = None         # the tree offered to a batch's joint plan
    draft_ms: Optional[float] = None          # ... and what drafting it cost (Sizer.settle)

    def stats(self, accepted: int, t_verify: float, t_accept: float) -> StepStats:
        """The step's statistics once it ran and `accepted` drafts."""
        k = len(self.chain) if self.chain is not None else 0
        return StepStats(accepted=accepted,
                         nodes_verified=len(self.tree) if self.runs == VERIFY else 1,
                         nodes_built=len(self.built) + k, layers=list(self.layers),
                         t_draft=self.t_draft, t_verify=t_verify, t_accept=t_accept,
                         t_schedule=self.t_schedule, rows=self.rows, expected=self.expected,
                         chain=self.chained + k)


class Policy:
    """Plans every step of a tree strategy and learns from each (see the module's docstring).
    Without a Sizer (a fixed budget, `chain:k`) every step verifies the built tree pruned to
    the budget, the paper's way."""

    def __init__(self, session: Session, strategy: Strategy, settings: SamplerSettings,
                 drafters: Drafters, key: Callable[[], mx.array], schedule: Schedule,
                 sizer: Optional[Sizer] = None, calls: Optional[CallPolicy] = None,
                 fallback: Optional[Fallback] = None):
        self.session, self.strategy, self.settings = session, strategy, settings
        self.drafters, self.key, self.schedule = drafters, key, schedule
        self.sizer, self.calls, self.fallback = sizer, calls, fallback
        self.chainer = drafters.mtp if strategy.mtp_chain else drafters.strong
        self.clock = session.family.clock
        self._since: Optional[float] = None    # when the last tree step ended (None: not one)
        self._ran = (0, 0.0, 0.0, 0.0)          # the stretch running (begin_stretch)

    def new_text(self) -> None:
        """A generation starts (Fallback.new_text)."""
        self._since = None
        if self.fallback is not None:
            self.fallback.new_text()

    def next(self, root: int, carried: Optional[DraftTree], in_flight: bool,
             joint: bool = False, company: Optional[Company] = None) -> StepPlan:
        """The step after `root` (`carried`: the drafts below it kept from the last step;
        `in_flight`: its AR forward is already queued, so the step reads it). `joint`: a
        batch sizes every request's tree together, so a sized step verifying drafts offers
        its whole tree (StepPlan.offer) and is completed by `sized`; `company`: the other
        requests of that batch, against whom a chain drafter's call is priced
        (CallPolicy.shared)."""
        t0 = self.clock()
        if self.sizer is None:
            return self._fixed(root, t0)
        if carried is None and self.fallback is not None and (n := self.fallback.next_stretch()):
            empty = DraftTree.rooted_at(root)
            return StepPlan(STRETCH, empty, empty, stretch=n, started=t0)
        history = self.session.history
        looping = self.session.ngram.index.repeats(history.tokens)
        fresh = carried is None and self.sizer.worth_drafting()   # run the n-gram drafter
        choice, chain, t_schedule, plan = None, None, 0.0, None
        if carried is not None:
            built, layers = carried, []
        elif self.calls is not None:
            build, plan, choice, chain = self._priced_build(
                root, fresh and self.strategy.ngram, in_flight, company)
            built, layers, t_schedule = build.tree, build.used, build.t_schedule
            fresh = fresh and chain is None   # the sizer prices n-gram drafting without calls
        elif fresh:
            build = self._build(root)
            built, layers, t_schedule = build.tree, build.used, build.t_schedule
        else:
            built, layers = DraftTree.rooted_at(root), []
        k = len(chain) if chain is not None else 0
        common = dict(built=built, layers=tuple(layers), started=t0, t_schedule=t_schedule,
                      choice=choice, looping=looping)
        if joint and not in_flight and (len(built) > 1 or k):
            t1 = self.clock()
            return StepPlan(VERIFY, built, chain=chain, t_draft=t1 - t0,
                            offer=self.sizer.candidate(built, history.committed, k),
                            draft_ms=1000 * (t1 - t0) if fresh else None, **common)
        if plan is None:
            plan = self.sizer.plan(built, history.committed)
        t1 = self.clock()
        self.sizer.settle(plan, 1000 * (t1 - t0) if fresh else None)
        tree = built.subtree(plan.keep)
        common.update(expected=plan.expected, t_draft=t1 - t0)
        if not in_flight and (len(tree) > 1 or k):
            return StepPlan(VERIFY, tree, chain=chain,
                            rows=self.sizer.costs.rows_for(len(tree) + k), **common)
        calls_next = self.calls is not None and (
            self.calls.shared(0, company) if company is not None else self.calls.peek(0)) > 0
        ahead = len(tree) == 1 and not calls_next
        return StepPlan(AR, tree, ahead=ahead, **common)

    def sized(self, plan: StepPlan, sized: Plan) -> StepPlan:
        """A plan that offered its tree to a batch's joint plan (`offer`), with what the joint
        plan kept of it (pricing.plan_jointly): the Sizer settles on it as on its own plan."""
        self.sizer.settle(sized, plan.draft_ms)
        tree = plan.built.subtree(sized.keep)
        k = len(plan.chain) if plan.chain is not None else 0
        return dataclasses.replace(plan, tree=tree, rows=len(tree) + k, expected=sized.expected,
                                   offer=None)

    def _fixed(self, root: int, t0: float) -> StepPlan:
        """The built tree pruned to the fixed budget; `chain:k`'s chain of k, queued."""
        cfg, history = self.session.tree, self.session.history
        build = self._build(root)
        tree = build.tree.subtree(prune(build.tree, cfg.budget))
        chain = (self.drafters.strong.queue_chain(root, self.strategy.chain_k, history)
                 if self.strategy.kind == "chain" else None)
        k = len(chain) if chain is not None else 0
        return StepPlan(VERIFY, tree, build.tree, chain, cfg.rows_for(len(tree) + k),
                        tuple(build.used), expected=0.0, chained=build.chain, started=t0,
                        t_draft=self.clock() - t0, t_schedule=build.t_schedule)

    def _build(self, root: int) -> TreeBuild:
        """The strategy's tree: the n-gram drafter's layers (the strong drafter's where the
        schedule calls it), then the chain drafter's chain grafted from the root."""
        cfg, history = self.session.tree, self.session.history
        build = TreeBuild.rooted_at(root)
        if self.strategy.kind == "chain":       # its chain is queued with the verification
            return build
        if self.strategy.ngram:
            build.expand(range(1, cfg.depth + 1), self.schedule, self.drafters, cfg, history)
        if self.strategy.strong_chain or self.strategy.mtp_chain:
            build.graft_chain(self.chainer, cfg.depth, cfg, history)
        return build

    def _priced_build(self, root: int, ngram: bool, in_flight: bool,
                      company: Optional[Company] = None
                      ) -> tuple[TreeBuild, Plan, Optional[tuple[int, int]],
                                 Optional[QueuedChain]]:
        """The n-gram tree, planned by the Sizer, and the chain drafter's chain of the length
        the call policy picks for the n-gram plan's bucket, queued on the device (the plan
        then prices the tree's rows beside the chain's); returned with (bucket, length)
        for the policy to learn from, or None where the call first synced a long lag
        (committed tokens the drafter had not seen: after a plain stretch), whose cost is the
        stretch's, not the call's. No call while the root's forward is `in_flight`: the
        drafter's forward would wait for it on the same stream and leave the next forward
        unqueued. With `company` (a batch), the length is priced against the batch's shared
        forward (CallPolicy.shared) and the step teaches the call policy nothing: its time
        is the batch's, not this request's."""
        cfg, history = self.session.tree, self.session.history
        build = TreeBuild.rooted_at(root)
        if ngram:
            build.expand(range(1, cfg.depth + 1), NO_CALLS, self.drafters, cfg, history)
        plan = self.sizer.plan(build.tree, history.committed)
        t0 = self.clock()
        bucket = self.calls.bucket(plan.expected)
        k = 0
        if company is not None:
            k = 0 if in_flight else self.calls.shared(bucket, company)
        elif in_flight:
            self.calls.pass_by(bucket)
        else:
            k = self.calls.choose(bucket)
        build.t_schedule = self.clock() - t0       # the policy's own work
        steady = self.chainer.lag(history) <= self.calls.STEADY_LAG
        chain = None
        if k:
            draws = None if self.settings.greedy else DeviceDraws(self.settings, self.key())
            chain = self.chainer.queue_chain(root, k, history, draws)
            build.used.append(self.chainer.name)
            if chain is not None:
                plan = self.sizer.plan(build.tree, history.committed, chain=len(chain))
        choice = (bucket, len(chain) if chain is not None else 0)
        learns = company is None and (steady or chain is None)
        return build, plan, choice if learns else None, chain

    def learn(self, plan: StepPlan, block: list[int], timed: bool = True) -> None:
        """`plan` committed `block` (the tokens after its root). The fallback and the call
        policy learn its rate. The step's time runs from the end of the step before it, if
        that was a tree step: what the caller did with that step's tokens is part of the
        cost, and a step of one token pays it as often as a step of many. The first tree step
        after the prefill or a stretch also catches up with what they committed (scoring its
        rows, syncing the drafter's cache): it prices the switch, not tree steps, and the
        fallback does not measure it. An AR step is `timed` for the call policy only inside
        a pipelined run (CallPolicy.observe)."""
        if self.sizer is None:
            return
        now, steady = self.clock(), self._since is not None
        ms = 1000 * (now - (self._since if steady else plan.started))
        self._since = now
        if self.fallback is not None:
            self.fallback.observe_tree(len(block), ms, plan.looping, steady)
        if plan.choice is not None:
            k = len(plan.chain) if plan.chain is not None else 0
            matched = reach(plan.tree, len(plan.tree) - k, block) if k else None
            self.calls.observe(*plan.choice, len(block), ms, matched, timed)

    # A plain stretch (the decoder's pipelined AR steps), watched and measured for the
    # fallback. Its first step is not measured: it starts the pipeline and catches up with
    # the tree steps' queued work, which prices the switch, not AR steps (as the first tree
    # step after a stretch is not measured either: `learn`).

    def begin_stretch(self) -> None:
        self._since = None
        self._ran = (0, self.clock(), 0.0, 0.0)     # steps, start, first step's end, last's

    def guess(self, history: History) -> Optional[int]:
        """The n-gram drafter's top guess for the next token, where a stretch checks it."""
        return self.session.ngram.index.guess(history.tokens) if self.fallback else None

    def saw_ar(self, guess: Optional[int], token: int) -> None:
        """A stretch's AR step committed `token`; `guess` was made before it was read."""
        if self.fallback is not None:
            self.fallback.observe_shadow(guess == token)
        done, t0, first, _ = self._ran
        busy = self.clock() - t0                  # the caller's time included
        self._ran = (done + 1, t0, first or busy, busy)

    def ends_stretch(self, history: History) -> bool:
        """Whether a stretch ends here: the text starts to loop, where loops have paid."""
        return (self.fallback is not None and self.session.ngram.index.repeats(history.tokens)
                and self.fallback.loop_pays())

    def end_stretch(self) -> None:
        """The stretch ended (also where the caller stopped inside it)."""
        done, _, first, busy = self._ran
        if done > 1 and self.fallback is not None:
            self.fallback.observe_ar(done - 1, 1000 * (busy - first))


def drafters_for(session: Session, strategy: Strategy) -> Drafters:
    """The session's drafters that `strategy` runs."""
    return Drafters(session.ngram, session.strong if strategy.needs_strong else None,
                    session.mtp if strategy.mtp_chain else None)


def make_policy(session: Session, strategy: Strategy, settings: SamplerSettings,
                drafters: Drafters, key: Callable[[], mx.array],
                schedule: Optional[Schedule] = None, costs: Optional[StepCosts] = None,
                timing: Optional[Timing] = None) -> Policy:
    """The policy of a tree strategy, with what the family learned so far. `costs`: this
    device's step costs (probe.step_costs), needed by adaptive trees; `timing`: the learned
    scheduler's T_tgt/T_mid (probe.scheduler_timing), needed by `treegraft-learned` where
    the family has a scheduler."""
    family, sampled = session.family, not settings.greedy
    chosen = schedule if schedule is not None else FixedSchedule(strategy.combine_layers)
    if schedule is None and needs_timing(strategy, session, settings, schedule):
        if timing is None:
            raise ValueError("the learned scheduler needs this device's timing "
                             "(probe.scheduler_timing)")
        mlp, meta = family.scheduler(sampled)
        chosen = LearnedSchedule(mlp, timing.t_tgt_ms, timing.t_mid_ms, meta["b0"])
    if not needs_costs(strategy, session.tree):
        return Policy(session, strategy, settings, drafters, key, chosen)
    if costs is None:
        raise ValueError("an adaptive tree needs this device's step costs (probe.step_costs)")
    sizer = Sizer(family.acceptance, costs, session.tree, sampled=sampled)
    chainer = drafters.mtp if strategy.mtp_chain else drafters.strong
    # What each chain length measured keeps learning across generations, per regime, tree
    # shape and strategy (with or without the n-gram tree).
    calls = (family.learned.call_policy(sampled, session.tree, strategy.ngram, chainer.name)
             if strategy.priced and schedule is None else None)
    # Plain stretches, for strategies with n-gram trees: without one (`draft`, `mtp`) a step
    # with no call is already a pipelined AR step, which the call policy measures beside its
    # chains (length 0), steady, with no stretch's catch-up in between.
    fallback = (family.learned.fallback(sampled, session.tree, strategy.name, costs.ar_ms,
                                        shadow=strategy.ngram_only)
                if strategy.ngram else None)
    return Policy(session, strategy, settings, drafters, key, chosen, sizer, calls, fallback)
