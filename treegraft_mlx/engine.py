"""The decoding loop: draft tree (drafters) -> size -> verify (target) -> accept -> compact.

Every strategy is a generator of committed token blocks: the prefill's token, then one block
per target forward (the drafts it accepted and its bonus token), so stopping, streaming and
statistics are shared (generate.stream). Strategies by name:

  ar                      the target alone
  chain[:k]               classic speculative decoding: k greedy drafts of the strong drafter
  ngram                   endpoint W: the n-gram drafter builds every layer
  draft                   endpoint S: the strong drafter's greedy chain, as long as the
                          measured call policy chooses (CallPolicy), 0 being an AR step
  treegraft               the shared tree: the n-gram tree with the strong drafter's chain
                          grafted in from the root, its length chosen per bucket of the
                          n-gram plan by the measured call policy (CallPolicy)
  treegraft-learned       the paper's schedule: the family's learned scheduler decides which
                          layers the strong drafter expands with a tree-mask call (its
                          sampling-calibrated one when sampling, if the bundle has one)
  treegraft-fixed:1,3     the strong drafter expands exactly layers 1 and 3

Tree strategies size every step (Sizer, docs/design.md §7): the step verifies the subtree
its drafts are worth on this device, the root alone being a pipelined AR step. With
`TreeConfig(adaptive=False)` every step prunes to the fixed budget instead (the paper's way).
What the sizing and the call policy learn while running (the worth of drafting, of a call) follows
measured drafting times, so a seeded sampled run can differ between runs (never in its
distribution); a fixed budget repeats exactly.

Mean accepted length := generated tokens / target forwards after prefill (tokens per step).
"""

from __future__ import annotations

import contextlib
import dataclasses
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Callable, Iterable, Iterator, Optional, Sequence, Union

import mlx.core as mx
import numpy as np

from . import device
from .family import Family, TreeConfig, load_family
from .generate import Prompt, Response, check_context, encode_prompt, stream, tokens_per_step
from .history import History
from .sampling import SamplerSettings, sample_token
from .pricing import CallPolicy, Fallback, Sizer
from .session import Session
from .scheduler import FixedSchedule, LayerState, LearnedSchedule, Schedule, parse_layers
from .timing import (LATENCY_CONTEXT, StepCosts, Timing, cached, step_costs_key, timing_key,
                     verification_latency)
from .tree import DraftTree, Plan, build_cap, graft_chain, prune
from .verify import Acceptance, accept, verify

DEFAULT_CHAIN_K = 4
NO_CALLS = FixedSchedule(frozenset())
MAX_STEP_ROWS = 32         # the largest block a step may verify (and the cost table measures)
# Where `treegraft-learned` may call the strong drafter: layer 1 (the learned scheduler's
# budget b0 is 1 in both regimes on tg-tiny, and it calls at layer 1 when it calls); without
# a scheduler, the call is made on every step.
LEARNED_LAYERS = frozenset({1})


@dataclass
class StepStats:
    accepted: int                 # drafts accepted (committed tokens this step - 1)
    nodes_verified: int
    nodes_built: int
    layers: list[str]             # which drafter expanded each layer
    t_draft: float
    t_verify: float
    t_accept: float
    t_schedule: float = 0.0       # part of t_draft spent deciding (the learned scheduler)
    rows: int = 1                 # rows the target's forward ran (nodes verified, padded)
    expected: float = 1.0         # committed tokens the size choice expected (adaptive steps)


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

    @property
    def needs_strong(self) -> bool:
        return self.kind == "chain" or (self.kind == "tree" and
                                        (bool(self.combine_layers) or self.learned
                                         or self.strong_chain))


STRATEGY_NAMES = ("ar", "chain", "ngram", "draft", "treegraft", "treegraft-learned",
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
    if name == "treegraft":
        return Strategy(name, "tree", strong_chain=True, priced=True)
    if name == "treegraft-learned":
        return Strategy(name, "tree", LEARNED_LAYERS, learned=True)
    if name.startswith("treegraft-fixed:"):
        return Strategy(name, "tree", parse_layers(name.split(":", 1)[1]))
    raise ValueError(f"unknown strategy {name!r}; choose from {', '.join(STRATEGY_NAMES)}")


class Decoder:
    """Runs one generation of a strategy on a session; records StepStats per step."""

    def __init__(self, session: Session, strategy: Strategy, settings: SamplerSettings,
                 rng: np.random.Generator, schedule: Optional[Schedule] = None):
        self.session, self.strategy, self.settings, self.rng = session, strategy, settings, rng
        self.target = session.family.target
        self.clock = session.family.clock
        self.drafters: list = [session.ngram]
        if strategy.needs_strong:
            if session.strong is None:
                raise ValueError(f"strategy {strategy.name!r} needs a strong drafter; the family has none")
            self.drafters.append(session.strong)
        self.schedule: Schedule = FixedSchedule(strategy.combine_layers)
        family = session.family
        if schedule is not None:
            self.schedule = schedule
        elif strategy.learned and (learned := family.scheduler(not settings.greedy)) is not None:
            mlp, meta = learned
            timing = scheduler_timing(family, session.tree)
            self.schedule = LearnedSchedule(mlp, timing.t_tgt_ms, timing.t_mid_ms, meta["b0"])
        self.sizer = (Sizer(family.acceptance, step_costs(family, session.tree), session.tree,
                            sampled=not settings.greedy)
                      if strategy.kind == "tree" and session.tree.adaptive else None)
        self.calls: Optional[CallPolicy] = None
        if self.sizer is not None and strategy.priced and schedule is None:
            # What each chain length measured keeps learning across generations, per regime,
            # tree shape and strategy (with or without the n-gram tree).
            key = ("calls", not settings.greedy, session.tree, strategy.ngram)
            family.runtime_state.setdefault(key, CallPolicy(session.tree.depth))
            self.calls = family.runtime_state[key]
        if self.sizer is not None:
            key = ("fallback", not settings.greedy, session.tree, strategy.name)
            family.runtime_state.setdefault(key, Fallback(self.sizer.costs.ar_ms))
            self.fallback: Fallback = family.runtime_state[key]
        self.stats: list[StepStats] = []
        self._calls_before = sum(getattr(d, "calls", 0) for d in self.drafters)

    @property
    def drafter_calls(self) -> int:
        return sum(getattr(d, "calls", 0) for d in self.drafters) - self._calls_before

    def steps(self, prompt_ids: list[int]) -> Iterator[list[int]]:
        # The first block is the prefill's token, out at once (the prompt rows' scores stay
        # deferred until a drafter reads them); every later block is what one target forward
        # committed: accepted drafts, then the bonus.
        root = self.session.prefill(prompt_ids, self.settings, self.rng)
        if self.strategy.kind == "ar":
            yield from self._ar_steps(root)
            return
        yield [root]
        if self.sizer is not None:
            yield from self._adaptive_steps(root)
        else:
            yield from self._tree_steps(root)

    def _forward(self) -> "ArForward":
        key = mx.random.key(int(self.rng.integers(2**31)))
        return ArForward(self.target, self.session.cache, self.settings, key)

    def _ar_steps(self, root: int) -> Iterator[list[int]]:
        """One committed token per target forward, pipelined like mlx_lm: the next forward is
        queued (async_eval) before the current token is read back (the prefill's token too)."""
        history, forward = self.session.history, self._forward()
        queued = forward(mx.array(root))
        yield [root]
        while True:
            after = forward(queued.token)
            nxt = queued.read()
            history.extend([nxt])
            self.stats.append(StepStats(0, 1, 1, [], 0.0, 0.0, 0.0))
            yield [nxt]
            queued = after

    def _build(self, root: int, history: History) -> "TreeBuild":
        cfg = self.session.tree
        build = TreeBuild(DraftTree.rooted_at(root), [0], [], [])
        if self.strategy.kind == "chain":
            build.graft_chain(self.drafters[-1], self.strategy.chain_k, cfg, history)
            return build
        if self.strategy.ngram:
            build.expand(range(1, cfg.depth + 1), self.schedule, self.drafters, cfg, history)
        if self.strategy.strong_chain:
            build.graft_chain(self.drafters[-1], cfg.depth, cfg, history)
        return build

    def _tree_steps(self, root: int) -> Iterator[list[int]]:
        """Every step verifies the built tree pruned to the fixed budget (the paper's way)."""
        while True:
            t0 = self.clock()
            build = self._build(root, self.session.history)
            tree = build.tree.subtree(prune(build.tree, self.session.tree.budget))
            rows = self.session.tree.rows_for(len(tree))
            block, acc = self._verify(tree, rows, StepStats(
                0, len(tree), len(build.tree), build.used, self.clock() - t0, 0.0, 0.0,
                build.t_schedule, rows, 0.0))
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
        self.fallback.new_text()
        carried: Optional[DraftTree] = None    # drafts below `root` kept from the last step
        while True:
            looping = self._looping()
            if carried is None and (n := self.fallback.next_stretch(looping)):
                root, queued = yield from self._ar_stretch(root, forward, queued, n)
                continue
            t0 = self.clock()
            choice: Optional[tuple[int, int]] = None   # (bucket, chain length) of a priced build
            # Whether to run the n-gram drafter (a priced build still asks the call policy).
            fresh = carried is None and self.sizer.worth_drafting()
            if carried is not None:
                full, used, t_schedule = carried, [], 0.0
                plan = self.sizer.plan(carried, history.committed)
            elif self.calls is not None:
                build, plan, choice = self._priced_build(
                    root, history, ngram=fresh and self.strategy.ngram,
                    in_flight=queued is not None)
                full, used, t_schedule = build.tree, build.used, build.t_schedule
                # the sizer learns what n-gram drafting costs from steps that did not call
                fresh = fresh and self.drafters[-1].name not in used
            elif not fresh:
                full, used, t_schedule = DraftTree.rooted_at(root), [], 0.0
                plan = self.sizer.plan(full, history.committed)
            else:
                build = self._build(root, history)
                full, used, t_schedule = build.tree, build.used, build.t_schedule
                plan = self.sizer.plan(full, history.committed)
            carried = None
            t1 = self.clock()
            self.sizer.settle(plan, 1000 * (t1 - t0) if fresh else None)
            if queued is None and len(plan.keep) > 1:
                tree = full.subtree(plan.keep)
                rows = self.sizer.costs.rows_for(len(tree))
                block, acc = self._verify(tree, rows, StepStats(
                    0, len(tree), len(full), used, t1 - t0, 0.0, 0.0, t_schedule, rows,
                    plan.expected))
                self._learn(choice, len(block), t0, looping)
                yield block
                root = acc.bonus
                continue
            if queued is None:
                queued = forward(mx.array(root))
            after = (forward(queued.token)
                     if len(plan.keep) == 1 and not self._calls_next() else None)
            nxt = queued.read()
            t2 = self.clock()
            self._remember(queued, nxt)
            history.extend([nxt])
            for d in self.drafters:
                d.observe(history, 1)
            self.stats.append(StepStats(0, 1, len(full), used, t1 - t0, t2 - t1,
                                        self.clock() - t2, t_schedule, 1, plan.expected))
            self._learn(choice, 1, t0, looping)
            yield [nxt]
            if after is None and (c := full.child(0, nxt)) >= 0:
                carried = full.rerooted(c)
            root, queued = nxt, after

    def _learn(self, choice: Optional[tuple[int, int]], tokens: int, t0: float,
               looping: bool) -> None:
        """A tree step that began at `t0` (in a loop or not) committed `tokens`: the fallback
        and the call policy (for the `choice` of a priced build) learn its rate."""
        ms = 1000 * (self.clock() - t0)
        self.fallback.observe_tree(tokens, ms, looping)
        if choice is not None:
            self.calls.observe(*choice, tokens, ms)

    def _ar_stretch(self, root: int, forward: "ArForward", queued: Optional["Queued"],
                    steps: int) -> Iterator[list[int]]:
        """`steps` tokens decoded as `ar` decodes them (Fallback): no drafting, no readback but
        the token. Each row's score is deferred (History.defer) until a drafter reads
        it. Continues a `queued` forward of `root`, if any. Ends early where the text starts
        to loop (its last n_max tokens occurred before), if tree steps in loops pay. Returns
        the new root and its forward if that is in flight (after an early end)."""
        history, done, busy = self.session.history, 0, 0.0
        try:
            t0 = self.clock()
            queued = queued or forward(mx.array(root))
            for i in range(steps):
                after = forward(queued.token) if i + 1 < steps else None
                nxt = queued.read()
                self._remember(queued, nxt)
                history.extend([nxt])
                for d in self.drafters:
                    d.observe(history, 1)
                self.stats.append(StepStats(0, 1, 1, [], 0.0, 0.0, 0.0))
                done, busy = done + 1, busy + self.clock() - t0
                yield [nxt]
                t0, queued = self.clock(), after
                if self._looping() and self.fallback.faster(looping=True):
                    break           # the text loops, where drafts paid: probe the tree
        finally:        # what ran is measured, also when the caller stops inside the stretch
            if done:
                self.fallback.observe_ar(done, 1000 * busy)
        return history.root, queued

    def _looping(self) -> bool:
        """Whether the committed text's last n_max tokens occurred before (one lookup)."""
        return self.session.ngram.index.repeats(self.session.history.tokens)

    def _remember(self, queued: "Queued", token: int) -> None:
        """What the drafters will read of an AR step whose forward drew `token`: its row,
        deferred as a hidden state where the target exposes one (nothing read back now), else
        scored from its logits."""
        history = self.session.history
        if queued.hidden is not None:
            history.defer(history.committed, queued.hidden, self.target.head)
        else:
            history.record(history.committed, queued.logits[None], [token])

    def _calls_next(self) -> bool:
        """Whether the next step will likely call the strong drafter: then its forward is not
        queued ahead, since a call waits for a forward in flight on the same stream. Judged
        for an empty n-gram tree (`draft` never has another)."""
        return self.calls is not None and self.calls.peek(0) > 0

    def _priced_build(self, root: int, history: History, ngram: bool,
                      in_flight: bool) -> tuple["TreeBuild", Plan, Optional[tuple[int, int]]]:
        """The n-gram tree, and the strong drafter's chain grafted into it as long as the
        call policy chooses for the n-gram plan's bucket; planned by the Sizer; returned with
        (bucket, chain length) for the policy to learn from, or None where the call first
        synced a long lag (committed tokens S's cache had not seen: after a plain stretch),
        whose cost is the stretch's, not the chain length's. No call while the root's forward
        is `in_flight`: the drafter's forward would wait for it on the same stream and leave
        the next forward unqueued (measured: 17.7 ms a call against 2.8)."""
        cfg, sizer = self.session.tree, self.sizer
        build = TreeBuild(DraftTree.rooted_at(root), [0], [], [])
        if ngram:
            build.expand(range(1, cfg.depth + 1), NO_CALLS, self.drafters[:1], cfg, history)
        plan = sizer.plan(build.tree, history.committed)
        t0 = self.clock()
        bucket = self.calls.bucket(plan.expected)
        k = self.calls.choose(bucket)
        k = 0 if in_flight else k
        build.t_schedule = self.clock() - t0       # the policy's own work
        steady = self.drafters[-1].lag(history) <= self.calls.STEADY_LAG
        if k:
            build.graft_chain(self.drafters[-1], k, cfg, history)
            plan = sizer.plan(build.tree, history.committed)
        return build, plan, (bucket, k) if steady or not k else None

    def _verify(self, tree: DraftTree, rows: int, stats: StepStats) -> tuple[list[int], Acceptance]:
        """Verify `tree` in one forward of `rows` rows, accept, commit; completes `stats`.
        Returns the committed tokens after the root (accepted drafts, then the bonus)."""
        t1 = self.clock()
        logits = verify(self.target, self.session.cache, tree, rows)
        mx.eval(logits)
        t2 = self.clock()
        acc = accept(tree, logits, self.settings, self.rng)
        block = commit(self.session, self.drafters, tree, logits, acc)
        stats.accepted = len(acc.path) - 1
        stats.t_verify, stats.t_accept = t2 - t1, self.clock() - t2
        self.stats.append(stats)
        return block, acc


@dataclass
class Queued:
    """A target forward of one token, queued: its next token (lazy) and its logits row."""

    token: mx.array
    logits: mx.array
    hidden: Optional[mx.array] = None    # the last layer's output (1, H), where exposed

    def read(self) -> int:
        return int(self.token.item())


class ArForward:
    """Queues one AR forward: the token's logits, the next token drawn on the device (argmax,
    or the processed distribution with the next key), all evaluated asynchronously, so the
    host can queue the following forward or draft while it runs."""

    def __init__(self, target, cache, settings: SamplerSettings, key: mx.array):
        self.target, self.cache, self.settings, self.key = target, cache, settings, key

    def __call__(self, token: mx.array) -> Queued:
        target, tokens, hidden = self.target, token.reshape(1, 1), None
        if hasattr(target, "run_layers"):
            hidden = target.run_layers(target.embed(tokens), self.cache)[0]
            logits = target.head(hidden[None])[0, -1]
        else:
            logits = target(tokens, cache=self.cache)[0, -1]
        self.cache.commit()
        self.key, sub = mx.random.split(self.key)
        nxt = sample_token(logits, self.settings, sub)
        mx.async_eval(nxt)
        return Queued(nxt, logits, hidden)


@dataclass
class TreeBuild:
    """A tree being built layer by layer, and who expanded which layer so far."""

    tree: DraftTree
    frontier: list[int]
    called: list[int]             # layers the strong drafter expanded
    used: list[str]               # drafter name per layer
    t_schedule: float = 0.0       # seconds spent in the schedule's decisions

    def expand(self, layers: Iterable[int], schedule: Schedule, drafters: list,
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
                        nxt.grow(drafters[0], todo[i - 1], history)
                        grow_s.append(grow_s[-1] + time.perf_counter() - t)
                        ahead.append(nxt)
                    yield ahead[i].state(layer, cfg, history)

            t0 = time.perf_counter()
            k = schedule.first_call(states(), len(drafters))
            j = len(ahead) - 1 if k is None else k
            self.t_schedule += time.perf_counter() - t0 - grow_s[j]
            self.tree, self.frontier = ahead[j].tree, ahead[j].frontier
            self.called, self.used = ahead[j].called, ahead[j].used
            if k is None:
                for layer in todo[j:]:
                    self.grow(drafters[0], layer, history)
                return
            self.called.append(todo[k])
            self.grow(drafters[-1], todo[k], history)
            todo = todo[k + 1:]

    def graft_chain(self, strong, k: int, cfg: TreeConfig, history: History) -> None:
        """The strong drafter drafts k tokens after the root, one row per forward (cheap where
        a tree-mask call over many nodes is not), grafted into the tree built so far."""
        tokens, logps = strong.draft_chain(self.tree.token[0], k, history)
        graft_chain(self.tree, tokens, logps, build_cap(cfg.top_k, max(k, cfg.depth)))
        self.used.append(strong.name)

    def state(self, layer: int, cfg: TreeConfig, history: History) -> LayerState:
        return LayerState(layer, cfg.depth, history.committed, self.called, self.tree,
                          self.frontier, cfg.top_k, cfg.lookback)

    def grow(self, drafter, layer: int, history: History) -> None:
        """`drafter` expands `layer` from the frontier."""
        self.frontier = drafter.expand(self.tree, self.frontier, layer, history)
        self.used.append(drafter.name)

    def copy(self) -> "TreeBuild":
        return TreeBuild(self.tree.copy(), list(self.frontier), list(self.called),
                         list(self.used), self.t_schedule)


def commit(session: Session, drafters: list, tree: DraftTree, logits: mx.array,
           acc: Acceptance) -> list[int]:
    """Commit the accepted path: compact the target cache, score the path's positions,
    extend the history and tell the drafters. Returns what the history gained: the
    accepted drafts, then the bonus."""
    history = session.history
    session.cache.keep(acc.path)
    block = [tree.token[i] for i in acc.path]
    following = block[1:] + [acc.bonus]
    history.record(history.committed, logits[mx.array(acc.path)], following)
    history.extend(following)
    for d in drafters:
        d.observe(history, len(block))
    return following


def accept_and_commit(session: Session, drafters: list, tree: DraftTree, logits: mx.array,
                      settings: SamplerSettings, rng: np.random.Generator) -> tuple[list[int], int]:
    """A verified step, finished as decoding finishes it (the calibration loops): accept by
    the regime's rule, commit; (committed tokens after the root, plus the bonus; the bonus)."""
    acc = accept(tree, logits, settings, rng)
    return commit(session, drafters, tree, logits, acc), acc.bonus


@dataclass
class GenerationResult:
    text: str
    token_ids: list[int]
    prompt_tokens: int
    steps: int
    mean_accepted: float
    tokens_per_sec: float
    strategy: str
    drafter_calls: int
    finish_reason: Optional[str]
    step_stats: list[StepStats] = field(default_factory=list)
    time_to_first_token: float = 0.0      # seconds from the call to the first token

    @property
    def generation_tokens(self) -> int:
        return len(self.token_ids)


def stream_generate(family: Family, prompt: Prompt, strategy: str = "treegraft",
                    max_tokens: int = 256, temp: float = 0.0, top_p: float = 1.0,
                    top_k: int = 0, min_p: float = 0.0, seed: Optional[int] = None,
                    stop: Sequence[str] = (), tree: Optional[TreeConfig] = None,
                    session: Optional[Session] = None, schedule: Optional[Schedule] = None,
                    decoder_out: Optional[list] = None) -> Iterator[Response]:
    """Stream a generation with any strategy; output is exactly the target's.

    `prompt` is a raw string (no chat template) or token ids. `session` keeps the caches
    between calls (chat turns reuse the shared prefix). `schedule` replaces the strategy's
    layer schedule (tree strategies). `decoder_out`, if given, receives the decoder so callers
    can read per-step statistics.
    """
    device.warn_if_slow_blas()
    settings = SamplerSettings(temp, top_p, top_k, min_p)
    session = session or Session(family, tree)
    strat = parse_strategy(strategy, session.tree.depth)
    ids = encode_prompt(family.tokenizer, prompt)
    context = family.target.args.max_position_embeddings
    # Drafts are verified past the last token: leave room for one full tree path.
    max_tokens = check_context(len(ids), max_tokens, context - session.tree.depth - 1)
    decoder = Decoder(session, strat, settings, np.random.default_rng(seed), schedule)
    if decoder_out is not None:
        decoder_out.append(decoder)
    t0 = time.perf_counter()
    with device.wired_limit():
        yield from stream(family.tokenizer, decoder.steps(ids), len(ids), max_tokens, stop, t0)


def generate(family: Family, prompt: Prompt, strategy: str = "treegraft", **kwargs) -> GenerationResult:
    """Whole generation with statistics (see stream_generate for the arguments)."""
    holder: list[Decoder] = []
    text, ids, last = "", [], None
    for r in stream_generate(family, prompt, strategy, decoder_out=holder, **kwargs):
        text += r.text
        ids += r.tokens
        last = r
    decoder = holder[0] if holder else None
    steps = last.steps if last else 0
    return GenerationResult(
        text=text, token_ids=ids, prompt_tokens=last.prompt_tokens if last else 0, steps=steps,
        mean_accepted=tokens_per_step(len(ids), steps),
        tokens_per_sec=last.generation_tps if last else 0.0, strategy=strategy,
        drafter_calls=decoder.drafter_calls if decoder else 0,
        finish_reason=last.finish_reason if last else None,
        step_stats=decoder.stats if decoder else [],
        time_to_first_token=last.prompt_tokens / last.prompt_tps if last else 0.0)


# What this device's costs are measured with: a short code prompt, repetitive enough that the
# n-gram tree fills up.
PROBE_PROMPT = ("def add(a, b):\n    return a + b\n\n\ndef sub(a, b):\n    return a - b\n\n\n"
                "def mul(a, b):\n")
PROBE_TOKENS = 32
LATENCY_REPEATS = 3
LONG_CONTEXT = 1280        # the second context the row cost is measured at
# Block sizes the latency table measures: every small one (where trees are chosen and kernels
# switch), then a few larger ones that bigger trees are padded up to.
MEASURED_ROWS = (*range(1, 13), 16, 20, 24, 28)
FEW_ROWS = (1, 2, 3, 4, 6, 8, 12, 16, 24)  # what a slow model's probe keeps of them
ROW_PROBE = 8              # rows of the block measured at both contexts
PROBE_SECONDS = 25.0       # what measuring a model's step costs may take (a 7B on a Mac: 30 s)


@dataclass(frozen=True)
class ProbePlan:
    """How much the step-cost probe measures: scaled to the model so that a large target's
    first run stays within PROBE_SECONDS."""
    sizes: tuple[int, ...]
    repeats: int
    long_context: int
    probe_tokens: int

    def forwards(self) -> float:
        """Estimated cost in one-row forwards (a block costs about 1 + 0.1 per extra row; a
        prefill of c tokens about c / 16 forwards, generation about one per token)."""
        blocks = sum(1 + 0.1 * (m - 1) for m in self.sizes) * (self.repeats + 1)
        far = self.long_context / 16 + (2 + 0.1 * (ROW_PROBE - 1)) * (self.repeats + 1)
        return blocks + far + 2 * self.probe_tokens + 8 + LATENCY_CONTEXT / 16


def plan_probe(one_row_ms: float, limit: int) -> ProbePlan:
    """The full probe where it fits in PROBE_SECONDS, else fewer sizes, rounds and tokens."""
    full = ProbePlan(tuple(m for m in MEASURED_ROWS if m < limit) + (limit,), LATENCY_REPEATS,
                     LONG_CONTEXT, PROBE_TOKENS)
    if full.forwards() * one_row_ms <= 1000 * PROBE_SECONDS:
        return full
    return ProbePlan(tuple(m for m in FEW_ROWS if m < limit) + (limit,), 1, LONG_CONTEXT // 2,
                     PROBE_TOKENS // 4)


def load(target_path_or_bundle: Union[str, Path], drafters: Sequence = (),
         tree: Optional[TreeConfig] = None, warmup: bool = True, autotune: bool = True,
         pipeline: bool = False, **model_kwargs) -> Optional[Family]:
    """Load a family (family.load_family) and, with `warmup`, measure what this device's steps
    cost (and, with a strong drafter, what a call of it costs) unless cached, so the first
    generation does not pay for it: seconds, once per model pair and device. Without
    `autotune` nothing is measured: steps verify the bundle's fixed tree (budget, pad).
    With `pipeline` (under mlx.launch) the target is split over the ranks (pipeline.py); on
    ranks other than 0 this serves rank 0 until it stops and returns None."""
    if pipeline:
        from .pipeline import start

        family = start(target_path_or_bundle, drafters, tree, **model_kwargs)
        if family is None:
            return None
    else:
        family = load_family(target_path_or_bundle, drafters, tree, **model_kwargs)
    if not autotune:
        family.tree = dataclasses.replace(family.tree, adaptive=False)
    elif warmup:
        step_costs(family, family.tree)
        if family.strong is not None:
            scheduler_timing(family, family.tree)
    return family


def step_costs(family: Family, tree: TreeConfig, refresh: bool = False) -> StepCosts:
    """This device's step costs for the family (cached; measured on first use or on
    `refresh`, as `treegraft calibrate-budget` does)."""
    return cached(StepCosts, step_costs_key(family, tree),
                  lambda: measure_step_costs(family, tree), refresh=refresh)


def measure_step_costs(family: Family, tree: TreeConfig,
                       progress: Optional[Callable[[int], None]] = None) -> StepCosts:
    """The target's latency for every block size up to what a step may verify (and for 1 and
    ROW_PROBE rows after a long context: what a row costs per context token), a pipelined AR
    step, and a tree step's drafting and host work (acceptance and commit, from an n-gram
    generation with a small fixed tree)."""
    limit = min(MAX_STEP_ROWS, build_cap(tree.top_k, tree.depth))
    one_row = verification_latency(family.target, sizes=(1,), repeats=1)[1]
    plan = plan_probe(one_row, limit)
    sizes = list(plan.sizes)
    rounds = plan.repeats + 1
    with _progress(2 * rounds + 2, "measuring this device's step costs (once)") as advance:
        latency = verification_latency(family.target, sizes=sizes, repeats=plan.repeats,
                                       progress=advance)
        far = min(plan.long_context, family.target.args.max_position_embeddings - limit - 1)
        long = verification_latency(family.target, sizes=(1, ROW_PROBE), context=far,
                                    repeats=plan.repeats, progress=advance)
        generate(family, PROBE_PROMPT, "ar", max_tokens=8)
        ar = generate(family, PROBE_PROMPT, "ar", max_tokens=plan.probe_tokens)
        advance(1)
        fixed = dataclasses.replace(tree, adaptive=False, budget=min(8, limit), verify_pad=())
        steps = generate(family, PROBE_PROMPT, "ngram", max_tokens=plan.probe_tokens,
                         tree=fixed).step_stats
        advance(1)
    rows_near = latency[ROW_PROBE] - latency[1]
    rows_far = long[ROW_PROBE] - long[1]
    return StepCosts(tuple(sizes), tuple(latency[m] for m in sizes),
                     ar_ms=1000 / ar.tokens_per_sec,
                     overhead_ms=float(np.median([1000 * s.t_accept for s in steps])),
                     draft_ms=float(np.median([1000 * s.t_draft for s in steps])),
                     row_context_ms=max(0.0, (rows_far - rows_near) / (ROW_PROBE - 1)
                                        / max(1, far - LATENCY_CONTEXT)))


def scheduler_timing(family: Family, tree: TreeConfig) -> Timing:
    """The learned scheduler's T_tgt/T_mid for this family, tree shape and device (cached)."""
    return cached(Timing, timing_key(family, tree), lambda: measure_timing(family, tree))


def measure_timing(family: Family, tree: TreeConfig) -> Timing:
    """Warm-up with the strong drafter forced on every layer (the paper's all-S tree), each step
    verifying the tree pruned to the budget, as the scheduler's features were labelled."""
    fixed = dataclasses.replace(tree, adaptive=False)
    every_layer = "treegraft-fixed:" + ",".join(str(i) for i in range(1, tree.depth + 1))
    generate(family, PROBE_PROMPT, every_layer, max_tokens=8, tree=fixed)  # first-call costs
    res = generate(family, PROBE_PROMPT, every_layer, max_tokens=PROBE_TOKENS, tree=fixed)
    steps = res.step_stats
    calls = max(1, res.drafter_calls)
    return Timing(t_tgt_ms=1000 * sum(s.t_verify for s in steps) / len(steps),
                  t_mid_ms=1000 * sum(s.t_draft for s in steps) / calls)


@contextlib.contextmanager
def _progress(total: int, label: str) -> Iterator[Callable[[int], None]]:
    """A one-line notice and a progress bar on stderr for the one-time measurements."""
    import click

    with click.progressbar(length=total, label=label, file=sys.stderr) as bar:
        yield bar.update
