"""History scores: the target's log-prob of the token that followed, top-10 rule included, on
the host and the device path alike."""

import mlx.core as mx
import numpy as np
import pytest

from treegraft_mlx import history as history_module
from treegraft_mlx.history import History, followed_logprobs


def reference(row: np.ndarray, token: int) -> float:
    lp = row.astype(np.float64) - np.log(np.exp(row.astype(np.float64)).sum())
    order = np.argsort(-lp, kind="stable")
    rank = int(np.flatnonzero(order == token)[0])
    return lp[token] if rank < 10 else lp[order[9]] - 5.0


@pytest.mark.parametrize("device", [False, True])
def test_followed_logprobs_score_every_rank_as_the_reference(monkeypatch, device):
    """Tokens of rank 0, 5, 9 (inside the top-10), 10 and 300 (outside: the 10th minus 5)."""
    monkeypatch.setattr(history_module, "on_gpu", lambda: device)
    rng = np.random.default_rng(0)
    rows = rng.normal(0, 3, (5, 512)).astype(np.float32)
    ranks = [0, 5, 9, 10, 300]
    following = np.array([int(np.argsort(-r)[k]) for r, k in zip(rows, ranks)])
    got = followed_logprobs(mx.array(rows), following)
    want = [reference(r, t) for r, t in zip(rows, following)]
    assert np.allclose(got, want, atol=1e-4)


def test_deferred_rows_are_scored_against_the_tokens_that_followed():
    """A deferred block is scored when read, with the tokens known by then; unscored positions
    read 0.0."""
    rng = np.random.default_rng(1)
    tokens = rng.integers(0, 64, 40).tolist()
    rows = rng.normal(0, 2, (39, 64)).astype(np.float32)
    h = History(tokens[:30], capacity=64)
    h.defer(0, mx.array(rows[:29]), history_module.as_logits)
    h.extend(tokens[30:])
    want = [reference(rows[p], tokens[p + 1]) for p in range(29)]
    assert h.logprob(3) == pytest.approx(want[3], abs=1e-4)
    assert np.allclose(h.scores(29), want, atol=1e-4)
    assert h.logprob(35) == 0.0


def test_deferred_rows_past_the_capacity_grow_the_scores():
    """AR steps defer rows past the history's first capacity (a long generation)."""
    rng = np.random.default_rng(2)
    tokens = rng.integers(0, 64, 24).tolist()
    rows = rng.normal(0, 2, (23, 64)).astype(np.float32)
    h = History(tokens, capacity=4)
    h.defer(0, mx.array(rows), history_module.as_logits)
    want = [reference(rows[p], tokens[p + 1]) for p in range(23)]
    assert np.allclose(h.scores(23), want, atol=1e-4)


def test_prefetch_scores_only_the_rows_asked_for_in_one_evaluation():
    """A drafter's scattered reads are scored in one head evaluation of just those rows (not
    their 16-row blocks), equal to the block path; the rest of a block is scored when read."""
    rng = np.random.default_rng(3)
    tokens = rng.integers(0, 64, 60).tolist()
    rows = rng.normal(0, 2, (59, 64)).astype(np.float32)
    evaluated = []

    def head(h):
        evaluated.append(h.shape[0])
        return h

    h = History(tokens, capacity=64)
    h.defer(0, mx.array(rows[:40]), head)
    h.defer(40, mx.array(rows[40:]), head)
    want = [reference(rows[p], tokens[p + 1]) for p in range(59)]
    h.prefetch([3, 17, 17, 45, 58, 59, 200])      # repeats and positions past the end ignored
    assert evaluated == [4]
    assert all(h.logprob(p) == pytest.approx(want[p], abs=1e-4) for p in (3, 17, 45, 58))
    assert evaluated == [4]                         # read back without evaluating again
    assert h.logprob(4) == pytest.approx(want[4], abs=1e-4) and evaluated[1:] == [16]
    assert np.allclose(h.scores(59), want, atol=1e-4)
