"""End-to-end losslessness on the trained fixture: sampled tokens 2 to 4 of every tree strategy
follow the target's processed distribution, with per-step sizing and with a fixed tree.

Statistic: the randomized probability integral transform. For each generated token, with the
target's processed distribution p at its position (one plain forward over prompt + output),
tokens ranked by descending p: u = P(rank before the token) + V * p(token), V ~ U(0, 1). If the
engine samples exactly from p, the u of tokens 2-4 over all runs are independent U(0, 1)
whatever the prompts and filters; a chi-square over 10 bins tests that (df 9, alpha 0.001).
Each run must draw only tokens the filters allow (p > 0): a filter bug fails at once.

A second statistic sees acceptance itself (DraftedNodes): at each visited node with drafted
children, the committed token is one of them with probability q = p(their tokens), or, with a
sampled draft among them, min(1, p/q) plus the residual's mass on the rest
(hit_probability); z of the hits against sum(q) (two-sided, alpha 0.001).

Power against broken rules (seeds fixed; the exact engine's |z| <= 0.7, chi-square <= 7.3) is
measured by examples/mutation_check.py, whose acceptance mutants run this file: greedy
acceptance mixed into sampling, a sampled draft accepted untested, a rule that forgets the
residual after a rejection (test_sampled_chains_on_every_step), among others. Figures:
docs/design.md, "Mutation check".
"""

from __future__ import annotations

import dataclasses

import mlx.core as mx
import numpy as np
import pytest

from scripted import deterministic
from treegraft_mlx import fixture_path, generate, load, probe
from treegraft_mlx import verify as verify_module
from treegraft_mlx.batch import decode_together
from treegraft_mlx.pricing import CallPolicy
from treegraft_mlx.sampling import SamplerSettings, host_probs
from treegraft_mlx.session import Session
from treegraft_mlx.timing import StepCosts

RUNS = 120
BINS = 10
CHI2_CRIT_DF9_001 = 27.88
Z_CRIT_001 = 3.29            # two-sided, alpha 0.001
FILTERS = (SamplerSettings(temp=0.7, top_k=20, top_p=0.9, min_p=0.02),
           SamplerSettings(temp=1.0, top_k=12, top_p=0.95, min_p=0.05))
# Copy-heavy code: drafts are accepted often enough to exercise acceptance and rejection.
PROMPT = ("def add(a, b):\n    return a + b\n\n\ndef sub(a, b):\n    return a - b\n\n\n"
          "def mul(a, b):\n    return a * b\n\n\ndef div(a, b):\n")
CASES = [("ngram", True), ("draft", True), ("treegraft", True),
         ("ngram", False), ("draft", False), ("treegraft-learned", False),
         ("treegraft-fixed:1,3", False), ("chain:3", False)]
# Per-step sizing priced on a flat verification curve (bf16 weights on a Mac GPU: 2-16 rows
# cost about one): the sizer verifies trees of uncertain drafts too, where an acceptance bug
# shows. On the CPU's curve (tests/scripted.py) it verifies near-certain drafts only.
FLAT = StepCosts(tuple(range(1, 33)), (22.5,) * 16 + (30.0,) * 16, ar_ms=22.2, overhead_ms=0.3,
                 draft_ms=0.3)


@pytest.fixture(autouse=True)
def flat_costs(monkeypatch):
    monkeypatch.setattr(probe, "step_costs", lambda family, tree, refresh=False: FLAT)


@pytest.fixture(scope="module")
def family():
    """The fixture family with no end-of-sequence token: an EOS drawn at token 2-4 would end
    the run and drop that draw from the statistic, biasing it."""
    family = deterministic(load(fixture_path()))
    family.tokenizer._eos_token_ids.clear()
    return family


@dataclasses.dataclass
class Outcome:
    chi2: float         # randomized PIT of tokens 2-4, 10 bins
    z: float            # drafted tokens committed at drafted nodes, against their probability
    trees: int          # steps that verified drafts
    accepted: int       # drafts accepted
    rejected: int       # drafts verified and not accepted
    sampled: int        # sampled drafts the walk tried
    z_sampled: float    # those committed, against min(1, p/q)
    resurrected: int    # drafts committed after failing their test: never, exactly (the
    #                     residual max(p - q, 0) has no mass on a draft that failed)


class DraftedNodes:
    """Wraps the engine's sampled acceptance, both halves (verify.queue_verdict, verify.walk):
    at every node the walk visits that has drafted children, records P(the target's token is
    one of them) under the processed distribution (from the verified logits) and whether the
    committed token was. Exact acceptance commits a drafted token with exactly that
    probability."""

    def __init__(self, verdict_rule, walk_rule):
        self.verdict_rule, self.walk_rule = verdict_rule, walk_rule
        self.q, self.hit = [], []
        self.a, self.took = [], []    # at sampled drafts: min(1, p/q), committed == the draft
        self.resurrected = 0          # sampled drafts committed after failing their test
        # Verifications queued and not walked yet, oldest first: their logits and sampled
        # drafts (requests decoded together queue theirs in one order and walk them in it).
        self.seen = []

    def queue_verdict(self, logits, settings, seed, drafts=None, scores=True):
        self.seen.append((logits, drafts))
        return self.verdict_rule(logits, settings, seed, drafts, scores)

    def walk(self, tree, verdict, settings):
        walked = self.walk_rule(tree, verdict, settings)
        logits, drafts = self.seen.pop(0)
        if settings.greedy:
            return walked
        acc = walked.acceptance
        committed = [tree.token[n] for n in acc.path[1:]] + [acc.bonus]
        for node, token in zip(acc.path, committed):
            kids = [tree.token[c] for c in tree.children_of(node)]
            if kids:
                p = host_probs(np.array(logits[node].astype(mx.float32)), settings)
                q = drawn_from(drafts, node)
                self.q.append(hit_probability(tree, node, kids, p, q))
                self.hit.append(token in kids)
                if q is not None:
                    x = tree.token[drawn_child(tree, node)]
                    self.a.append(min(1.0, p[x] / q[x]))
                    self.took.append(token == x)
                    self.resurrected += bool(token == x and not verdict[node, 1])
        return walked

    def z(self) -> float:
        return z_score(self.hit, self.q)

    def z_sampled(self) -> float:
        """The same for sampled drafts alone: one is committed with exactly min(1, p/q)."""
        return z_score(self.took, self.a)


def drawn_from(drafts, node: int):
    """q of the sampled draft below `node` (float64, on the host), or None."""
    if drafts is None or node not in drafts.rows:
        return None
    return np.array(drafts.q[drafts.rows.index(node)].astype(mx.float32), dtype=np.float64)


def drawn_child(tree, node: int) -> int:
    return next(c for c in tree.children_of(node) if c in tree.drawn)


def z_score(hits: list[bool], q: list[float]) -> float:
    """Bernoulli hits against their probabilities q."""
    q = np.array(q)
    return float((np.sum(hits) - q.sum()) / np.sqrt(max((q * (1 - q)).sum(), 1e-12)))


def hit_probability(tree, node: int, kids: list[int], p: np.ndarray, q) -> float:
    """P(the committed token at `node` is a drafted child's) under exact acceptance, given
    the drafts: p(kids) for fixed proposals; with a sampled draft x ~ q among them, x is
    accepted with a = min(1, p(x)/q(x)), else the draw comes from the residual."""
    if q is None:
        return float(p[kids].sum())
    x = tree.token[drawn_child(tree, node)]
    a = min(1.0, p[x] / q[x])
    owed = np.maximum(p - q, 0.0)
    return a if a >= 1.0 else float(a + (1 - a) * (owed / owed.sum())[kids].sum())


def pit(p: np.ndarray, token: int, rng: np.random.Generator) -> float:
    order = np.lexsort((np.arange(len(p)), -p))      # descending p, ties by id
    rank = int(np.flatnonzero(order == token)[0])
    return float(p[order[:rank]].sum() + rng.random() * p[token])


def alone(family, prompt: list[int], strategy: str, tree, session, runs: int):
    """(seed, settings, tokens, step statistics) of each run, generated one at a time."""
    for seed in range(runs):
        s = FILTERS[seed % len(FILTERS)]
        out = generate(family, prompt, strategy, max_tokens=4, seed=seed, session=session,
                       tree=tree, settings=s)
        yield seed, s, out.token_ids, out.step_stats


def together(family, prompt: list[int], strategy: str, tree, runs: int, group: int = 3):
    """`alone`'s runs decoded `group` at a time in one batch (batch.py), joining a step apart,
    so their rows share forwards and their verdicts share readbacks."""
    for first in range(0, runs, group):
        seeds = range(first, min(first + group, runs))
        requests = [dict(prompt=prompt, strategy=strategy, max_tokens=4, seed=seed, tree=tree,
                         settings=FILTERS[seed % len(FILTERS)]) for seed in seeds]
        for seed, responses in zip(seeds, decode_together(family, requests, range(len(seeds)))):
            yield (seed, FILTERS[seed % len(FILTERS)], [t for r in responses for t in r.tokens],
                   responses[-1].step_stats)


def reference_rows(target, prompt: list[int], outputs: list[list[int]],
                   batch: int = 16) -> dict[tuple, np.ndarray]:
    """The target's logits at the prompt's last position and after each of an output's first
    three tokens, by those tokens: one plain forward over prompt + tokens, without a cache,
    `batch` outputs at a time (equal lengths: no padding)."""
    keys = sorted({tuple(toks[:3]) for toks in outputs})
    rows = {}
    for i in range(0, len(keys), batch):
        chunk = keys[i:i + batch]
        logits = target(mx.array([prompt + list(k) for k in chunk]))[:, -4:]
        rows.update(zip(chunk, np.array(logits.astype(mx.float32))))
    return rows


def run_case(family, strategy: str, adaptive: bool, monkeypatch, runs: int = RUNS,
             batched: bool = False) -> Outcome:
    drafted = DraftedNodes(verify_module.queue_verdict, verify_module.walk)
    monkeypatch.setattr(verify_module, "queue_verdict", drafted.queue_verdict)
    monkeypatch.setattr(verify_module, "walk", drafted.walk)
    tree = dataclasses.replace(family.tree, adaptive=adaptive)
    session = Session(family, tree)          # the prompt's prefill is reused run after run
    prompt = family.tokenizer.encode(PROMPT)
    generated = list(together(family, prompt, strategy, tree, runs) if batched else
                     alone(family, prompt, strategy, tree, session, runs))
    for seed, _, toks, _ in generated:
        assert len(toks) == 4, (strategy, seed)
    rows = reference_rows(family.target, prompt, [toks for _, _, toks, _ in generated])
    rng = np.random.default_rng(12345)
    us, trees, accepted, rejected = [], 0, 0, 0
    for seed, s, toks, stats in generated:
        key = tuple(toks[:3])
        for j in (1, 2, 3):
            p = host_probs(rows[key][j], s)
            assert p[toks[j]] > 0, (strategy, seed, j, "a filtered token was drawn")
            us.append(pit(p, toks[j], rng))
        for st in stats:
            if st.nodes_verified > 1:
                trees += 1
                accepted += st.accepted
                rejected += st.nodes_verified - 1 - st.accepted
    counts = np.bincount(np.minimum((np.array(us) * BINS).astype(int), BINS - 1), minlength=BINS)
    expected = len(us) / BINS
    monkeypatch.setattr(verify_module, "queue_verdict", drafted.verdict_rule)
    monkeypatch.setattr(verify_module, "walk", drafted.walk_rule)
    return Outcome(float(((counts - expected) ** 2 / expected).sum()), drafted.z(), trees,
                   accepted, rejected, len(drafted.a), drafted.z_sampled(),
                   drafted.resurrected)


@pytest.mark.parametrize("strategy, adaptive", CASES)
def test_sampled_tokens_follow_the_target_distribution(family, strategy, adaptive, monkeypatch):
    _check_case(family, strategy, adaptive, monkeypatch)


@pytest.mark.parametrize("strategy", ["draft", "treegraft"])
def test_the_verdict_on_the_device_is_lossless_too(family, strategy, monkeypatch):
    """A GPU computes the verdict on the device (verify.device_table): the same statistics
    through it, sampled chains included (forced here; MLX's CPU kernels run it)."""
    monkeypatch.setattr(verify_module, "on_gpu", lambda: True)
    _check_case(family, strategy, True, monkeypatch)


@pytest.mark.parametrize("strategy", ["ngram", "draft", "treegraft"])
def test_requests_decoded_together_are_lossless_too(family, strategy, monkeypatch):
    """Runs decoded three at a time in one batch (packed forwards, shared readbacks): the
    same statistics. `draft` calls its drafter every step (its sampled chains beside the
    other requests' rows)."""
    if strategy == "draft":
        monkeypatch.setattr(CallPolicy, "peek", lambda self, bucket: 3)
    _check_case(family, strategy, True, monkeypatch, batched=True)


def _check_case(family, strategy: str, adaptive: bool, monkeypatch,
                batched: bool = False) -> None:
    got = run_case(family, strategy, adaptive, monkeypatch, batched=batched)
    assert got.trees >= 20 and got.accepted >= 20 and got.rejected >= 20, got
    # Priced strong-drafter chains are sampled drafts when sampling (min(1, p/q) acceptance).
    assert (got.sampled >= 20) == (adaptive and strategy in ("draft", "treegraft")), got
    assert got.chi2 < CHI2_CRIT_DF9_001 and abs(got.z) < Z_CRIT_001, got
    assert abs(got.z_sampled) < Z_CRIT_001 and got.resurrected == 0, got


def test_sampled_chains_on_every_step(family, monkeypatch):
    """Every step calls the strong drafter (its chain sampled), twice the runs: the statistics
    hold where most drafts are sampled ones (their power against a rule that forgets the
    residual after a rejection: examples/mutation_check.py, `residual-forgotten`)."""
    monkeypatch.setattr(CallPolicy, "peek", lambda self, bucket: 3)
    got = run_case(family, "draft", True, monkeypatch, runs=2 * RUNS)
    assert got.sampled >= 4 * RUNS, got
    assert got.chi2 < CHI2_CRIT_DF9_001 and abs(got.z) < Z_CRIT_001, got
    assert abs(got.z_sampled) < Z_CRIT_001 and got.resurrected == 0, got
