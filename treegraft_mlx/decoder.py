"""The decoding loop: draft tree (drafters) -> size -> verify (target) -> accept -> compact.

Every strategy (strategy.py) is a generator of committed token blocks: the prefill's token,
then one block per target forward (the drafts it accepted and its bonus token), so stopping,
streaming and statistics are shared (generate.stream). A step's forward, acceptance and
commit live in step.py.

Tree strategies size every step (Sizer, docs/design.md §7): the step verifies the subtree
its drafts are worth on this device, the root alone being a pipelined AR step. With
`TreeConfig(adaptive=False)` every step prunes to the fixed budget instead (the paper's way).
What the sizing and the call policy learn while running (the worth of drafting, of a call)
follows measured drafting times, so a seeded sampled run can differ between runs (never in
its distribution); a fixed budget repeats exactly.
"""

from __future__ import annotations

from typing import Callable, Iterator, Optional

import mlx.core as mx
import numpy as np

from .build import TreeBuild
from .drafters import Drafters, QueuedChain
from .history import History
from .pricing import CallPolicy, Fallback, Sizer
from .sampling import DeviceDraws, SamplerSettings
from .scheduler import FixedSchedule, LearnedSchedule, Schedule
from .session import Session
from .step import AR_STEP, ArForward, Queued, StepStats, tree_step
from .strategy import Strategy, for_family, needs_costs, needs_timing
from .timing import StepCosts, Timing
from .tree import SOURCES, DraftTree, Plan, Reach, prune, reach
from .verify import Acceptance

NO_CALLS = FixedSchedule(frozenset())
TARGET = "target"   # the source of a token the target produced itself (Decoder.sources)


class Decoder:
    """Runs one generation of a strategy on a session; records StepStats per step, and
    where each committed token came from in `sources` (one entry per token, in order:
    "target" for the prefill's token and every bonus or AR token, else the drafters that
    proposed the accepted draft: "ngram", "draft" (the strong drafter) or "both")."""

    def __init__(self, session: Session, strategy: Strategy, settings: SamplerSettings,
                 rng: np.random.Generator, schedule: Optional[Schedule] = None,
                 costs: Optional[StepCosts] = None, timing: Optional[Timing] = None,
                 trace: Optional[Callable[[str], None]] = None):
        """`costs`: this device's step costs (probe.step_costs), needed by adaptive tree
        strategies; `timing`: the learned scheduler's T_tgt/T_mid (probe.scheduler_timing),
        needed by `treegraft-learned` when the family has a scheduler; `trace` receives one
        line per step and per stretch decision."""
        strategy = for_family(strategy, session.strong is not None, session.mtp is not None)
        self.session, self.strategy, self.settings, self.rng = session, strategy, settings, rng
        self.trace = trace
        self.target = session.family.target
        self.clock = session.family.clock
        if strategy.needs_strong and session.strong is None:
            raise ValueError(f"strategy {strategy.name!r} needs a strong drafter; the family has none")
        if strategy.mtp_chain and session.mtp is None:
            raise ValueError(f"strategy {strategy.name!r} needs the target's multi-token-"
                             "prediction head (Qwen 3.5 / Qwen3-Next `mtp.*` weights, which "
                             "mlx_lm's converter drops); this target has none")
        if (strategy.combine_layers or strategy.learned) and getattr(strong_model(session),
                                                                     "RECURRENT", False):
            raise ValueError(f"strategy {strategy.name!r} expands tree layers with the strong "
                             "drafter, which a hybrid (recurrent) drafter cannot rewind: use "
                             "draft, treegraft or chain")
        self.drafters = Drafters(session.ngram, session.strong if strategy.needs_strong else None,
                                 session.mtp if strategy.mtp_chain else None)
        # The drafter whose chain a step grafts from the root: the MTP head or S.
        self.chainer = self.drafters.mtp if strategy.mtp_chain else self.drafters.strong
        self.schedule: Schedule = FixedSchedule(strategy.combine_layers)
        family = session.family
        if schedule is not None:
            self.schedule = schedule
        elif needs_timing(strategy, session, settings, schedule):
            if timing is None:
                raise ValueError("the learned scheduler needs this device's timing "
                                 "(probe.scheduler_timing)")
            mlp, meta = family.scheduler(not settings.greedy)
            self.schedule = LearnedSchedule(mlp, timing.t_tgt_ms, timing.t_mid_ms, meta["b0"])
        self.sizer: Optional[Sizer] = None
        if needs_costs(strategy, session.tree):
            if costs is None:
                raise ValueError("an adaptive tree needs this device's step costs "
                                 "(probe.step_costs)")
            self.sizer = Sizer(family.acceptance, costs, session.tree, sampled=not settings.greedy)
        self.calls: Optional[CallPolicy] = None
        if self.sizer is not None and strategy.priced and schedule is None:
            # What each chain length measured keeps learning across generations, per regime,
            # tree shape and strategy (with or without the n-gram tree).
            self.calls = family.learned.call_policy(not settings.greedy, session.tree,
                                                    strategy.ngram, self.chainer.name)
        # Plain stretches, for strategies with n-gram trees: without one (`draft`, `mtp`) a
        # step with no call is already a pipelined AR step, which the call policy measures
        # beside its chains (length 0), steady, with no stretch's catch-up in between.
        self.fallback: Optional[Fallback] = None
        if self.sizer is not None and strategy.ngram:
            self.fallback = family.learned.fallback(
                not settings.greedy, session.tree, strategy.name, costs.ar_ms,
                shadow=strategy.ngram_only)
        self.stats: list[StepStats] = []
        self.sources: list[str] = []
        self._since: Optional[float] = None   # when the last tree step ended (None: not the last)
        self._calls_before = self._drafter_forwards()

    def _drafter_forwards(self) -> int:
        return sum(getattr(d, "calls", 0) for d in self.drafters.all)

    @property
    def drafter_calls(self) -> int:
        """Model-drafter forwards (strong drafter, MTP head) this generation ran."""
        return self._drafter_forwards() - self._calls_before

    def _record(self, stats: StepStats) -> None:
        """Keep a finished step's statistics, and trace it when tracing."""
        self.stats.append(stats)
        if self.trace is not None:
            self.trace(stats.trace(len(self.stats)))

    def _by_target(self, token: int) -> list[int]:
        """The block of one token the target produced itself (the prefill's, an AR step's)."""
        self.sources.append(TARGET)
        return [token]

    def steps(self, prompt_ids: list[int]) -> Iterator[list[int]]:
        # The first block is the prefill's token, out at once (the prompt rows' scores stay
        # deferred until a drafter reads them); every later block is what one target forward
        # committed: accepted drafts, then the bonus.
        root = self.session.prefill(prompt_ids, self.settings, self.rng)
        if self.strategy.kind == "ar":
            yield from self._ar_steps(root)
            return
        yield self._by_target(root)
        if self.sizer is not None:
            yield from self._adaptive_steps(root)
        else:
            yield from self._tree_steps(root)

    def _key(self) -> mx.array:
        """A device random key drawn from the generation's seeded generator."""
        return mx.random.key(int(self.rng.integers(2**31)))

    def _forward(self) -> "ArForward":
        return ArForward(self.target, self.session.cache, self.settings, self._key(),
                         self.session.saw, scores=self._scored is not None)

    @property
    def _scored(self) -> Optional[History]:
        """The history, where this strategy scores it (Strategy.scores_history)."""
        return self.session.history if self.strategy.scores_history else None

    def _ar_steps(self, root: int) -> Iterator[list[int]]:
        """`ar`: the prefill's token, out before any forward is queued (on MLX's CPU backend
        queuing a forward runs much of it, which the time to first token would otherwise
        pay), then AR steps without end."""
        yield self._by_target(root)
        yield from self._pipelined(root, self._forward(), None, None)

    def _build(self, root: int, history: History) -> "TreeBuild":
        cfg = self.session.tree
        build = TreeBuild.rooted_at(root)
        if self.strategy.kind == "chain":       # its chain is queued with the verification
            return build
        if self.strategy.ngram:
            build.expand(range(1, cfg.depth + 1), self.schedule, self.drafters, cfg, history)
        if self.strategy.strong_chain or self.strategy.mtp_chain:
            build.graft_chain(self.chainer, cfg.depth, cfg, history)
        return build

    def _tree_steps(self, root: int) -> Iterator[list[int]]:
        """Every step verifies the built tree pruned to the fixed budget (the paper's way)."""
        history = self.session.history
        while True:
            t0 = self.clock()
            build = self._build(root, history)
            tree = build.tree.subtree(prune(build.tree, self.session.tree.budget))
            chain = (self.drafters.strong.queue_chain(root, self.strategy.chain_k, history)
                     if self.strategy.kind == "chain" else None)
            k = len(chain) if chain is not None else 0
            rows = self.session.tree.rows_for(len(tree) + k)
            block, acc = self._verify(tree, rows, chain, nodes_built=len(build.tree) + k,
                                      layers=build.used, t_draft=self.clock() - t0,
                                      t_schedule=build.t_schedule, expected=0.0,
                                      chained=build.chain)
            yield block
            root = acc.bonus

    def _adaptive_steps(self, root: int) -> Iterator[list[int]]:
        """Every step verifies the subtree its drafts are worth (Sizer); the root alone is an
        AR step, pipelined as `ar` is: while the root's forward runs, the next one is already
        queued on the bet that it is an AR step too, and the drafts for it are built. When
        they are worth verifying after all, the queued forward has verified their root: the
        child it confirms keeps its subtree for the next step."""
        history, forward = self.session.history, self._forward()
        queued: Optional[Queued] = None        # the forward of `root`, in flight
        fallback = self.fallback
        if fallback is not None:
            fallback.new_text()
        self._since = None
        carried: Optional[DraftTree] = None    # drafts below `root` kept from the last step
        while True:
            if carried is None and fallback is not None and (n := fallback.next_stretch()):
                if self.trace is not None:
                    self.trace(f"stretch of {n} AR steps")
                root, queued = yield from self._pipelined(root, forward, queued, n)
                continue
            t0 = self.clock()
            looping = self.session.ngram.index.repeats(history.tokens)   # Fallback.loop_pays
            choice: Optional[tuple[int, int]] = None   # (bucket, chain length) of a priced build
            chain: Optional[QueuedChain] = None        # its chain, queued on the device
            # Whether to run the n-gram drafter (a priced build still asks the call policy).
            fresh = carried is None and self.sizer.worth_drafting()
            if carried is not None:
                full, used, t_schedule = carried, [], 0.0
                plan = self.sizer.plan(carried, history.committed)
            elif self.calls is not None:
                build, plan, choice, chain = self._priced_build(
                    root, history, ngram=fresh and self.strategy.ngram,
                    in_flight=queued is not None)
                full, used, t_schedule = build.tree, build.used, build.t_schedule
                fresh = fresh and chain is None  # the sizer prices n-gram drafting without calls
            elif not fresh:
                full, used, t_schedule = DraftTree.rooted_at(root), [], 0.0
                plan = self.sizer.plan(full, history.committed)
            else:
                build = self._build(root, history)
                full, used, t_schedule = build.tree, build.used, build.t_schedule
                plan = self.sizer.plan(full, history.committed)
            carried = None
            k = len(chain) if chain is not None else 0
            t1 = self.clock()
            self.sizer.settle(plan, 1000 * (t1 - t0) if fresh else None)
            if queued is None and (len(plan.keep) > 1 or k):
                tree = full.subtree(plan.keep)
                rows = self.sizer.costs.rows_for(len(tree) + k)
                block, acc = self._verify(tree, rows, chain, nodes_built=len(full) + k,
                                          layers=used, t_draft=t1 - t0, t_schedule=t_schedule,
                                          expected=plan.expected)
                self._learn(choice, block, t0, looping,
                            reach(tree, len(tree) - k, block) if k else None)
                yield block
                root = acc.bonus
                continue
            ahead = queued is not None           # its forward was queued by the step before
            if queued is None:
                queued = forward(mx.array(root))
            after = (forward(queued.token)
                     if len(plan.keep) == 1 and not self._calls_next() else None)
            nxt = queued.read(self._scored)
            t2 = self.clock()
            history.extend([nxt])
            self.drafters.observe(history, 1)
            self._record(StepStats(
                accepted=0, nodes_verified=1, nodes_built=len(full), layers=used,
                t_draft=t1 - t0, t_verify=t2 - t1, t_accept=self.clock() - t2,
                t_schedule=t_schedule, rows=1, expected=plan.expected))
            # Timed for the call policy only inside a pipelined run (CallPolicy.observe).
            self._learn(choice, [nxt], t0, looping, timed=ahead and after is not None)
            yield self._by_target(nxt)
            if after is None and (c := full.child(0, nxt)) >= 0:
                carried = full.rerooted(c)
            root, queued = nxt, after

    def _learn(self, choice: Optional[tuple[int, int]], block: list[int], t0: float,
               looping: bool, matched: Optional[Reach] = None, timed: bool = True) -> None:
        """A tree step that began at `t0` (inside a loop, if `looping`) committed `block`: the
        fallback and the call policy (for the `choice` of a priced build; with how far a
        chain step's drafts `matched` the block) learn its rate. The
        step's time runs from the end of the step before it, if that was a tree step: what
        the caller did with that step's tokens is part of the cost, and a step of one token
        pays it as often as a step of many. The first tree step after the prefill or a
        stretch also catches up with what they committed (scoring its rows, syncing the
        drafter's cache): it prices the switch, not tree steps, and the fallback does not
        measure it (measured: greedy `draft` then found its chains slower than AR, 0.062
        against 0.064 tokens a ms, while its steady chains ran at 0.073)."""
        now, steady = self.clock(), self._since is not None
        ms = 1000 * (now - (self._since if steady else t0))
        self._since = now
        if self.fallback is not None:
            self.fallback.observe_tree(len(block), ms, looping, steady)
        if choice is not None:
            self.calls.observe(*choice, len(block), ms, matched, timed)

    def _pipelined(self, root: int, forward: ArForward, queued: Optional[Queued],
                   steps: Optional[int]) -> Iterator[list[int]]:
        """Up to `steps` AR steps (None: without end), pipelined like mlx_lm: the next
        forward is queued (async_eval) before the current token is read back, with its score
        where the history is scored (one wait a step). Continues a `queued` forward of
        `root`, if any. Returns the new root and its forward, already in flight, so no run
        ends in an idle device (measured: 38 stretches in 8 sampled generations).

        Inside a tree strategy this is a plain stretch (Fallback): it ends early where the
        text starts to loop (its last n_max tokens occurred before: n-gram drafts may pay
        again), the n-gram drafter's guess is checked against each token meanwhile
        (Fallback.observe_shadow), and what ran is measured, also when the caller stops
        inside it. The stretch's first step is not measured: it starts the pipeline (its
        forward was not queued ahead) and catches up with what the tree steps left queued,
        which prices the switch, not AR steps, as the first tree step after a stretch is not
        measured either (Decoder._learn); one slow first step had set the AR rate for good."""
        history, fallback, index = self.session.history, self.fallback, self.session.ngram.index
        done, busy, first, t0 = 0, 0.0, 0.0, self.clock()
        self._since = None
        try:
            queued = queued or forward(mx.array(root))
            while steps is None or done < steps:
                after = forward(queued.token)
                guess = index.guess(history.tokens) if fallback else None   # while it runs
                nxt = queued.read(self._scored)
                history.extend([nxt])
                if fallback is not None:
                    fallback.observe_shadow(guess == nxt)
                    self.drafters.observe(history, 1)
                self._record(AR_STEP)
                done, busy = done + 1, self.clock() - t0   # the caller's time included
                first = first or busy
                yield self._by_target(nxt)
                queued = after
                if fallback and index.repeats(history.tokens) and fallback.loop_pays():
                    break           # the text loops: drafts may pay again; probe the tree
        finally:
            if done > 1 and fallback is not None:
                fallback.observe_ar(done - 1, 1000 * (busy - first))
        return history.root, queued

    def _calls_next(self) -> bool:
        """Whether the next step will likely call the strong drafter: then its forward is not
        queued ahead, since a call waits for a forward in flight on the same stream. Judged
        for an empty n-gram tree (`draft` never has another)."""
        return self.calls is not None and self.calls.peek(0) > 0

    def _priced_build(self, root: int, history: History, ngram: bool, in_flight: bool
                      ) -> tuple["TreeBuild", Plan, Optional[tuple[int, int]],
                                 Optional[QueuedChain]]:
        """The n-gram tree, planned by the Sizer, and the chain drafter's chain of the length
        the call policy picks for the n-gram plan's bucket, queued on the device (the plan
        then prices the tree's rows beside the chain's); returned with (bucket, length) for
        the policy to learn from, or None where the call first synced a long lag (committed
        tokens the drafter had not seen: after a plain stretch), whose cost is the
        stretch's, not the call's. No call while the root's forward is `in_flight`: the
        drafter's forward would wait for it on the same stream and leave the next forward
        unqueued (measured: 17.7 ms a call against 2.8)."""
        cfg, sizer = self.session.tree, self.sizer
        build = TreeBuild.rooted_at(root)
        if ngram:
            build.expand(range(1, cfg.depth + 1), NO_CALLS, self.drafters, cfg, history)
        plan = sizer.plan(build.tree, history.committed)
        t0 = self.clock()
        bucket = self.calls.bucket(plan.expected)
        k = 0
        if in_flight:
            self.calls.pass_by(bucket)
        else:
            k = self.calls.choose(bucket)
        build.t_schedule = self.clock() - t0       # the policy's own work
        steady = self.chainer.lag(history) <= self.calls.STEADY_LAG
        chain = None
        if k:
            draws = None if self.settings.greedy else DeviceDraws(self.settings, self._key())
            chain = self.chainer.queue_chain(root, k, history, draws)
            build.used.append(self.chainer.name)
            if chain is not None:
                plan = sizer.plan(build.tree, history.committed, chain=k)
        choice = (bucket, len(chain) if chain is not None else 0)
        return build, plan, choice if steady or chain is None else None, chain

    def _verify(self, tree: DraftTree, rows: int, chain: Optional[QueuedChain],
                **stats) -> tuple[list[int], Acceptance]:
        """Verify `tree` (and a `chain` queued beside it) in one forward of `rows` rows,
        accept, commit (tree_step), and record the step's StepStats (`stats`: what the build
        knew; `chained`: drafts a chain grafted into the tree itself). Returns the committed tokens after the root (accepted drafts, then the
        bonus)."""
        step = tree_step(self.session, self.drafters, tree, rows, self.settings, self.rng,
                         self.clock, chain, self.strategy.scores_history)
        chained = stats.pop("chained", 0) + (len(chain) if chain is not None else 0)
        drafted = step.acceptance.path[1:]
        self.sources += [SOURCES[tree.drafted_by[v]] for v in drafted] + [TARGET]
        self._record(StepStats(accepted=len(drafted), nodes_verified=len(tree), rows=rows,
                               t_verify=step.t_verify, t_accept=step.t_accept,
                               chain=chained, **stats))
        return step.block, step.acceptance


def strong_model(session: Session):
    """The strong drafter's model, or None."""
    return session.strong.model if session.strong is not None else None


