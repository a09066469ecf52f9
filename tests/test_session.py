"""Sessions: a second turn reuses the cached prefix and still gives exactly the fresh output,
and leaves every drafter in the state a fresh session would have."""

import mlx.core as mx
import numpy as np
import pytest

from scores import reference_scores
from treegraft_mlx import generate, load
from treegraft_mlx.readback import read_back
from treegraft_mlx.sampling import SamplerSettings
from treegraft_mlx.session import Session, common_prefix

FIRST = "def add(a, b):\n    return a + b\n"
TOKENS = 12


@pytest.fixture(scope="module")
def family(checkpoints):
    return load(checkpoints["llama"], drafters=[checkpoints["qwen3"]])


def first_turn(family, strategy: str, **kw) -> tuple[Session, list[int], list[int]]:
    """A session after one turn on FIRST: (session, prompt ids, generated ids)."""
    session = Session(family)
    first = family.tokenizer.encode(FIRST)
    out = generate(family, first, strategy, max_tokens=TOKENS, session=session, **kw)
    return session, first, out.token_ids


def assert_turn_matches_fresh(family, session: Session, prompt: list[int], strategy: str,
                              **kw) -> None:
    """A turn run on `session` gives exactly the tokens of a fresh generation."""
    again = generate(family, prompt, strategy, max_tokens=TOKENS, session=session, **kw)
    assert again.token_ids == generate(family, prompt, strategy, max_tokens=TOKENS, **kw).token_ids


def second_prompt(family, kind: str, first: list[int], out: list[int]) -> list[int]:
    """A follow-up that continues the conversation, or one that diverges after 3 tokens."""
    tok = family.tokenizer
    if kind == "continued":
        return first + out + tok.encode("\nclass Foo:\n")
    return first[:3] + tok.encode("import os\n")


def test_common_prefix():
    assert common_prefix([1, 2, 3], [1, 2, 4, 5]) == 2
    assert common_prefix([1, 2], [1, 2, 3]) == 2
    assert common_prefix([], [1]) == 0


@pytest.mark.parametrize("strategy", ["ar", "ngram", "treegraft", "chain"])
def test_second_turn_reuses_cache_and_matches_fresh(family, strategy):
    session, first, out1 = first_turn(family, strategy)
    assert out1 == generate(family, first, strategy, max_tokens=TOKENS).token_ids
    second = second_prompt(family, "continued", first, out1)
    assert session.reusable(second) >= len(first) + len(out1) - 1
    assert_turn_matches_fresh(family, session, second, strategy)
    # a diverging prompt rewinds the caches instead of reusing stale rows
    third = second_prompt(family, "diverged", first, out1)
    assert session.reusable(third) <= 3
    assert_turn_matches_fresh(family, session, third, strategy)


@pytest.mark.parametrize("kind", ["same prompt", "whole history", "prefix"])
@pytest.mark.parametrize("strategy", ["ngram", "chain"])
def test_prompt_equal_to_or_inside_the_history(family, strategy, kind):
    """A retried prompt, the whole conversation so far, or a prefix of it: everything but the
    prompt's last token is reused (that one must run again for its logits), and the output is
    the fresh one."""
    session, first, out1 = first_turn(family, strategy)
    prompt = {"same prompt": first, "whole history": first + out1, "prefix": first[:5]}[kind]
    assert session.reusable(prompt) == len(prompt) - 1
    assert_turn_matches_fresh(family, session, prompt, strategy)


@pytest.mark.parametrize("strategy", ["ar", "ngram", "chain"])
def test_sampled_second_turn_matches_fresh(family, strategy):
    """Seeded sampling over two turns draws what fresh sessions draw: the reused target rows
    and log-probs (which shape the sampled drafts) must be those of a full prefill."""
    kw = dict(temp=0.8, seed=5)
    session, first, out1 = first_turn(family, strategy, **kw)
    assert out1 == generate(family, first, strategy, max_tokens=TOKENS, **kw).token_ids
    assert out1 != generate(family, first, strategy, max_tokens=TOKENS).token_ids  # sampled
    assert_turn_matches_fresh(family, session, second_prompt(family, "continued", first, out1),
                              strategy, **kw)


def strong_cache_error(session: Session) -> float:
    """Max |logit difference| between the strong drafter's model continuing from its cache
    and a fresh forward of the tokens that cache should hold."""
    strong = session.strong
    n = strong.cache.offset
    tokens = session.history.tokens[:n + 1]
    fresh = strong.model(mx.array([tokens]))[0, -1]
    cached = strong.model(mx.array([tokens[-1:]]), cache=strong.cache)[0, -1]
    strong.cache.reset(n)
    return float(mx.abs(fresh - cached).max())


@pytest.mark.parametrize("kind", ["continued", "diverged"])
def test_drafters_after_a_second_turn_match_a_fresh_session(family, kind):
    """After a reused turn the strong drafter's cache holds exactly the history's rows (a wrong
    `strong.rewind(keep)` leaves the first turn's rows under the new prompt: drafts get worse
    but the output stays exact, so only this shows it) and the n-gram index is the fresh one."""
    session, first, out1 = first_turn(family, "chain")
    second = second_prompt(family, kind, first, out1)
    generate(family, second, "chain", max_tokens=TOKENS, session=session)
    fresh = Session(family)
    generate(family, second, "chain", max_tokens=TOKENS, session=fresh)
    assert session.history.tokens == fresh.history.tokens
    assert session.strong.cache.offset == fresh.strong.cache.offset > len(second)
    assert strong_cache_error(session) < 1e-4
    assert dict(session.ngram.index.ends) == dict(fresh.ngram.index.ends)


def test_prompt_rows_are_computed_only_where_read(family):
    """Prefill defers the prompt's scores; a prefetch of one position queues that row alone,
    read back with the next readback, with the values a plain forward gives; a reused prefix
    carries deferred rows, and the last reused position is scored against the token that
    follows it in the new prompt."""
    from treegraft_mlx.history import LAZY_BLOCK

    ids = family.tokenizer.encode("def add(a, b):\n    return a + b\n" * 12)
    assert len(ids) > 2 * LAZY_BLOCK
    session = Session(family)
    session.prefill(ids, SamplerSettings(), np.random.default_rng(0))
    history = session.history
    assert np.isnan(history.lp[:len(ids)]).all()            # nothing computed up front
    want = reference_scores(family.target, history.tokens, len(ids))
    p = LAZY_BLOCK + 3
    history.prefetch([p])
    assert history.logprob(p) == 0.0                        # queued, not read back yet
    history.collect(read_back(*history.pending()))
    assert history.logprob(p) == pytest.approx(want[p], abs=1e-4)
    computed = np.flatnonzero(~np.isnan(history.lp[:len(ids)]))
    assert computed.tolist() == [p]
    history.scores(len(ids))                                 # everything scored now
    root = history.root
    for follow in (root, (root + 1) % 200):  # the old following token kept, and a new one
        again = ids + [follow, 8]
        session.prefill(again, SamplerSettings(), np.random.default_rng(0))
        n = len(again) - 1
        assert np.allclose(session.history.scores(n),
                           reference_scores(family.target, session.history.tokens, n),
                           atol=1e-4)
        session.prefill(ids, SamplerSettings(), np.random.default_rng(0))
        session.history.scores(len(ids))
