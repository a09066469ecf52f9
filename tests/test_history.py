"""History scores: the target's log-prob of the token that followed, top-10 rule included, on
the host and the device path alike."""

import mlx.core as mx
import numpy as np
import pytest

from treegraft_mlx import history as history_module
from treegraft_mlx.history import History, followed_logprobs
from treegraft_mlx.readback import read_back


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
    """Deferred rows are scored with the tokens known by then, when asked for (`scores`);
    unscored positions read 0.0, never computed on a read."""
    rng = np.random.default_rng(1)
    tokens = rng.integers(0, 64, 40).tolist()
    rows = rng.normal(0, 2, (39, 64)).astype(np.float32)
    h = History(tokens[:30], capacity=64)
    h.defer(0, mx.array(rows[:29]), history_module.as_logits)
    h.extend(tokens[30:])
    want = [reference(rows[p], tokens[p + 1]) for p in range(29)]
    assert h.logprob(3) == 0.0
    assert np.allclose(h.scores(29), want, atol=1e-4)
    assert h.logprob(3) == pytest.approx(want[3], abs=1e-4)
    assert h.logprob(35) == 0.0


def deferred_logits(seed: int, length: int, capacity: int) -> tuple[History, list[float]]:
    """A history of `length` random tokens whose rows are random logits, all deferred, and
    the reference score of every position but the last."""
    rng = np.random.default_rng(seed)
    tokens = rng.integers(0, 64, length).tolist()
    rows = rng.normal(0, 2, (length - 1, 64)).astype(np.float32)
    h = History(tokens, capacity=capacity)
    h.defer(0, mx.array(rows), history_module.as_logits)
    return h, [reference(rows[p], tokens[p + 1]) for p in range(length - 1)]


def test_deferred_rows_past_the_capacity_grow_the_scores():
    """AR steps defer rows past the history's first capacity (a long generation)."""
    h, want = deferred_logits(seed=2, length=24, capacity=4)
    assert np.allclose(h.scores(23), want, atol=1e-4)


def test_prefetch_queues_only_the_rows_asked_for_in_one_evaluation():
    """A drafter's scattered reads are queued in one head evaluation of just those rows (not
    their 16-row blocks) and read back with the step's readback (`pending`, `collect`), equal
    to the block path; until then, and for the rest of a block, positions read unscored."""
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
    h.prefetch([3, 45])                           # queued already: not again
    assert evaluated == [4] and len(h.pending()) == 1
    assert h.logprob(3) == 0.0                    # not read back yet
    h.collect(read_back(*h.pending()))
    assert h.pending() == []
    assert all(h.logprob(p) == pytest.approx(want[p], abs=1e-4) for p in (3, 17, 45, 58))
    assert h.logprob(4) == 0.0 and evaluated == [4]
    assert np.allclose(h.scores(59), want, atol=1e-4)


def test_scores_on_the_device_follow_the_reference():
    """What a step queues with its verdict (history.scores_of): every rank as the reference."""
    from treegraft_mlx.history import scores_of

    rng = np.random.default_rng(4)
    rows = rng.normal(0, 3, (5, 512)).astype(np.float32)
    following = np.array([int(np.argsort(-r)[k]) for r, k in zip(rows, [0, 5, 9, 10, 300])])
    x = mx.array(rows)
    got = np.array(scores_of(x, mx.array(following), mx.logsumexp(x, axis=-1)))
    assert np.allclose(got, [reference(r, t) for r, t in zip(rows, following)], atol=1e-4)


def test_a_queued_prefetch_reads_the_mean_of_the_prompt_rows_read_back():
    """Until its readback, a queued position reads as the mean score of the prompt rows
    already read back (0.0, a certain token, would make first reads look sure); a position
    never queued still reads 0.0."""
    h, want = deferred_logits(seed=5, length=40, capacity=64)
    h.prefetch([1, 2])
    h.collect(read_back(*h.pending()))
    h.prefetch([7])
    assert h.logprob(7) == pytest.approx((want[1] + want[2]) / 2, abs=1e-4)
    assert h.logprob(9) == 0.0
    h.collect(read_back(*h.pending()))
    assert h.logprob(7) == pytest.approx(want[7], abs=1e-4)
