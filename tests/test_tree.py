"""Tree bookkeeping and drafters' tree logic, without any model (or with a tiny random one)."""

import mlx.core as mx
import numpy as np
import pytest

from treegraft_mlx.drafters import ModelDrafter, NgramDrafter, NgramIndex
from treegraft_mlx.history import History
from treegraft_mlx.tree import (NGRAM, STRONG, DraftTree, ancestor_mask, attention_mask,
                                build_cap, depths, graft_chain, path_to, positions,
                                prune, reach)


def small_tree() -> DraftTree:
    #        0
    #      /   \
    #     1     2
    #    / \     \
    #   3   4     5
    #   |
    #   6
    t = DraftTree.rooted_at(100)
    t.add(0, 11, -1.0)
    t.add(0, 12, -0.5)
    t.add(1, 13, -3.0)
    t.add(1, 14, -1.5)
    t.add(2, 15, -0.7)
    t.add(3, 16, -0.6)  # scores need not decrease along a path
    return t


def test_mask_positions_paths():
    t = small_tree()
    m = ancestor_mask(t.parent)
    assert m[6].tolist() == [True, True, False, True, False, False, True]
    assert m[5].tolist() == [True, False, True, False, False, True, False]
    assert depths(t.parent).tolist() == [0, 1, 1, 2, 2, 2, 3]
    assert path_to(t.parent, 6) == [0, 1, 3, 6]
    assert t.path_tokens(6) == [100, 11, 13, 16]
    full = attention_mask(t.parent, context=4, prefix=2).dense()
    assert full.shape == (9, 4 + 9)
    assert full[0, :7].tolist() == [True] * 5 + [False] * 2  # prefix row 0: context + itself
    assert full[1, :7].tolist() == [True] * 6 + [False]
    assert full[2 + 6, 6:].tolist() == m[6].tolist() and full[2 + 6, :6].all()
    assert np.array(positions(t.parent, 4, 2)).tolist() == [4, 5, 6, 7, 7, 8, 8, 8, 9]


def test_prune_keeps_ancestors_and_budget():
    t = small_tree()
    keep = prune(t, 4)
    # ranking: 2 (-0.5), 6 (-0.6, needs 1 and 3), 5 (-0.7), 1 (-1.0) ...
    assert keep.tolist() == [0, 1, 2, 5]  # 6 would need 1 and 3 too: it does not fit
    for v in keep:
        for a in path_to(t.parent, int(v)):
            assert a in keep
    assert len(prune(t, 5)) == 5
    assert prune(t, 5).tolist() == [0, 1, 2, 3, 6]
    sub = t.subtree(prune(t, 5))
    assert sub.token == [100, 11, 12, 13, 16] and sub.parent == [-1, 0, 0, 1, 3]
    assert sub.child(3, 16) == 4
    assert prune(t, 100).tolist() == list(range(7))


def test_add_merges_existing_child_with_max_score():
    t = small_tree()
    n = len(t)
    assert t.add(1, 13, -9.0) == 3 and t.score[3] == -3.0
    assert t.add(1, 13, -2.0) == 3 and t.score[3] == -2.0
    assert len(t) == n


def test_drafted_by_is_kept_merged_and_travels_with_the_nodes():
    """Which drafters proposed a node: a second drafter proposing the same token ORs its bit
    in, and copies, subtrees and re-rooted trees keep every node's bits."""
    t = DraftTree.rooted_at(100)
    a = t.add(0, 11, -1.0, by=NGRAM)
    b = t.add(a, 12, -2.0, by=STRONG)
    assert t.drafted_by == [0, NGRAM, STRONG]
    assert t.add(0, 11, -0.5, by=STRONG) == a and t.drafted_by[a] == NGRAM | STRONG
    assert t.add(a, 12, -3.0, by=STRONG) == b and t.drafted_by[b] == STRONG
    assert t.copy().drafted_by == t.drafted_by
    assert t.subtree(np.array([0, 1, 2])).drafted_by == t.drafted_by
    assert t.rerooted(a).drafted_by == [NGRAM | STRONG, STRONG]
    path = graft_chain(t, [12, 13], [-0.1, -2.0], cap=10)       # S's chain: STRONG
    assert t.drafted_by[path[1]] == STRONG and t.drafted_by[path[2]] == STRONG


def test_ngram_index_incremental_equals_rebuilt():
    rng = np.random.default_rng(0)
    tokens = [int(x) for x in rng.integers(0, 6, size=300)]
    inc = NgramIndex(4)
    for end in range(0, 301, 37):
        inc.extend(tokens[:end])
    inc.extend(tokens)
    full = NgramIndex(4)
    full.extend(tokens)
    assert dict(inc.ends) == dict(full.ends)
    assert inc.most_frequent == full.most_frequent
    gram = tuple(tokens[10:13])
    assert all(tuple(tokens[e - 2:e + 1]) == gram for e in inc.occurrences(gram))


def test_ngram_guess_is_what_followed_the_longest_earlier_match():
    """The shadow guess a plain AR step makes: the token after the most recent earlier
    occurrence of the longest suffix that occurred before (the suffix itself excluded)."""
    index = NgramIndex(3)
    tokens = [1, 2, 3, 9, 5, 2, 3, 8, 4, 2, 3]
    index.extend(tokens)
    assert index.guess(tokens) == 8          # "2 3" last seen at 6, followed by 8 ("1 2 3": none)
    tokens += [7]
    index.extend(tokens)
    assert index.guess(tokens) == -1         # 7 never occurred before
    tokens = [4, 1, 2, 1, 2, 5, 1, 2]
    index = NgramIndex(3)
    index.extend(tokens)
    assert index.guess(tokens) == 5          # "5 1 2" occurred only here; "1 2" last at 4
    index.extend(tokens + [6])               # an index ahead of the tokens asked about
    assert index.guess(tokens) == 5


def history_of(tokens):
    h = History(tokens, capacity=len(tokens) + 8)
    return h


def test_ngram_layer_chains_scores_and_termination():
    # context: "1 2 3 4 5 6 | 1 2 3 7 8 | 1 2 3" ; root = the last 3
    tokens = [1, 2, 3, 4, 5, 6, 1, 2, 3, 7, 8, 1, 2, 3]
    h = history_of(tokens)
    lp = np.full(len(tokens) - 1, -14.0, dtype=np.float32)
    lp[8] = -0.25                       # target log-prob of 7 (tokens[9]) after position 8
    h.keep(0, lp)
    d = NgramDrafter(n_max=5, top_k=2, depth=5)
    d.observe(h, len(tokens))
    t = DraftTree.rooted_at(3)
    frontier = d.expand(t, [0], 1, h)
    # two continuations of "1 2 3": "7 8 1 2 3" (recent) and "4 5 6 1 2"; chains reach depth 5
    assert t.path_tokens(5) == [3, 7, 8, 1, 2, 3]
    assert max(t.depth) == 5
    first7, first4 = t.child(0, 7), t.child(0, 4)
    assert frontier == [first7, first4]  # same match length: the more recent first
    assert not t.terminated[0]  # top_k = 2 distinct first tokens were found
    assert t.score[first7] == -0.25                      # scored from the recorded log-prob
    assert t.score[first4] == -14.0                      # the score of 4 after position 3
    assert t.score[t.child(first7, 8)] == float("-inf")  # deeper chain tokens are unscored
    assert len(t) <= build_cap(2, 5)
    assert t.drafted_by[1:] == [NGRAM] * (len(t) - 1)     # every node is the n-gram drafter's
    # layer 2 proposes chains of length 4 under each frontier node, merging into existing ones
    before = len(t)
    d.expand(t, frontier, 2, h)
    assert len(t) >= before and max(t.depth) == 5

    # with top_k = 10 the same search finds too few branches: the root is terminated and
    # its children do not enter the next frontier
    wide = NgramDrafter(n_max=5, top_k=10, depth=5)
    wide.observe(h, len(tokens))
    t = DraftTree.rooted_at(3)
    assert wide.expand(t, [0], 1, h) == [] and t.terminated[0] and len(t) > 1


def test_ngram_layer1_fallback_adds_most_frequent_token():
    h = history_of([5, 5, 9, 5, 7])
    d = NgramDrafter()
    d.observe(h, 5)
    t = DraftTree.rooted_at(42)  # 42 never occurred: no match at all
    out = d.expand(t, [0], 1, h)
    assert t.token[1:] == [5] and out == [1] and t.drafted_by[1] == NGRAM


class FakeStrong:
    """A drafter model whose next-token log-probs depend only on the last token."""

    def __init__(self, vocab=12):
        self.args = type("A", (), {"max_position_embeddings": 64, "num_hidden_layers": 1})()
        rng = np.random.default_rng(1)
        self.table = rng.standard_normal((vocab, vocab)).astype(np.float32) * 3

    def make_cache(self, max_len=None):
        from treegraft_mlx.cache import KVCache
        return KVCache(1, 1, 2, 256)

    def __call__(self, ids, cache=None, positions=None, mask=None, logits_rows=None):
        ids = np.array(ids)[0]
        if cache is not None:  # emulate the cache protocol: block pending, then caller commits
            cache.pending = len(ids)
        out = self.table[ids]
        if logits_rows is not None:
            out = out[np.array(logits_rows)]
        return mx.array(out[None])


@pytest.mark.parametrize("on_gpu", [False, True])      # numpy path; MLX path (a GPU's)
def test_graft_rescores_reselects_shallow_and_deletes_nothing(monkeypatch, on_gpu):
    monkeypatch.setattr("treegraft_mlx.drafters.model.on_gpu", lambda: on_gpu)
    h = history_of([1, 2, 3, 4])
    strong = ModelDrafter(FakeStrong(), top_k=3, depth=5)
    t = DraftTree.rooted_at(4)
    a = t.add(0, 9, 0.0)
    b = t.add(a, 10, 0.0)
    c = t.add(b, 11, 0.0)
    before = [(t.parent[i], t.token[i]) for i in range(len(t))]
    frontier = strong.expand(t, [c], 4, h)
    after = [(t.parent[i], t.token[i]) for i in range(len(t))]
    assert after[:len(before)] == before                   # nothing deleted or moved
    logp = strong.model.table - np.log(np.exp(strong.model.table).sum(-1, keepdims=True))
    assert np.isclose(t.score[a], logp[4, 9], atol=1e-5)  # full replacement of scores
    assert np.isclose(t.score[b], logp[4, 9] + logp[9, 10], atol=1e-5)
    # the root (depth 0) is within the lookback: its best children are grafted
    best_root = set(np.argsort(-logp[4])[:3].tolist())
    assert {t.token[i] for i in t.children_of(0)} >= best_root
    assert len(frontier) <= 3 and all(t.parent[f] in (0, a, b, c) for f in frontier)
    grafted = [t.child(0, tok) for tok in best_root]
    assert all(t.drafted_by[g] & STRONG for g in grafted)


def test_a_queued_chain_is_the_drafters_greedy_continuation_with_its_logprobs():
    h = history_of([1, 2, 3, 4])
    strong = ModelDrafter(FakeStrong(), top_k=3, depth=5)
    chain = strong.queue_chain(5, 4, h)
    assert strong.cache.offset == h.committed and strong.calls == 4   # chain rows dropped
    tokens, logps = chain.read()                                      # read back only now
    logp = strong.model.table - np.log(np.exp(strong.model.table).sum(-1, keepdims=True))
    expected, last = [], 5
    for _ in range(4):
        last = int(np.argmax(logp[last]))
        expected.append(last)
    assert tokens == expected and len(chain) == 4 and chain.drawn_from is None
    assert np.allclose(logps, [logp[a, b] for a, b in zip([5] + expected, expected)], atol=1e-5)


def test_a_sampled_chain_draws_each_token_on_the_device_and_keeps_its_distribution():
    """With `draw`, each chain token is drawn from the processed distribution of the
    drafter's row at its parent (not the argmax), the chain goes on from it, and each q
    the tokens came from is kept for acceptance."""
    from treegraft_mlx.sampling import DeviceDraws, SamplerSettings

    h = history_of([1, 2, 3, 4])
    strong = ModelDrafter(FakeStrong(), top_k=3, depth=5)
    settings = SamplerSettings(temp=1.0, top_k=2)
    chain = strong.queue_chain(5, 3, h, DeviceDraws(settings, mx.random.key(3)))
    tokens, logps = chain.read()
    logp = strong.model.table - np.log(np.exp(strong.model.table).sum(-1, keepdims=True))
    q = np.array(chain.drawn_from)
    for u, v, row in zip([5] + tokens[:-1], tokens, q):
        two = np.argsort(-logp[u])[:2]
        assert v in two.tolist() and np.flatnonzero(row).tolist() == sorted(two.tolist())
        assert np.allclose(row[two], np.exp(logp[u, two]) / np.exp(logp[u, two]).sum(),
                           atol=1e-5)
    draws = {tuple(strong.queue_chain(5, 3, h, DeviceDraws(settings, mx.random.key(s)))
                   .read()[0]) for s in range(30)}
    assert len(draws) > 1                                # drawn, not the argmax every time


def test_a_chain_appended_beside_its_twin_keeps_its_own_rows():
    """A queued chain joins the tree after verification as new nodes, even where a sibling
    carries the same token (its rows are its own); lookups find the first of twins, and
    both carry both drafters' bits."""
    t = DraftTree.rooted_at(4)
    a = t.add(0, 9, -0.1, by=NGRAM)
    t.add(a, 3, -0.2, by=NGRAM)
    nodes = t.append_chain([9, 10], STRONG, drawn=True)
    assert nodes == [3, 4] and t.parent[3:] == [0, 3] and t.depth[3:] == [1, 2]
    assert t.child(0, 9) == a and t.children_of(0) == [a, 3] and t.child(3, 10) == 4
    assert t.drafted_by[a] == t.drafted_by[3] == NGRAM | STRONG and t.drafted_by[4] == STRONG
    assert t.drawn == {3, 4} and t.subtree(np.array([0, 3])).drawn == {1}


def test_reach_measures_the_ngram_drafts_and_the_chain_apart():
    """How deep each drafter's drafts matched the committed tokens: the n-gram drafts by the
    deepest matching path among the nodes before the chain (never through the chain's own
    twin), the chain by its matching prefix, of the depths the block shows."""
    t = DraftTree.rooted_at(4)
    a = t.add(0, 9, -0.1, by=NGRAM)
    t.add(a, 3, -0.2, by=NGRAM)
    t.add(0, 5, -0.3, by=NGRAM)
    t.append_chain([9, 10, 12], STRONG)
    assert reach(t, 4, [9, 3, 8]) == (2, 1, 3)       # n-gram 9 3; the chain's 10 missed
    assert reach(t, 4, [9, 10, 12, 7]) == (1, 3, 3)  # the whole chain; the n-gram tree 9
    assert reach(t, 4, [9, 10]) == (1, 2, 2)         # a block of two shows two depths
    assert reach(t, 4, [6]) == (0, 0, 1)


def test_graft_chain_merges_into_the_tree_and_respects_the_cap():
    t = DraftTree.rooted_at(4)
    a = t.add(0, 9, -0.1, ngram_lp=-0.2)                  # the n-gram drafter's node
    t.add(0, 7, -0.3)
    path = graft_chain(t, [9, 10, 11], [-0.5, -1.0, -2.0], cap=5)
    assert path[:2] == [0, a] and len(t) == 5             # 9 reused, 10 added, 11 over the cap
    assert t.draft_lp[a] == -0.5 and t.draft_rank[a] == 0 and t.votes[a] == 1
    assert t.token[path[2]] == 10 and t.depth[path[2]] == 2 and t.draft_lp[path[2]] == -1.0
    assert np.isclose(t.score[path[2]], -1.5) and np.isnan(t.draft_lp[2])


def test_pad_map_picks_the_fastest_block_at_least_as_big():
    from treegraft_mlx.timing import pad_map
    from treegraft_mlx.family import TreeConfig

    latency = {1: 10.0, 2: 12.0, 3: 20.0, 4: 15.0, 5: 30.0, 6: 31.0, 7: 33.0, 8: 25.0}
    pad = pad_map(latency, 8)
    assert pad == (1, 2, 4, 4, 8, 8, 8, 8)
    cfg = TreeConfig(budget=8, verify_pad=pad)
    assert [cfg.rows_for(n) for n in (1, 3, 5, 8, 9)] == [1, 4, 8, 8, 9]
    with pytest.raises(ValueError, match="must not shrink"):
        TreeConfig(verify_pad=(1, 1))


def test_path_probability_and_best_size_per_step():
    from treegraft_mlx.tree import path_probability, plan_verification

    t = small_tree()
    a = np.array([1.0, 0.9, 0.2, 0.5, 0.1, 0.9, 0.8])
    prob = path_probability(t.parent, a)
    assert prob == pytest.approx([1, 0.9, 0.2, 0.45, 0.09, 0.18, 0.36])
    # Flat costs: every node is worth verifying; E = 1 + sum of the path probabilities.
    flat = np.full(7, 10.0)
    plan = plan_verification(t, a, flat, rate=0.01)
    assert plan.keep.tolist() == list(range(7)) and plan.expected == pytest.approx(prob.sum())
    # Step costs 10, 11, 12, 13, 30...: at 0.1 tokens/ms the best set is the best-first
    # prefix of 4 nodes (0, 1, 3, 6: E = 2.71, value 2.71 - 1.3 = 1.41 beats 1.9 - 1.1).
    ms = np.array([10.0, 11, 12, 13, 30, 31, 32])
    plan = plan_verification(t, a, ms, rate=0.1)
    assert plan.keep.tolist() == [0, 1, 3, 6]
    assert plan.expected == pytest.approx(2.71) and plan.step_ms == 13
    # Pricier time: the root alone (an AR step) wins.
    plan = plan_verification(t, a, np.array([10.0, 25, 40, 55, 70, 85, 100]), rate=0.1)
    assert plan.keep.tolist() == [0] and plan.expected == 1.0
    # A table shorter than the tree caps the block.
    assert len(plan_verification(t, a, flat[:3], rate=0.0).keep) == 3


def test_every_prefix_of_the_best_first_order_is_ancestor_closed():
    from treegraft_mlx.tree import plan_verification

    rng = np.random.default_rng(0)
    for _ in range(50):
        t = DraftTree.rooted_at(0)
        for tok in range(1, 30):
            t.add(int(rng.integers(len(t))), tok, 0.0)
        a = rng.random(len(t))
        a[rng.random(len(t)) < 0.2] = 1.0                 # ties with the parent
        for n in range(1, len(t) + 1):
            ms = np.r_[np.zeros(n), np.full(len(t) - n, 1e9)]
            keep = set(plan_verification(t, a, ms, rate=1.0).keep.tolist())
            assert len(keep) == n
            assert all(t.parent[v] in keep for v in keep if v)


def test_rerooted_subtree_keeps_evidence_and_shifts_depth():
    t = small_tree()
    t.add(1, 13, -2.0, 3, 7, ngram_lp=-0.25)            # merge: one vote, its log-prob
    sub = t.rerooted(1)
    assert sub.token == [11, 13, 14, 16] and sub.parent == [-1, 0, 0, 1]
    assert sub.depth == [0, 1, 1, 2]
    assert sub.child(0, 13) == 1 and sub.child(1, 16) == 3
    assert sub.votes[1] == 1 and sub.ngram_lp[1] == -0.25 and sub.match_len[1] == 3
    assert np.isnan(sub.ngram_lp[2]) and sub.votes[2] == 0
    assert t.rerooted(0).token == t.token
