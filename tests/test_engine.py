"""Engine: exact greedy output for every strategy, exact stopping, drafter cache sync."""

import dataclasses
from collections import Counter
from itertools import groupby, islice
from pathlib import Path

import mlx.core as mx
import mlx_lm
import numpy as np
import pytest

from schedulers import threshold_mlp
from scores import reference_scores
from scripted import deterministic
from treegraft_mlx import fixture_path, generate, load
from treegraft_mlx.bench import first_per_category, read_prompts
from treegraft_mlx.drafters import ModelDrafter
from treegraft_mlx.decoder import Decoder
from treegraft_mlx.strategy import parse_strategy
from treegraft_mlx.engine import make_decoder, stream_generate
from treegraft_mlx.session import Session
from treegraft_mlx.generate import encode_prompt, stream
from treegraft_mlx.history import History
from treegraft_mlx.scheduler import LearnedSchedule
from treegraft_mlx.sampling import SamplerSettings
from treegraft_mlx.tree import DraftTree

SUITE = Path(__file__).parents[1] / "benchmarks/prompts/public.jsonl"
STRATEGIES = ["chain", "ngram", "draft", "treegraft", "treegraft-fixed:2,4"]
NEW_TOKENS = 64
REPETITIVE = "a = 1\nb = 2\n" * 8   # the n-gram drafter accepts several tokens per step here
DRAFTED = {"ngram", "draft", "both"}


@pytest.fixture(scope="module")
def family():
    return deterministic(load(fixture_path()))


def suite_prompts(per_category: int = 5) -> list[dict]:
    return first_per_category(read_prompts(SUITE), per_category)


@pytest.fixture(scope="module")
def mlx_lm_target():
    model, tokenizer = mlx_lm.load(str(fixture_path() / "target"))
    model.set_dtype(mx.float32)  # our runtime computes in fp32 on CPU: compare like with like
    return model, tokenizer


def test_greedy_output_identical_for_every_strategy(family, mlx_lm_target):
    """`ar` equals mlx_lm, and every strategy equals `ar`, token for token, on two prompts of
    each category (8 x 7 generations of 64 tokens)."""
    prompts = suite_prompts(2)
    assert len(prompts) == 8
    ref_model, ref_tok = mlx_lm_target
    trees: dict[str, list[bool]] = {s: [] for s in STRATEGIES}
    accepted = {s: 0 for s in STRATEGIES}
    for p in prompts:
        ar = generate(family, p["prompt"], "ar", max_tokens=NEW_TOKENS)
        assert ar.generation_tokens >= 1
        ids = ref_tok.encode(p["prompt"])
        ref = []   # mlx_lm stops on its own: an early end of ours would show
        for r in mlx_lm.stream_generate(ref_model, ref_tok, ids, max_tokens=NEW_TOKENS):
            if r.token in ref_tok.eos_token_ids:
                break
            ref.append(r.token)
        assert ar.token_ids == ref, p["id"]
        for s in STRATEGIES:
            out = generate(family, p["prompt"], s, max_tokens=NEW_TOKENS)
            assert out.token_ids == ar.token_ids, (p["id"], s)
            assert out.text == ar.text
            assert out.steps <= ar.steps
            trees[s] += [st.rows > 1 for st in out.step_stats]
            accepted[s] += sum(st.accepted for st in out.step_stats)
    # Identity must not hold only because every step was an AR step: each strategy verified
    # trees and committed drafts (sizing reads scripted costs and clock: no load dependence).
    for s in STRATEGIES:
        assert sum(trees[s]) >= 20 and accepted[s] >= 40, (s, sum(trees[s]), accepted[s])


@pytest.mark.parametrize("strategy", ["ar", "ngram", "treegraft"])
def test_the_first_token_is_out_before_any_step(family, strategy):
    """Time to first token is the prefill's, as with mlx_lm: the first block is the prefill's
    token alone, yielded before any step ran (greedy: `ar`'s first token)."""
    prompt = suite_prompts(1)[0]["prompt"]
    want = generate(family, prompt, "ar", max_tokens=1).token_ids
    dec = make_decoder(Session(family), parse_strategy(strategy), SamplerSettings(),
                       np.random.default_rng(0))
    steps = dec.steps(family.tokenizer.encode(prompt))
    assert next(steps) == want and dec.stats == []
    assert len(next(steps)) >= 1 and len(dec.stats) == 1


def test_the_trace_has_a_line_per_step(family, capsys):
    """TREEGRAFT_TRACE / --trace: one line per step on stderr (and one per stretch), none
    unless asked."""
    prompt = suite_prompts(1)[0]["prompt"]
    out = generate(family, prompt, "treegraft", max_tokens=24, trace=True)
    lines = capsys.readouterr().err.splitlines()
    steps = [line for line in lines if line.startswith("step ")]
    assert len(steps) == len(out.step_stats) > 0
    assert steps[0].startswith("step 1: ") and all(
        line.startswith(("step ", "stretch ")) for line in lines)
    generate(family, prompt, "treegraft", max_tokens=24, trace=False)
    assert capsys.readouterr().err == ""


def test_max_tokens_and_eos_inside_accepted_blocks(family):
    # The bundle's fixed tree: per-step sizing follows this machine's measured times (a busy
    # machine may make every step an AR step), and this test is about stopping inside blocks.
    fixed = dataclasses.replace(family.tree, adaptive=False)
    prompt = suite_prompts(1)[1]["prompt"]  # copy-heavy: long accepted blocks
    ar = generate(family, prompt, "ar", max_tokens=96)
    res = generate(family, prompt, "treegraft", max_tokens=96, tree=fixed)
    assert max(s.accepted for s in res.step_stats) >= 2  # blocks longer than one token occur
    for n in (1, 7, 33, 95):
        cut = generate(family, prompt, "treegraft", max_tokens=n, tree=fixed)
        assert cut.token_ids == ar.token_ids[:n] and cut.finish_reason == "length"
    # Declare a token from the middle of a long accepted block an end-of-sequence token.
    pos, start = None, 1                # token 0 is the prefill's; each step's block follows
    for s in res.step_stats:
        if s.accepted >= 2:
            pos = start + 1
            break
        start += s.accepted + 1
    stop_id = res.token_ids[pos]
    first = res.token_ids.index(stop_id)
    family.tokenizer.add_eos_token(stop_id)
    try:
        for strategy in ("ar", "treegraft", "ngram"):
            out = generate(family, prompt, strategy, max_tokens=96, tree=fixed)
            assert out.token_ids == ar.token_ids[:first] and out.finish_reason == "stop"
    finally:
        family.tokenizer._eos_token_ids.discard(stop_id)


def test_stop_strings_cut_exactly_and_emit_nothing_past_them(family):
    tok = family.tokenizer
    ids = tok.encode("alpha = 1\nbeta = 2\ngamma = 3\n")
    blocks = [ids[:3], ids[3:9], ids[9:]]
    pieces = list(stream(tok, iter(blocks), 0, 100, stop_strings=["beta ="]))
    assert "".join(p.text for p in pieces) == "alpha = 1\n"
    assert pieces[-1].finish_reason == "stop"
    pieces = list(stream(tok, iter(blocks), 0, 100, stop_strings=["zzz"]))
    assert "".join(p.text for p in pieces) == "alpha = 1\nbeta = 2\ngamma = 3\n"


@pytest.mark.parametrize("strategy, adaptive, drafted", [
    ("ar", True, set()), ("ngram", True, {"ngram"}), ("ngram", False, {"ngram"}),
    ("chain", True, {"draft"}), ("treegraft-fixed:2,4", False, {"ngram", "draft", "both"})])
def test_each_committed_token_has_its_source(family, strategy, adaptive, drafted):
    """Decoder.sources has one entry per committed token: each block is the drafts its step
    accepted, named by the drafters that proposed them, then one token of the target's own
    (the prefill's first), so `ar` names only the target, and each drafter's accepted drafts
    carry its name (both drafters' where they proposed the same token)."""
    tree = dataclasses.replace(family.tree, adaptive=adaptive)
    dec = make_decoder(Session(family, tree), parse_strategy(strategy), SamplerSettings(),
                       np.random.default_rng(0))
    blocks = list(islice(dec.steps(encode_prompt(family.tokenizer, REPETITIVE)), 30))
    assert len(dec.sources) == sum(map(len, blocks))
    at = 0
    for k, block in enumerate(blocks):
        mine, at = dec.sources[at:at + len(block)], at + len(block)
        assert mine[-1] == "target" and set(mine[:-1]) <= DRAFTED, (k, mine)
        assert k == 0 or len(block) - 1 == dec.stats[k - 1].accepted
    assert set(dec.sources) - {"target"} == drafted, Counter(dec.sources)


def merged(runs: list) -> list[tuple[str, str]]:
    """(text, source) runs with neighbours of one source joined."""
    return [("".join(t for t, _ in group), src) for src, group in groupby(runs, lambda r: r[1])]


@pytest.mark.parametrize("stops", [[], ["beta ="], ["= 3"], ["ta ="], ["3\nzz"]])
def test_provenance_follows_each_tokens_text_through_stops(family, stops):
    """Each piece's provenance runs make up exactly its text, and every character is
    attributed to the token that produced it, also where a stop string cuts a block or held
    back text is released at the end."""
    tok = family.tokenizer
    ids = tok.encode("alpha = 1\nbeta = 2\ngamma = 3\n", add_special_tokens=False)
    names = ["target", "ngram", "draft", "both"]
    origin = lambda i: names[i * 7 % 4]       # noqa: E731  neighbours differ, some repeat
    pieces = list(stream(tok, iter([ids[:3], ids[3:9], ids[9:]]), 0, 100, stops, origin=origin))
    text = "".join(p.text for p in pieces)
    assert all("".join(t for t, _ in p.provenance) == p.text for p in pieces)
    owners = [origin(i) for i, t in enumerate(ids) for _ in tok.decode([t])]
    expected = merged([(ch, owners[i]) for i, ch in enumerate(text)])
    assert merged([r for p in pieces for r in p.provenance]) == expected
    assert len(expected) > 3


def test_stream_generate_text_and_provenance_with_a_stop_string(family):
    """Greedy output is unchanged by the bookkeeping (every strategy: `ar`'s text, cut at a
    stop string late in it), the runs make up each piece, `ar` is all the target's, and the
    n-gram drafter's accepted drafts show on a copy-heavy prompt."""
    prompt = suite_prompts(1)[1]["prompt"]
    ar = generate(family, prompt, "ar", max_tokens=64).text
    at = next(k for k in range(len(ar) // 2, len(ar) - 4) if ar.find(ar[k:k + 4]) == k)
    seen = {}
    for strategy in ("ar", "ngram", "treegraft"):
        pieces = list(stream_generate(family, prompt, strategy, max_tokens=64,
                                      stop=[ar[at:at + 4]], provenance=True))
        assert "".join(p.text for p in pieces) == ar[:at], strategy
        assert all("".join(t for t, _ in p.provenance) == p.text for p in pieces)
        seen[strategy] = {src for p in pieces for _, src in p.provenance}
    assert seen["ar"] == {"target"} and "ngram" in seen["ngram"]
    assert not next(stream_generate(family, prompt, "ngram", max_tokens=4)).provenance  # opt-in


def test_strong_drafter_cache_sync_after_skipped_calls(family):
    """After many steps with skipped calls, S's logits equal a fresh forward."""
    prompt = suite_prompts(1)[0]["prompt"]
    session = Session(family)
    dec = make_decoder(session, parse_strategy("treegraft-fixed:4"), SamplerSettings(),
                       np.random.default_rng(0))
    steps = dec.steps(family.tokenizer.encode(prompt))
    for _ in range(12):
        next(steps)
    strong: ModelDrafter = session.strong
    history = session.history
    tree = DraftTree.rooted_at(history.root)
    got = strong._run_new_nodes(tree, history).logp[0]
    fresh = family.strong(mx.array([history.tokens]))[0, -1].astype(mx.float32)
    fresh = fresh - mx.logsumexp(fresh)
    assert strong.cache.offset == history.committed + 1
    assert mx.abs(got - fresh).max().item() < 1e-4
    strong.observe(history, 0)
    assert strong.cache.offset == history.committed


def test_strong_drafter_runs_only_new_nodes_and_matches_one_forward(family):
    """Two combine layers in one step: the second runs only the nodes added since the first,
    and every node's log-probs equal those of one forward over the whole tree; a snapshot
    restores the state exactly (the calibration's counterfactual branches rely on it)."""
    ids = family.tokenizer.encode(suite_prompts(1)[0]["prompt"])
    history = History(ids, capacity=len(ids) + 8)
    strong = ModelDrafter(family.strong, top_k=3, depth=4)
    tree = DraftTree.rooted_at(history.root)
    frontier = strong.expand(tree, [0], 1, history)
    before = strong.snapshot()
    frontier = strong.expand(tree, frontier, 2, history)
    assert strong._step.done == 4 and len(tree) > 4
    strong._run_new_nodes(tree, history)
    incremental = strong._step.logp
    whole = ModelDrafter(family.strong, top_k=3, depth=4)._run_new_nodes(tree, history).logp
    assert mx.abs(incremental - whole).max().item() < 1e-4
    strong.restore(before)
    assert strong._step.done == 1 and strong.cache.offset == history.committed + 1
    again = strong._run_new_nodes(tree, history).logp
    assert mx.abs(again - whole).max().item() < 1e-4


def test_commit_records_what_the_target_saw_and_counts_blocks(family):
    """Every committed position keeps the target's score of a plain forward (not the tree's
    first rows, not one position late, against the token that followed), and the step
    statistics count each block's drafts without the root: their blocks add up to the tokens
    generated."""
    fixed = dataclasses.replace(family.tree, adaptive=False)
    session = Session(family, fixed)
    prompt = suite_prompts(1)[1]["prompt"]
    out = generate(family, prompt, "ngram", max_tokens=48, tree=fixed, session=session)
    assert max(s.accepted for s in out.step_stats) >= 2
    history = session.history
    n = history.committed
    want = reference_scores(family.target, history.tokens, n)
    assert np.abs(history.scores(n) - want).max() < 1e-3
    blocks = 1 + np.cumsum([s.accepted + 1 for s in out.step_stats])   # after the prefill's
    assert blocks[-2] < len(out.token_ids) <= blocks[-1]


def test_the_tree_step_returns_what_the_history_gained(family):
    """The step every loop shares returns exactly the tokens appended after the root."""
    from treegraft_mlx.step import tree_step
    from treegraft_mlx.drafters import Drafters

    session = Session(family)
    ids = family.tokenizer.encode(suite_prompts(1)[1]["prompt"])
    root = session.prefill(ids, SamplerSettings(), np.random.default_rng(0))
    tree = DraftTree.rooted_at(root)
    session.ngram.expand(tree, [0], 1, session.history)
    before = len(session.history.tokens)
    step = tree_step(session, Drafters(session.ngram), tree, len(tree), SamplerSettings(),
                     np.random.default_rng(0))
    new, bonus = step.block, step.acceptance.bonus
    assert session.history.tokens[before:] == new and new[-1] == bonus == session.history.root


def test_unknown_strategy_and_missing_drafter_are_clear(family):
    with pytest.raises(ValueError, match="unknown strategy"):
        generate(family, "x = 1", "fastest")
    target_only = load(fixture_path() / "target")
    for strategy in ("draft", "chain:2", "treegraft-fixed:1"):
        with pytest.raises(ValueError, match="needs a strong drafter"):
            generate(target_only, "x = 1", strategy)
    ar = generate(target_only, "x = 1\ny = 2\n", "ar", max_tokens=24).token_ids
    for strategy in ("ngram", "treegraft"):       # treegraft: the tree of the drafters it has
        out = generate(target_only, "x = 1\ny = 2\n", strategy, max_tokens=24)
        assert out.token_ids == ar and out.drafter_calls == 0, strategy


def test_padded_verification_gives_the_same_logits_and_cache(family):
    """Inert padding rows change neither the real rows' logits nor what the cache keeps."""
    from treegraft_mlx.verify import verify

    ids = family.tokenizer.encode(suite_prompts(1)[0]["prompt"])
    tree = DraftTree.rooted_at(ids[-1])
    a = tree.add(0, 11, 0.0)
    tree.add(a, 12, 0.0)
    tree.add(0, 13, 0.0)
    out = []
    for rows in (0, 8):
        session = Session(family)
        session.prefill(ids[:-1], SamplerSettings(), np.random.default_rng(0))
        logits = verify(family.target, session.cache, tree, rows)
        session.cache.keep([0, 1, 2])
        nxt = family.target(mx.array([[7]]), cache=session.cache)[0, -1]
        out.append((logits, nxt))
    assert out[1][0].shape == (4, family.target.args.vocab_size)
    assert mx.abs(out[0][0] - out[1][0]).max().item() < 1e-4
    assert mx.abs(out[0][1] - out[1][1]).max().item() < 1e-4


class OneByOne:
    """The learned rule applied one layer at a time: one MLP evaluation per layer, reading
    no further than the layer it decides (the reference for the batched look-ahead)."""

    def __init__(self, inner: LearnedSchedule):
        self.inner, self.evaluations = inner, 0

    def first_call(self, ahead, num_drafters):
        for i, state in enumerate(ahead):
            self.evaluations += 1
            if self.inner.first_call(iter([state]), num_drafters) == 0:
                return i
        return None


def test_batched_decisions_build_the_same_trees_as_layer_by_layer(family):
    """One MLP evaluation per run of skipped layers makes exactly the decisions, trees and
    output of one evaluation per layer, with fewer evaluations."""
    prompt = suite_prompts(1)[0]["prompt"]
    runs = {}
    for mode in ("batched", "one-by-one"):
        # Calls where the frontier is deeper than 1.5 on average: skips and calls mix.
        learned = LearnedSchedule(threshold_mlp("frontier_mean_depth", 1.5), 25.0, 5.0, 5)
        evaluations = []
        value = learned.mlp.value
        learned.mlp.value = lambda x: (evaluations.append(1), value(x))[1]
        schedule = learned if mode == "batched" else OneByOne(learned)
        # A fixed budget: per-step sizing learns from drafting times, which differ here.
        fixed = dataclasses.replace(family.tree, adaptive=False)
        dec = Decoder(Session(family, fixed), parse_strategy("treegraft"), SamplerSettings(),
                      np.random.default_rng(0), schedule)
        steps = dec.steps(family.tokenizer.encode(prompt))
        blocks = [next(steps) for _ in range(24)]
        runs[mode] = (blocks, [s.layers for s in dec.stats], [s.nodes_built for s in dec.stats],
                      len(evaluations))
    assert runs["batched"][:3] == runs["one-by-one"][:3]
    layers = [name for step in runs["batched"][1] for name in step]
    assert "ngram" in layers and any(n != "ngram" for n in layers)   # both choices occur
    assert runs["batched"][3] < runs["one-by-one"][3]


@pytest.mark.parametrize("temp", [0.0, 1.0])
def test_adaptive_steps_mix_pipelined_ar_trees_and_carried_drafts(family, monkeypatch, temp):
    """Plans that alternate between the root alone and whole trees exercise every path of the
    adaptive loop: AR steps with the next forward already queued, a tree worth verifying while
    the root's forward is in flight (its confirmed child's subtree is carried to the next
    step), and plain tree steps. Greedy output equals `ar`; sampled output is reproducible."""
    from treegraft_mlx.pricing import Sizer
    from treegraft_mlx.tree import Plan

    calls = []

    def scripted(self, tree, context):
        calls.append(len(tree))
        whole = len(calls) % 3 != 1             # root alone on every third step
        keep = np.arange(min(len(tree), 6)) if whole else np.arange(1)
        return Plan(keep, 1.0, 10.0)

    monkeypatch.setattr(Sizer, "plan", scripted)
    prompt = suite_prompts(1)[1]["prompt"]
    for seed in range(3, 9):            # sampled: whether a draft is confirmed is chance
        calls.clear()
        kw = dict(max_tokens=80, temp=temp, seed=seed)
        out = generate(family, prompt, "ngram", **kw)
        carried = [s for s in out.step_stats if not s.layers and s.rows > 1]
        if carried:
            break
    rows = [s.rows for s in out.step_stats]
    assert 1 in rows and max(rows) > 1
    assert carried, "no subtree was carried over from an in-flight root forward"
    if temp == 0:
        assert out.token_ids == generate(family, prompt, "ar", max_tokens=80).token_ids
    else:
        calls.clear()                           # the same plans again: the script counts steps
        assert out.token_ids == generate(family, prompt, "ngram", **kw).token_ids


@pytest.mark.parametrize("temp", [0.0, 1.0])
def test_plain_stretches_decode_as_ar_and_defer_the_rows_drafters_read(family, monkeypatch,
                                                                        temp):
    """A fallback that finds AR faster decodes stretches exactly as `ar` does, between tree
    steps: greedy output equals `ar`'s, a seeded sampled run repeats, and every committed
    position still reads the target's score of a plain forward (deferred rows, one
    per stretch step, at the right positions)."""
    from treegraft_mlx.pricing import Fallback

    fallback = Fallback(ar_ms=1e-6)             # AR looks free: stretches after every probe
    monkeypatch.setitem(family.learned.fallbacks, (temp > 0, family.tree, "ngram"), fallback)
    session = Session(family, family.tree)
    prompt = suite_prompts(1)[1]["prompt"]
    kw = dict(max_tokens=72, temp=temp, seed=5)
    out = generate(family, prompt, "ngram", session=session, **kw)
    assert fallback.ar_stretches >= 2 and fallback.tree_steps >= 2 * Fallback.PROBE
    if temp == 0:
        assert out.token_ids == generate(family, prompt, "ar", max_tokens=72).token_ids
    history = session.history
    n = history.committed
    want = reference_scores(family.target, history.tokens, n)
    assert np.abs(history.scores(n) - want).max() < 1e-3
    if temp > 0:
        again = Fallback(ar_ms=1e-6)
        monkeypatch.setitem(family.learned.fallbacks, (True, family.tree, "ngram"), again)
        assert generate(family, prompt, "ngram", **kw).token_ids == out.token_ids


def test_a_stretch_s_first_step_is_not_measured(family, monkeypatch):
    """The first AR step of a stretch starts the pipeline and catches up with the tree
    steps' queued work: the fallback's AR rate learns from the other steps only (the tokens
    it is told of are each stretch's AR steps less one)."""
    from treegraft_mlx.pricing import Fallback

    fallback = Fallback(ar_ms=1e-6)             # AR looks free: stretches after every probe
    monkeypatch.setitem(family.learned.fallbacks, (False, family.tree, "ngram"), fallback)
    told, observe = [], fallback.observe_ar
    monkeypatch.setattr(fallback, "observe_ar",
                        lambda tokens, ms: (told.append(tokens), observe(tokens, ms)))
    out = generate(family, suite_prompts(1)[1]["prompt"], "ngram", max_tokens=72)
    runs, run = [], 0
    for stats in out.step_stats + [None]:       # stretch steps: AR_STEP, in runs
        if stats is not None and stats.t_verify == 0 and stats.nodes_built == 1:
            run += 1
        elif run:
            runs.append(run)
            run = 0
    assert told and sum(told) == sum(r - 1 for r in runs if r > 1)


def test_fallback_stretches_while_ar_is_faster_and_probes_the_tree_between():
    from treegraft_mlx.pricing import Fallback

    fallback = Fallback(ar_ms=20.0)
    taken = []
    for _ in range(3 * Fallback.PROBE):                  # tree steps at 0.8 tokens per AR step
        taken.append(fallback.next_stretch())
        if not taken[-1]:
            fallback.observe_tree(1, 25.0)
    assert taken[:Fallback.PROBE] == [0] * Fallback.PROBE
    stretches = [n for n in taken if n]
    assert stretches == [Fallback.FIRST_STRETCH, 2 * Fallback.FIRST_STRETCH]   # doubling
    fallback.observe_ar(16, 16 * 30.0)                   # measured: AR slower than thought
    for _ in range(Fallback.PROBE):
        fallback.observe_tree(1, 25.0)
    assert fallback.next_stretch() == 0 and fallback.stretch == Fallback.FIRST_STRETCH


def test_shadow_rule_skips_probes_only_where_the_guesses_say_ar_wins():
    """With the shadow rule (n-gram drafts only), a stretch that ran to its end with guesses
    too rarely right is followed by the next stretch at once; guesses right often enough, a
    stretch cut short, or a fallback without the rule, probe the tree first; a new
    generation starts with a stretch once tree steps measured slower."""
    from treegraft_mlx.pricing import Fallback

    def after_stretch(depth: int, hits: int, ran: int = 16) -> int:
        fallback = Fallback(ar_ms=20.0, depth=depth)
        for _ in range(Fallback.PROBE):              # tree steps: 1 token in 30 ms
            assert fallback.next_stretch() == 0
            fallback.observe_tree(1, 30.0)
        assert fallback.next_stretch() == Fallback.FIRST_STRETCH
        for i in range(ran):
            fallback.observe_shadow(i < hits)
        fallback.observe_ar(ran, ran * 20.0)
        return fallback.next_stretch()

    # 1 hit in 16: h = 2/18, about 1.12 tokens a step: 22.5 ms of AR against 30 of tree
    assert after_stretch(depth=5, hits=1) == 2 * Fallback.FIRST_STRETCH
    # 6 hits in 16: h = 7/18, about 1.6 tokens a step: 32 ms of AR, the tree may win
    assert after_stretch(depth=5, hits=6) == 0
    assert after_stretch(depth=5, hits=0, ran=9) == 0      # ended early: the text loops
    assert after_stretch(depth=0, hits=0) == 0             # no shadow rule: probe as before
    fallback = Fallback(ar_ms=20.0, depth=5)
    fallback.new_text()
    assert fallback.next_stretch() == 0                   # nothing measured yet: probe
    for _ in range(Fallback.PROBE):
        fallback.observe_tree(1, 30.0)
    fallback.new_text()
    assert fallback.next_stretch() == Fallback.FIRST_STRETCH


def _policy_steps(policy, bucket, steps, matched, ngram=0):
    """Run `policy` for `steps` steps of `bucket` against a drafter whose chain matches
    exactly `matched` tokens, beside n-gram drafts reaching `ngram`; a step of chain length
    k costs 10 + 5k ms (12 without a call). Returns the lengths chosen."""
    from treegraft_mlx.tree import Reach

    ran = []
    for _ in range(steps):
        k = policy.choose(bucket)
        ran.append(k)
        tokens = 1 + max(ngram, min(k, matched))
        policy.observe(bucket, k, tokens, 10.0 + 5 * k if k else 12.0,
                       Reach(ngram, min(k, matched), k) if k else None)
    return ran


def test_call_policy_climbs_to_the_fastest_length_its_model_prices_and_explores_around_it():
    """From START, the best priced length and its neighbours are timed first; every chain
    step, whatever its length, teaches the one model of the chain's matches, so each length
    is priced on the same steps; the climb ends at the fastest length and explores a
    neighbour in runs of RUN steps, each wait twice the last while the best stays put; a
    change of the text moves the climb."""
    from treegraft_mlx.pricing import CallPolicy

    policy = CallPolicy()
    poor, rich = policy.bucket(1.0), policy.bucket(3.0)
    assert poor == 0 and rich == len(CallPolicy.EDGES)
    ran = _policy_steps(policy, poor, 1000, matched=2)   # 1 + min(k, 2) tokens in 10 + 5k ms
    assert ran[0] == CallPolicy.START and policy.best(poor) == 2
    assert policy.expected(poor)[1:4] == pytest.approx([2, 3, 3], abs=0.05)   # depth 3 misses
    assert policy.rate(poor)[2] == pytest.approx(3 / 20)
    settled = ran[100:]
    assert set(settled) == {1, 2, 3}                                      # neighbours only
    runs = [(k, len(list(g))) for k, g in groupby(settled)]
    assert {n for k, n in runs[1:-1] if k != 2} == {CallPolicy.RUN}
    waits = [n for k, n in runs[1:-1] if k == 2]
    assert waits == sorted(waits) and waits[-1] >= CallPolicy.EXPLORE_MAX - CallPolicy.RUN
    assert policy.peek(rich) == CallPolicy.START                          # its own evidence
    _policy_steps(policy, poor, 400, matched=0)          # the text changes: S never matches
    assert policy.best(poor) == 0


def test_call_policy_prices_the_deeper_of_chain_and_ngram_drafts_and_times_only_steady_steps():
    """Where the n-gram drafts beside the chain reach deeper than it, the chain adds nothing
    priced; a step whose length differs from the last one's, or one not `timed`, teaches
    the model but is not timed."""
    from treegraft_mlx.pricing import CallPolicy
    from treegraft_mlx.tree import Reach

    policy = CallPolicy()
    rich = policy.bucket(3.0)
    _policy_steps(policy, rich, 300, matched=1, ngram=2)
    assert policy.expected(rich)[1:4] == pytest.approx([3, 3, 3], abs=0.05)
    assert policy.best(rich) == 0
    before = policy.tries[rich].sum()
    policy.observe(rich, 3, 2, 1000.0, Reach(0, 1, 3))                    # after a 0: a change
    policy.observe(rich, 3, 2, 1000.0, Reach(0, 1, 3), timed=False)
    assert policy.tries[rich].sum() == before and policy.ms[rich, 3] < 1000


def test_call_policy_recovers_from_a_bad_stretch_without_calls():
    """While no chain runs, the match rates drift back to their long-run values, and the
    steps that run without asking (their forward queued ahead) count towards the next
    exploration: a bad stretch of text does not stop the calls for good."""
    from treegraft_mlx.pricing import CallPolicy

    policy = CallPolicy()
    _policy_steps(policy, 0, 600, matched=3)
    usual = policy.expected(0)[2]
    policy.EMA = 0.5                                     # a short, bad stretch weighs in fast
    _policy_steps(policy, 0, 12, matched=0)
    assert policy.best(0) == 0
    for _ in range(policy.EXPLORE_MAX + 1):                # all queued ahead: no asking
        policy.pass_by(0)
        policy.observe(0, 0, 1, 12.0)
    assert policy.expected(0)[2] == pytest.approx(usual, rel=0.05)
    assert policy.peek(0) > 0


def test_an_exploration_of_no_call_ends_though_its_steps_are_all_queued_ahead():
    """The decoder queues a step's forward ahead whenever the policy's next answer is 0, and
    the step after it runs without asking (pass_by): an exploration of 0, the best being a
    call, must end after its RUN steps all the same, and the calls resume (before the fix
    it never ended: sampled `draft` stopped calling for good)."""
    from treegraft_mlx.pricing import CallPolicy

    policy = CallPolicy()
    _policy_steps(policy, 0, 300, matched=1)          # a chain of 1 is the best
    assert policy.best(0) == 1
    while policy.peek(0) != 0:                        # up to the exploration of 0
        _policy_steps(policy, 0, 1, matched=1)
    for steps in range(1, CallPolicy.RUN + 2):         # the decoder's loop: queued ahead
        assert steps <= CallPolicy.RUN, "the exploration of no call never ended"
        policy.pass_by(0)
        policy.observe(0, 0, 1, 12.0)
        if policy.peek(0) != 0:
            break
    assert policy.peek(0) == 1


def test_a_priced_step_verifies_the_chain_length_the_policy_picks(family):
    """`draft` queues a chain of exactly the length the call policy answers, verified with
    the tree in one forward (rows: the root and the chain); output stays ar's."""
    from treegraft_mlx.pricing import CallPolicy

    prompt = suite_prompts(1)[0]["prompt"]
    ref = generate(family, prompt, "ar", max_tokens=24).token_ids
    for length in (1, 4):
        policy = CallPolicy()
        policy.peek = lambda bucket: length
        key = (False, family.tree, False, "draft")
        family.learned.call_policies[key] = policy
        try:
            res = generate(family, prompt, "draft", max_tokens=24)
        finally:
            del family.learned.call_policies[key]
        called = [s for s in res.step_stats if s.chain]
        assert res.token_ids == ref and called
        assert {s.chain for s in called} == {length}
        assert all(s.nodes_verified == 1 + length for s in called)


def test_a_call_that_syncs_a_long_lag_is_not_measured(family, monkeypatch):
    """The first call after the prompt (as after a plain stretch) syncs many committed tokens
    into S's cache: that step prices the sync, not its chain length, so the call policy does
    not learn from it; the calls after it it does, from the first steady one (the step
    before it ran the same length)."""
    from treegraft_mlx.pricing import CallPolicy

    policy = CallPolicy()
    monkeypatch.setattr(policy, "choose", lambda bucket: 1)
    monkeypatch.setitem(family.learned.call_policies, (False, family.tree, False, "draft"),
                        policy)
    ids = family.tokenizer.encode(suite_prompts(1)[0]["prompt"])
    assert len(ids) > CallPolicy.STEADY_LAG
    dec = make_decoder(Session(family), parse_strategy("draft"), SamplerSettings(),
                       np.random.default_rng(0))
    steps = dec.steps(ids)
    for _ in range(6):
        next(steps)
    called = [s for s in dec.stats if s.chain]
    assert len(called) >= 3 and policy.tries[0, 1] == len(called) - 2


def test_drafting_stops_when_it_does_not_pay_and_still_explores():
    from treegraft_mlx.acceptance import AcceptanceModel
    from treegraft_mlx.pricing import DRAFT_EXPLORE_EVERY, Sizer
    from treegraft_mlx.family import TreeConfig
    from treegraft_mlx.timing import StepCosts
    from treegraft_mlx.tree import Plan

    costs = StepCosts((1, 2), (20.0, 22.0), ar_ms=20.0, overhead_ms=1.0, draft_ms=1.0)
    sizer = Sizer(AcceptanceModel.default(), costs, TreeConfig(), sampled=True)
    root_only = Plan(np.zeros(1, dtype=np.int64), 1.0, 20.0)
    assert sizer.worth_drafting()                          # nothing known yet
    for _ in range(50):                                    # drafts that never beat an AR step
        sizer.settle(root_only, draft_ms=1.0)
    decisions = [sizer.worth_drafting() for _ in range(4 * DRAFT_EXPLORE_EVERY)]
    assert sum(decisions) == 4                             # one step in DRAFT_EXPLORE_EVERY
    for _ in range(50):                                    # drafts worth 1.5 tokens a step
        sizer.settle(Plan(np.arange(2), 2.5, 23.0), draft_ms=1.0)
    assert all(sizer.worth_drafting() for _ in range(10))


def test_probe_plan_scales_to_the_model():
    from treegraft_mlx.probe import PROBE_SECONDS, plan_probe

    quick = plan_probe(20.0, 32)  # tg-tiny here: one row ~20 ms, the full probe
    assert quick.sizes[:12] == tuple(range(1, 13)) and quick.sizes[-1] == 32
    assert quick.forwards() * 20.0 <= 1000 * PROBE_SECONDS
    slow = plan_probe(200.0, 32)  # a 7B-class model on a slow device: a thinner probe
    assert slow.forwards() < quick.forwards() and slow.sizes[-1] == 32 and 8 in slow.sizes
    assert slow.forwards() * 200.0 <= 1000 * PROBE_SECONDS


def test_call_policy_shared_prices_a_chain_against_the_batch_it_delays():
    """Requests sharing a forward: a length is chosen for the batch's rate, (company's tokens
    + the request's) over (the batch's step + the time the length adds). With no company it
    is the request's own best length, on random tables; a company big enough prices a chain
    that pays alone out; nothing timed yet, no call."""
    from treegraft_mlx.pricing import CallPolicy, Company

    policy = CallPolicy()
    assert policy.shared(0, Company(3.0, 40.0)) == 0               # nothing measured
    _policy_steps(policy, 0, 1000, matched=2)      # 1 + min(k, 2) tokens in 10 + 5k ms
    assert policy.best(0) == 2 and policy.tries[0, 0] == 0        # no call was never timed
    # A chain wins 1 token per 5 ms: worth it while the batch commits fewer tokens per ms.
    assert policy.shared(0, Company(0.0, 10.0)) == 2
    assert policy.shared(0, Company(1.0, 15.0)) == 2
    assert policy.shared(0, Company(9.0, 40.0)) == 0
    rng = np.random.default_rng(0)
    policy.plain[0] = 1.0                  # what steps without a call committed
    for _ in range(200):
        policy.ms[0] = rng.uniform(5, 30, policy.LONGEST + 1)
        policy.tries[0] = rng.integers(0, 6, policy.LONGEST + 1)
        policy.tries[0, 0] = policy.TRIES
        assert policy.shared(0, Company(0.0, policy.ms[0, 0])) == policy.best(0)
