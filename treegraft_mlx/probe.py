"""Device probing: what this machine's decoding steps cost, measured once per model pair and
device (cached by timing.py), so the per-step sizing and the learned scheduler price steps
with this device's numbers, not assumed ones.

Measuring decodes: the latency table comes from bare forwards (timing.verification_latency),
a pipelined AR step and a tree step's host work from short generations that need no costs
themselves (`ar`, and `ngram` or `treegraft-fixed` with a fixed tree).
"""

from __future__ import annotations

import contextlib
import dataclasses
import sys
from dataclasses import dataclass
from typing import Callable, Iterator, Optional

import numpy as np

from . import device
from .decoder import Decoder
from .strategy import parse_strategy
from .family import Family, TreeConfig
from .generate import Response, encode_prompt, stream
from .sampling import SamplerSettings
from .session import Session
from .timing import (LATENCY_CONTEXT, StepCosts, Timing, cached, step_costs_key, timing_key,
                     verification_latency)
from .tree import build_cap

# What this device's costs are measured with: a short code prompt, repetitive enough that the
# n-gram tree fills up, repeated to LATENCY_CONTEXT tokens, the context the latency table is
# measured at (an AR step and the tree steps it is weighed against are priced alike).
PROBE_PROMPT = ("def add(a, b):\n    return a + b\n\n\ndef sub(a, b):\n    return a - b\n\n\n"
                "def mul(a, b):\n")
PROBE_TOKENS = 32
MAX_STEP_ROWS = 32         # the largest block a step may verify (and the cost table measures)
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
    ar_runs: int              # AR decodes the AR step's cost is the median of

    def forwards(self) -> float:
        """Estimated cost in one-row forwards (a block costs about 1 + 0.1 per extra row; a
        prefill of c tokens about c / 16 forwards, generation about one per token)."""
        blocks = sum(1 + 0.1 * (m - 1) for m in self.sizes) * (self.repeats + 1)
        far = self.long_context / 16 + (2 + 0.1 * (ROW_PROBE - 1)) * (self.repeats + 1)
        decodes = (self.ar_runs + 1) * self.probe_tokens + 8
        return blocks + far + decodes + 2 * LATENCY_CONTEXT / 16    # two prompt prefills


def plan_probe(one_row_ms: float, limit: int) -> ProbePlan:
    """The full probe where it fits in PROBE_SECONDS, else fewer sizes, rounds and tokens."""
    full = ProbePlan(tuple(m for m in MEASURED_ROWS if m < limit) + (limit,), LATENCY_REPEATS,
                     LONG_CONTEXT, PROBE_TOKENS, 3)
    if full.forwards() * one_row_ms <= 1000 * PROBE_SECONDS:
        return full
    return ProbePlan(tuple(m for m in FEW_ROWS if m < limit) + (limit,), 1, LONG_CONTEXT // 4,
                     PROBE_TOKENS // 4, 1)


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
        # One AR run of 32 tokens varies by up to a fifth between runs here (8.2-11.4 ms on
        # tg-tiny), and the AR step's cost decides every step's size: the median of a few, in
        # one warm session (as the latency table's forwards run), sharing one prefill.
        plain = Session(family)
        decode(family, "ar", 8, session=plain)
        ar_ms = float(np.median([1000 / decode(family, "ar", plan.probe_tokens,
                                               session=plain)[1].generation_tps
                                 for _ in range(plan.ar_runs)]))
        advance(1)
        fixed = dataclasses.replace(tree, adaptive=False, budget=min(8, limit), verify_pad=())
        steps = decode(family, "ngram", plan.probe_tokens, fixed)[0].stats
        advance(1)
    rows_near = latency[ROW_PROBE] - latency[1]
    rows_far = long[ROW_PROBE] - long[1]
    return StepCosts(tuple(sizes), tuple(latency[m] for m in sizes),
                     ar_ms=ar_ms,
                     overhead_ms=float(np.median([1000 * s.t_accept for s in steps])),
                     draft_ms=float(np.median([1000 * s.t_draft for s in steps])),
                     row_context_ms=max(0.0, (rows_far - rows_near) / (ROW_PROBE - 1)
                                        / max(1, far - LATENCY_CONTEXT)))


def scheduler_timing(family: Family, tree: TreeConfig) -> Timing:
    """The learned scheduler's T_tgt/T_mid for this family, tree shape and device (cached)."""
    return cached(Timing, timing_key(family, tree), lambda: measure_timing(family, tree))


def measure_timing(family: Family, tree: TreeConfig) -> Timing:
    """Warm-up with the strong drafter called on every step (timing_strategy), each step
    verifying the tree pruned to the budget, as the scheduler's features were labelled."""
    fixed = dataclasses.replace(tree, adaptive=False)
    strategy = timing_strategy(family, tree)
    decode(family, strategy, 8, fixed)                        # first-call costs
    decoder, _ = decode(family, strategy, PROBE_TOKENS, fixed)
    steps = decoder.stats
    calls = max(1, decoder.drafter_calls)
    return Timing(t_tgt_ms=1000 * sum(s.t_verify for s in steps) / len(steps),
                  t_mid_ms=1000 * sum(s.t_draft for s in steps) / calls)


def timing_strategy(family: Family, tree: TreeConfig) -> str:
    """What T_mid is measured with: the strong drafter forced on every layer (the paper's all-S
    tree); a hybrid (recurrent) drafter, which cannot drop a tree-mask call's rows, runs what
    it can, its chain of `depth` tokens on every step (each token one call, as a layer is)."""
    if getattr(family.strong, "RECURRENT", False):
        return "draft"
    return "treegraft-fixed:" + ",".join(str(i) for i in range(1, tree.depth + 1))


@contextlib.contextmanager
def _progress(total: int, label: str) -> Iterator[Callable[[int], None]]:
    """A one-line notice and a progress bar on stderr for the one-time measurements."""
    import click

    with click.progressbar(length=total, label=label, file=sys.stderr) as bar:
        yield bar.update


def decode(family: Family, strategy: str, max_tokens: int, tree: Optional[TreeConfig] = None,
           session: Optional[Session] = None) -> tuple[Decoder, Response]:
    """Greedy `strategy` on the probe prompt (repeated to LATENCY_CONTEXT tokens, or what
    the model's context leaves room for), with a tree that needs no costs (fixed, or none for
    `ar`); the decoder (its step statistics) and the last response (its speed). A `session`
    given reuses its prefill of the prompt."""
    session = session or Session(family, tree)
    decoder = Decoder(session, parse_strategy(strategy), SamplerSettings(),
                      np.random.default_rng(0))
    ids = encode_prompt(family.tokenizer, PROBE_PROMPT)
    room = family.target.args.max_position_embeddings - max_tokens - 2 * session.tree.depth
    ids = (ids * -(-LATENCY_CONTEXT // len(ids)))[:max(len(ids), min(LATENCY_CONTEXT, room))]
    last = None
    with device.wired_limit():
        for last in stream(family.tokenizer, decoder.steps(ids), len(ids), max_tokens):
            pass
    return decoder, last
