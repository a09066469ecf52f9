"""Sampling losslessness: tree acceptance draws exactly from the processed target distribution.

Chi-square tests with fixed seeds (deterministic). A deliberately wrong acceptance rule (no
renormalisation after a rejection: the bonus comes from the unmodified distribution) must fail
the same test, which shows the test can tell.
"""

import mlx.core as mx
import numpy as np
import pytest

from treegraft_mlx.sampling import SamplerSettings, draw, target_probs
from treegraft_mlx import verify as verify_module
from treegraft_mlx.tree import DraftTree
from treegraft_mlx.verify import (Acceptance, SampledDrafts, accept_greedy, accept_sample,
                                  expected_path_length, residual)

# Chi-square critical values at alpha = 0.001, by degrees of freedom.
CHI2_CRIT_001 = {3: 16.27, 5: 20.52, 7: 24.32, 8: 26.12, 11: 31.26, 15: 37.70}


def chi_square(counts: np.ndarray, probs: np.ndarray) -> float:
    expected = probs * counts.sum()
    keep = expected > 0
    return float((((counts - expected) ** 2)[keep] / expected[keep]).sum())


def constructed_case():
    """Root with three drafted children (one with a grandchild); a 6-token vocabulary."""
    t = DraftTree.rooted_at(0)
    a = t.add(0, 2, -0.1)
    t.add(0, 4, -0.5)
    t.add(0, 5, -1.0)
    t.add(a, 1, -0.2)
    rows = np.log(np.array([
        [0.05, 0.10, 0.40, 0.05, 0.30, 0.10],   # at the root
        [0.30, 0.20, 0.10, 0.10, 0.20, 0.10],   # after token 2
        [0.2] * 5 + [0.0],
        [0.2] * 5 + [0.0],
        [0.1] * 6,
    ]) + 1e-30)
    return t, mx.array(rows.astype(np.float32))


def wrong_accept(tree, logits, settings, rng):
    """The mutant: rejected proposals are not removed from the bonus distribution."""
    node, path = 0, [0]
    while True:
        p = np.array(target_probs(logits[node], settings), dtype=np.float64)
        for c in sorted(tree.children_of(node), key=lambda c: (-tree.score[c], c)):
            if rng.random() < p[tree.token[c]]:
                node = c
                path.append(c)
                break
        else:
            return Acceptance(path, draw(p, rng))


def first_token_chi_square(rule, n: int = 5000, seed: int = 1) -> float:
    """Chi-square of the first committed token's counts against the root row's distribution."""
    tree, logits = constructed_case()
    p = np.exp(np.array(logits[0]))
    p /= p.sum()
    rng = np.random.default_rng(seed)
    counts = np.zeros(6)
    for _ in range(n):
        acc = rule(tree, logits, SamplerSettings(temp=1.0), rng)
        counts[tree.token[acc.path[1]] if len(acc.path) > 1 else acc.bonus] += 1
    return chi_square(counts, p)


@pytest.fixture(params=("host", "device"))
def placement(request, monkeypatch) -> str:
    """Where the verdict is computed: in numpy (MLX's CPU backend) or on the device (a GPU's
    placement, forced here; MLX's CPU kernels run it)."""
    if request.param == "device":
        monkeypatch.setattr(verify_module, "on_gpu", lambda: True)
    return request.param


def test_first_token_distribution_is_exact(placement):
    assert first_token_chi_square(accept_sample) < CHI2_CRIT_001[5]


def test_second_token_given_accepted_draft_is_exact(placement):
    # After the draft "2" is accepted, the next token follows the row of node 1.
    tree, logits = constructed_case()
    p = np.exp(np.array(logits[1]))
    p /= p.sum()
    rng = np.random.default_rng(2)
    counts = np.zeros(6)
    while counts.sum() < 4000:
        acc = accept_sample(tree, logits, SamplerSettings(temp=1.0), rng)
        if len(acc.path) > 1 and acc.path[1] == 1:
            second = tree.token[acc.path[2]] if len(acc.path) > 2 else acc.bonus
            counts[second] += 1
    assert chi_square(counts, p) < CHI2_CRIT_001[5]


def test_wrong_rule_fails_the_same_test():
    assert first_token_chi_square(wrong_accept) > CHI2_CRIT_001[5]


# A drafter's distribution q at the root, far from the target's p there (constructed_case).
DRAFTER_Q = np.array([0.05, 0.05, 0.10, 0.40, 0.10, 0.30])


def sampled_case(rng: np.random.Generator) -> tuple[DraftTree, SampledDrafts]:
    """A fresh draft per trial: x ~ q at the root (a sampled draft, its q kept), the
    deterministic sibling 5 and, below x, the deterministic grandchild 1."""
    tree = DraftTree.rooted_at(0)
    x = draw(DRAFTER_Q, rng)
    node = tree.add(0, x, -0.1)
    tree.drawn.add(node)
    tree.add(0, 5, -1.0)
    tree.add(node, 1, -0.2)
    return tree, SampledDrafts([0], mx.array([x]), mx.array(DRAFTER_Q[None].astype(np.float32)))


def no_residual(tree, logits, settings, rng, drafts):
    """The mutant: after a rejected sampled draft the bonus comes from p, not max(p - q, 0)."""
    p = np.exp(np.array(logits[0], dtype=np.float64))
    p /= p.sum()
    s = next(c for c in tree.children_of(0) if c in tree.drawn)
    q, x = DRAFTER_Q, tree.token[s]
    if rng.random() * q[x] < p[x]:
        return Acceptance([0, s], 0)
    y = draw(p, rng)
    c = tree.child(0, y)
    return Acceptance([0, c], 0) if c >= 0 else Acceptance([0], y)


def sampled_first_tokens(rule, n: int = 6000, seed: int = 4) -> tuple[np.ndarray, int]:
    """Counts of the first committed token over fresh sampled drafts, and how often the
    sampled draft itself was accepted."""
    _, logits = constructed_case()
    rng = np.random.default_rng(seed)
    counts, hits = np.zeros(6), 0
    for _ in range(n):
        tree, drafts = sampled_case(rng)
        acc = rule(tree, logits, SamplerSettings(temp=1.0), rng, drafts)
        first = tree.token[acc.path[1]] if len(acc.path) > 1 else acc.bonus
        counts[first] += 1
        hits += len(acc.path) > 1 and acc.path[1] in tree.drawn
    return counts, hits


def test_a_sampled_draft_is_accepted_by_min_p_over_q_and_stays_lossless(placement):
    """A draft drawn from q is accepted with 1 - TV(p, q) (here 0.45, against p(x) averaged
    over x ~ q, 0.13, had it been treated as a fixed proposal), and the first committed token
    still follows p exactly; skipping the residual fails the same test."""
    _, logits = constructed_case()
    p = np.exp(np.array(logits[0], dtype=np.float64))
    p /= p.sum()
    n = 6000
    counts, hits = sampled_first_tokens(accept_sample, n)
    assert chi_square(counts, p) < CHI2_CRIT_001[5]
    accept_rate = np.minimum(p, DRAFTER_Q).sum()
    assert accept_rate == pytest.approx(0.45) and (DRAFTER_Q * p).sum() < 0.13
    assert abs(hits - n * accept_rate) < 4 * np.sqrt(n * accept_rate * (1 - accept_rate))
    wrong, _ = sampled_first_tokens(no_residual, n)
    assert chi_square(wrong, p) > CHI2_CRIT_001[5]


def test_residual_is_what_the_target_still_owes():
    p, q = np.array([0.5, 0.3, 0.2]), np.array([0.2, 0.6, 0.2])
    r = np.array(residual(mx.array(p[None]), mx.array(q[None])))[0]
    assert r == pytest.approx([1.0, 0.0, 0.0])
    # min(p, q) from the draft plus TV(p, q) times the residual gives p back.
    assert np.minimum(p, q) + 0.3 * r == pytest.approx(p)


@pytest.mark.parametrize("settings", [SamplerSettings(temp=0.7, top_p=0.9),
                                      SamplerSettings(temp=1.3, top_k=3),
                                      SamplerSettings(temp=1.0, min_p=0.3)])
def test_processed_distribution_filters(settings):
    logits = np.log(np.array([0.5, 0.2, 0.15, 0.1, 0.05]))
    p = np.array(target_probs(mx.array(logits), settings), dtype=np.float64)
    assert np.isclose(p.sum(), 1.0, atol=1e-6)
    q = np.exp(logits / settings.temp)
    q /= q.sum()
    if settings.top_k:
        assert (p > 0).sum() == settings.top_k
    if settings.top_p < 1:
        kept = p > 0
        assert q[kept].sum() >= settings.top_p - 1e-9 and (p > 0).sum() < 5
    if settings.min_p:
        assert np.all(q[p > 0] >= settings.min_p * q.max())
    assert np.allclose(p[p > 0], q[p > 0] / q[p > 0].sum(), atol=1e-6)


def exact_pair_distribution(model, ids, settings):
    """P(t1, t2) under the processed target distribution, from direct forwards."""
    p1 = np.array(target_probs(model(mx.array([ids]))[0, -1], settings), dtype=np.float64)
    pairs = {}
    for t1 in np.flatnonzero(p1):
        p2 = np.array(target_probs(model(mx.array([ids + [int(t1)]]))[0, -1], settings),
                      dtype=np.float64)
        for t2 in np.flatnonzero(p2):
            pairs[(int(t1), int(t2))] = p1[t1] * p2[t2]
    return pairs


@pytest.mark.parametrize("strategy", ["ar", "ngram", "treegraft"])
def test_end_to_end_sampling_matches_target_distribution(checkpoints, strategy):
    """First two generated tokens (the second one goes through tree acceptance) over seeds."""
    from treegraft_mlx import generate, load

    family = load(checkpoints["llama"], drafters=[checkpoints["qwen3"]])
    settings = SamplerSettings(temp=1.5, top_k=3)
    ids = family.tokenizer.encode("def add(a, b):\n    return a + b\ndef add(")
    exact = exact_pair_distribution(family.target, ids, settings)
    keys = sorted(exact)
    counts = np.zeros(len(keys))
    for seed in range(800):
        out = generate(family, ids, strategy, max_tokens=2, temp=1.5, top_k=3, seed=seed)
        counts[keys.index(tuple(out.token_ids))] += 1
    probs = np.array([exact[k] for k in keys])
    assert len(keys) - 1 in CHI2_CRIT_001
    assert chi_square(counts, probs) < CHI2_CRIT_001[len(keys) - 1]


def test_expected_path_length_matches_the_acceptance_rules(placement):
    """The value system's expected accepted length: Monte Carlo over accept_sample agrees
    (within 4 standard errors), and with one-hot (greedy) rows it is the greedy path length."""
    tree, logits = constructed_case()
    settings = SamplerSettings(temp=1.0)
    probs = np.array(target_probs(logits, settings), dtype=np.float64)
    want = expected_path_length(tree, probs)
    # root: children 2 (p .4), 4 (.3), 5 (.1); after 2: child 1 (p .2) -> 1 + .8 + .4*.2
    assert want == pytest.approx(1.0 + 0.4 * 1.2 + 0.3 + 0.1, rel=1e-4)
    rng = np.random.default_rng(3)
    lengths = np.array([len(accept_sample(tree, logits, settings, rng).path) for _ in range(8000)])
    assert abs(lengths.mean() - want) < 4 * lengths.std() / np.sqrt(len(lengths))
    greedy = SamplerSettings()
    one_hot = np.array(target_probs(logits, greedy), dtype=np.float64)
    assert expected_path_length(tree, one_hot) == len(accept_greedy(tree, logits).path) == 2


def test_greedy_acceptance_follows_the_twin_that_accepts_longest(placement):
    """A queued chain may hang beside a sibling that carries the same token: greedy
    acceptance follows both and keeps the longer accepted path (the first on a tie), so a
    chain that agrees with the tree's own drafts never shortens what the tree accepts."""
    from treegraft_mlx.tree import NGRAM, STRONG, DraftTree

    tree = DraftTree.rooted_at(0)
    a = tree.add(0, 1, 0.0, by=NGRAM)                  # the n-gram drafter: 1, then 9
    tree.add(a, 9, 0.0, by=NGRAM)
    b, c = tree.append_chain([1, 2], STRONG)           # the chain: 1, then 2
    argmax = {0: 1, a: 5, 2: 5, b: 2, c: 7}            # the target: 1, 2, 7
    logits = mx.array(np.eye(10, dtype=np.float32)[[argmax[v] for v in range(len(tree))]])
    acc = accept_greedy(tree, logits)
    assert acc.path == [0, b, c] and acc.bonus == 7
    argmax[b] = 4                                      # now neither goes past depth 1
    logits = mx.array(np.eye(10, dtype=np.float32)[[argmax[v] for v in range(len(tree))]])
    acc = accept_greedy(tree, logits)
    assert acc.path == [0, a] and acc.bonus == 5
