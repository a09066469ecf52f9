"""The decoding loop: ask the policy for a step, run its forward, commit, tell the policy.

Every strategy is a generator of committed token blocks: the prefill's token, then one block
per target forward (its accepted drafts and bonus), so stopping, streaming and statistics are
shared (generate.stream). The policy (policy.py) plans each step; step.py runs a tree step.
AR steps are pipelined as in `mlx_lm`: the next forward is queued before a token is read.

Decoding `together` (batch.py), the same loop also yields what its forwards and reads want
(parts.py: a RequestBlock, then a Read, before each committed block; first, where the step
verifies drafts it sized, its tree offered to the batch's joint plan), so a batch runs them
with other requests'. AR steps stay pipelined there: the next row (its lazy token's) is
yielded into the batch's next forward before the current token's Read, so a batch of AR
requests waits once a step with the next forward queued, as one request alone does. A batch
may switch `together` between steps (a request alone in it decodes as alone); a forward in
flight at the switch is carried on either side, never run again.
"""

from __future__ import annotations

from functools import partial
from itertools import count
from typing import Callable, Iterator, Optional

import mlx.core as mx
import numpy as np

from .history import History
from .policy import STRETCH, VERIFY, Policy, StepPlan, drafters_for, make_policy
from .pricing import Company
from .sampling import SamplerSettings, device_key
from .scheduler import Schedule
from .session import Session
from .parts import Part, Read, alone
from .step import AR_STEP, ArForward, Queued, StepStats, tree_part
from .strategy import Strategy, runs_on
from .timing import StepCosts, Timing
from .tree import SOURCES, DraftTree

TARGET = "target"   # the source of a token the target produced itself (Decoder.sources)


class Decoder:
    """Runs one generation of a strategy on a session. Records StepStats per step, and in
    `sources` where each committed token came from: TARGET for the target's own tokens (the
    prefill's, every bonus and AR token), else the drafters of the accepted draft (tree.SOURCES)."""

    def __init__(self, session: Session, strategy: Strategy, settings: SamplerSettings,
                 rng: np.random.Generator, schedule: Optional[Schedule] = None,
                 costs: Optional[StepCosts] = None, timing: Optional[Timing] = None,
                 trace: Optional[Callable[[str], None]] = None, together: bool = False):
        strategy = runs_on(strategy, session.family)
        self.together = together
        self.company: Optional[Company] = None   # the others in the batch (batch.py sets it)
        self.session, self.strategy, self.settings, self.rng = session, strategy, settings, rng
        self.trace, self.clock = trace, session.family.clock
        self._key = partial(device_key, rng)   # device random keys from the seeded generator
        self.drafters = drafters_for(session, strategy)
        self.policy: Optional[Policy] = None if strategy.kind == "ar" else make_policy(
            session, strategy, settings, self.drafters, self._key, schedule, costs, timing)
        self.stats: list[StepStats] = []
        self.sources: list[str] = []
        self._calls_before = self.drafters.forwards()

    @property
    def drafter_calls(self) -> int:
        """Model-drafter forwards (strong drafter, MTP head) this generation ran."""
        return self.drafters.forwards() - self._calls_before

    @property
    def _scored(self) -> Optional[History]:   # where AR tokens' scores come with them
        return self.session.history if self.strategy.scores_history else None

    def _record(self, stats: StepStats, sources: list[str]) -> None:
        """Keep a finished step's statistics and its tokens' sources; trace it if tracing."""
        self.stats.append(stats)
        self.sources += sources
        if self.trace is not None:
            self.trace(stats.trace(len(self.stats)))

    def _run(self, part: Part):
        """A step part (parts.py): by itself, or, `together`, yielding its wants to the batch."""
        if self.together:
            return (yield from part)
        return alone(self.session.family.target, part)

    def steps(self, prompt_ids: list[int]) -> Iterator[list[int]]:
        # The prefill's token is out before a forward is queued (a CPU runs what it queues).
        root = yield from self._run(self.session.prefill_part(prompt_ids, self.settings,
                                                              self.rng))
        self.sources.append(TARGET)
        yield [root]
        forward = ArForward(self.session.family.target, self.session.cache, self.settings,
                            self._key(), self.session.saw, self.strategy.scores_history)
        if self.policy is None:
            yield from self._pipelined(root, forward, None, None)
            return
        self.policy.new_text()
        queued: Optional[Queued] = None        # the forward of `root`, in flight
        carried: Optional[DraftTree] = None    # drafts below `root` kept from the last step
        while True:
            plan = self.policy.next(root, carried, queued is not None, self.together,
                                    self.company if self.together else None)
            if plan.offer is not None:    # sized with the other requests' trees (batch.py)
                plan = self.policy.sized(plan, (yield plan.offer))
            carried = None
            if plan.runs == STRETCH:
                root, queued = yield from self._pipelined(root, forward, queued, plan.stretch)
            elif plan.runs == VERIFY:
                root = yield from self._verify(plan)
            else:
                root, queued, carried = yield from self._ar_step(plan, forward, queued)

    def _verify(self, plan: StepPlan):
        """Verify the plan's tree (and the chain queued beside it) in one forward, accept and
        commit (tree_step); yields the committed block, returns the next root (its bonus)."""
        rows = 0 if self.together else plan.rows   # a batch's forward pads no request
        step = yield from self._run(tree_part(
            self.session, self.drafters, plan.tree, rows, self.settings, self.rng,
            self.clock, plan.chain, self.strategy.scores_history))
        drafted = step.acceptance.path[1:]
        self._record(plan.stats(len(drafted), step.t_verify, step.t_accept),
                     [SOURCES[plan.tree.drafted_by[v]] for v in drafted] + [TARGET])
        self.policy.learn(plan, step.block)
        yield step.block
        return step.block[-1]

    def _ar_step(self, plan: StepPlan, forward: ArForward, queued: Optional[Queued]):
        """One AR step of a tree strategy: reads the root's forward (`queued` by the step
        before, or now), the next one queued first where the plan says; else the child the
        token confirms keeps its drafts (returned) for the next step."""
        ahead, after = queued is not None, None
        if self.together and queued is None:
            nxt = yield from self._ar_row(forward, plan.tree.token[0])
        elif self.together:   # the next row rides in the batch's forward before this read
            waiting = self._scored is not None and self._scored.pending()
            if plan.ahead and not waiting:
                after = forward.queue((yield forward.block(queued.token)))
            nxt = queued.finish((yield Read(queued.parts(self._scored))), self._scored)
        else:
            queued = queued or forward(mx.array(plan.tree.token[0]))
            waiting = self._scored is not None and self._scored.pending()   # see Queued.read
            after = forward(queued.token) if plan.ahead and not waiting else None
            nxt = queued.read(self._scored)
        t = self.clock()
        self.session.history.extend([nxt])
        self.drafters.observe(self.session.history, 1)
        self._record(plan.stats(0, t - plan.started - plan.t_draft, self.clock() - t), [TARGET])
        self.policy.learn(plan, [nxt], timed=ahead and after is not None)
        yield [nxt]
        c = plan.built.child(0, nxt) if after is None else -1
        return nxt, after, (plan.built.rerooted(c) if c >= 0 else None)

    def _pipelined(self, root: int, forward: ArForward, queued: Optional[Queued],
                   steps: Optional[int]):
        """Up to `steps` AR steps (None: without end), the next forward queued before the
        current token is read back (one wait a step). Continues a `queued` forward of `root`;
        returns the new root and its forward, in flight, so no run ends in an idle device.
        In a tree strategy this is a plain stretch, which the policy watches and measures.
        Together, each forward is the batch's: a stretch begun with nothing in flight yields
        its root's row a step before its first read (one step's bubble, as alone it queues
        two forwards at once)."""
        history, policy = self.session.history, self.policy
        if policy is not None:
            policy.begin_stretch()
            if self.trace is not None:
                self.trace(f"stretch of {steps} AR steps")
        try:
            for _ in range(steps) if steps else count():
                if self.together:     # as below, each forward the batch's (one a step)
                    if queued is None:
                        queued = forward.queue((yield forward.block(history.root)))
                    after = forward.queue((yield forward.block(queued.token)))
                    guess = policy.guess(history) if policy else None
                    nxt = queued.finish((yield Read(queued.parts(self._scored))), self._scored)
                else:
                    queued = queued or forward(mx.array(history.root))
                    after = forward(queued.token)
                    guess = policy.guess(history) if policy else None   # while it runs
                    nxt = queued.read(self._scored)
                history.extend([nxt])
                if policy is not None:
                    policy.saw_ar(guess, nxt)
                    self.drafters.observe(history, 1)
                self._record(AR_STEP, [TARGET])
                yield [nxt]
                queued = after
                if policy is not None and policy.ends_stretch(history):
                    break
        finally:
            if policy is not None:
                policy.end_stretch()
        return history.root, queued

    def _ar_row(self, forward: ArForward, token: int):
        """One AR step `together`: its row in the batch's forward, its token (and score) in
        the batch's readback; returns the token."""
        queued = forward.queue((yield forward.block(token)))
        return queued.finish((yield Read(queued.parts(self._scored))), self._scored)
