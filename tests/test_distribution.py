"""One processed distribution: every path that samples or accepts keeps exactly the tokens the
rules allow, with the same probabilities.

The reference below is written from `processed_logits`'s docstring, token by token in plain
Python, independent of the vectorised code. Logits come from a coarse grid (multiples of 0.5),
so ties are exact in float32 and float64 alike; draws whose top-p or min-p boundary falls
within float tolerance are discarded (there the rule cannot tell float32 from float64).
"""

from __future__ import annotations

import math

import mlx.core as mx
import numpy as np
import pytest
from hypothesis import assume, given, settings as hsettings, strategies as st

from treegraft_mlx.sampling import (SamplerSettings, host_probs, processed_logits,
                                    sample_token, target_probs)

TOL = 1e-5


def reference(logits: list[float], s: SamplerSettings) -> tuple[list[float], float]:
    """(probabilities, smallest distance of any top-p / min-p decision from its boundary)."""
    q = [math.exp(x / s.temp) for x in logits]
    total = sum(q)
    q = [v / total for v in q]
    allowed = set(range(len(q)))
    margin = math.inf
    if s.top_k and s.top_k < len(q):
        kth = sorted(q, reverse=True)[s.top_k - 1]
        allowed = {i for i in allowed if q[i] >= kth}
    if s.top_p < 1.0:
        mass = sum(q[i] for i in allowed)
        kept, before = [], 0.0
        for i in sorted(allowed, key=lambda i: -q[i]):
            margin = min(margin, abs(before - s.top_p * mass))
            if before < s.top_p * mass:
                kept.append(i)
            before += q[i]
        last = min(q[i] for i in kept)
        allowed = {i for i in allowed if q[i] >= last}
    if s.min_p > 0:
        top = max(q)
        margin = min([margin] + [abs(q[i] - s.min_p * top) for i in allowed])
        allowed = {i for i in allowed if q[i] >= s.min_p * top}
    mass = sum(q[i] for i in allowed)
    return [q[i] / mass if i in allowed else 0.0 for i in range(len(q))], margin


grid_logits = st.lists(st.integers(-12, 4).map(lambda k: 0.5 * k), min_size=2, max_size=40)
sampler = st.builds(
    SamplerSettings,
    temp=st.sampled_from([0.5, 0.7, 1.0, 1.5]),
    top_p=st.one_of(st.just(1.0), st.floats(0.05, 0.999)),
    top_k=st.integers(0, 12),
    min_p=st.one_of(st.just(0.0), st.floats(0.001, 0.9)))


def every_path(logits: list[float], s: SamplerSettings) -> dict[str, np.ndarray]:
    """The distribution as each code path sees it."""
    row = mx.array(np.array(logits, dtype=np.float32))
    weights = np.array(processed_logits(row, s), dtype=np.float64)
    device_draw = np.exp(weights - weights.max())
    return {
        "target_probs": np.array(target_probs(row, s), dtype=np.float64),
        "host_probs": host_probs(np.array(logits, dtype=np.float32), s),
        "processed_logits (AR draw)": device_draw / device_draw.sum(),
    }


@hsettings(max_examples=300, deadline=None, derandomize=True)
@given(grid_logits, sampler)
def test_every_path_keeps_exactly_the_allowed_tokens(logits, s):
    want, margin = reference(logits, s)
    assume(margin > TOL)
    allowed = np.array(want) > 0
    for name, got in every_path(logits, s).items():
        assert np.array_equal(got > 0, allowed), (name, s, logits)
        assert np.allclose(got, want, atol=TOL), (name, s, logits)


HALVES = (0.5, 0.25, 0.125, 0.0625, 0.0625)


@pytest.mark.parametrize("s, kept", [
    # q = .5 .25 .125 .0625 .0625 (HALVES, temp 1)
    (SamplerSettings(temp=1.0, top_k=4), [0, 1, 2, 3, 4]),        # tie at the k-th: both kept
    (SamplerSettings(temp=1.0, top_k=3), [0, 1, 2]),
    (SamplerSettings(temp=1.0, top_p=0.7), [0, 1]),               # .5 < .7 <= .75
    (SamplerSettings(temp=1.0, top_p=0.75), [0, 1]),              # strictly before: .75 out
    (SamplerSettings(temp=1.0, top_p=0.76), [0, 1, 2]),
    (SamplerSettings(temp=1.0, top_p=0.9), [0, 1, 2, 3, 4]),      # .875 < .9: tie keeps both
    (SamplerSettings(temp=1.0, top_k=2, top_p=0.7), [0, 1]),      # .5 < .7 * .75
    (SamplerSettings(temp=1.0, top_k=2, top_p=0.6), [0]),         # top-p of the top-k's mass
    (SamplerSettings(temp=1.0, min_p=0.24), [0, 1, 2]),           # .125 >= .12
    (SamplerSettings(temp=1.0, min_p=0.26), [0, 1]),              # .125 < .13
    (SamplerSettings(temp=1.0, min_p=0.124), [0, 1, 2, 3, 4]),    # .0625 >= .062
    (SamplerSettings(temp=1.0, min_p=0.126), [0, 1, 2]),          # .0625 < .063
    (SamplerSettings(temp=2.0, min_p=0.4), [0, 1, 2]),            # temp first: .17 >= .4 * .34
])
def test_boundaries_and_ties(s, kept):
    """Hand-checked boundaries: a tie at the k-th token, top-p just below and above a
    cumulative mass, top-p measured on what top-k kept, min-p either side of its threshold."""
    check_kept(HALVES, s, kept)


def test_top_p_counts_the_mass_top_k_kept_with_its_ties():
    """q = .5 .25 .25, top-k 2 keeps all three (a tie), so top-p 0.6 compares .5 with
    0.6 of 1.0 (keep the tie pair), not of .75 (the first token alone)."""
    check_kept((0.5, 0.25, 0.25), SamplerSettings(temp=1.0, top_k=2, top_p=0.6), [0, 1, 2])


def check_kept(probs: tuple[float, ...], s: SamplerSettings, kept: list[int]) -> None:
    logits = [math.log(v) for v in probs]
    want, _ = reference(logits, s)
    assert [i for i, p in enumerate(want) if p > 0] == kept, (s, want)
    for name, got in every_path(logits, s).items():
        assert np.allclose(got, want, atol=TOL), (name, s)


def test_device_draws_follow_the_definition():
    """The AR step's device draw (`sample_token`) lands only on kept tokens, in proportion."""
    logits = [math.log(v) for v in HALVES]
    s = SamplerSettings(temp=1.0, top_k=3, top_p=0.8)
    want, _ = reference(logits, s)
    row = mx.array(np.array(logits, dtype=np.float32))
    keys = mx.random.split(mx.random.key(0), 4000)
    draws = np.array(mx.stack([sample_token(row, s, k) for k in keys]))
    counts = np.bincount(draws, minlength=5) / len(draws)
    assert counts[3] == counts[4] == 0
    assert np.allclose(counts, want, atol=0.03)
