"""Sessions: a second turn reuses the cached prefix and still gives exactly the fresh output."""

import pytest

from treegraft_mlx import generate, load
from treegraft_mlx.session import Session, common_prefix


def test_common_prefix():
    assert common_prefix([1, 2, 3], [1, 2, 4, 5]) == 2
    assert common_prefix([1, 2], [1, 2, 3]) == 2
    assert common_prefix([], [1]) == 0


@pytest.mark.parametrize("strategy", ["ar", "ngram", "treegraft", "chain"])
def test_second_turn_reuses_cache_and_matches_fresh(checkpoints, strategy):
    family = load(checkpoints["llama"], drafters=[checkpoints["qwen3"]])
    tok = family.tokenizer
    first = tok.encode("def add(a, b):\n    return a + b\n")
    session = Session(family)
    out1 = generate(family, first, strategy, max_tokens=12, session=session)
    assert out1.token_ids == generate(family, first, strategy, max_tokens=12).token_ids
    second = first + out1.token_ids + tok.encode("\nclass Foo:\n")
    reuse = session.reusable(second)
    assert reuse >= len(first) + len(out1.token_ids) - 1
    again = generate(family, second, strategy, max_tokens=12, session=session)
    assert again.token_ids == generate(family, second, strategy, max_tokens=12).token_ids
    # a diverging prompt rewinds the caches instead of reusing stale rows
    third = first[:3] + tok.encode("import os\n")
    assert session.reusable(third) <= 3
    assert (generate(family, third, strategy, max_tokens=12, session=session).token_ids
            == generate(family, third, strategy, max_tokens=12).token_ids)
