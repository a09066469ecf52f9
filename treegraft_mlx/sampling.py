"""The processed target distribution (temperature, top-k, top-p, min-p) and draws from it.

Every strategy samples from exactly this distribution, so speculative sampling can be checked
against plain autoregressive sampling. Order: logits / temperature -> log-softmax -> top-k ->
top-p -> min-p -> renormalise. Temperature 0 means greedy (argmax).
"""

from __future__ import annotations

from dataclasses import dataclass
from functools import lru_cache
from typing import Optional

import mlx.core as mx
import numpy as np


@dataclass(frozen=True)
class SamplerSettings:
    temp: float = 0.0
    top_p: float = 1.0
    top_k: int = 0
    min_p: float = 0.0

    def __post_init__(self):
        if self.temp < 0:
            raise ValueError(f"temperature must be >= 0, got {self.temp}")
        if not 0 < self.top_p <= 1:
            raise ValueError(f"top_p must be in (0, 1], got {self.top_p}")
        if self.top_k < 0:
            raise ValueError(f"top_k must be >= 0, got {self.top_k}")
        if not 0 <= self.min_p < 1:
            raise ValueError(f"min_p must be in [0, 1), got {self.min_p}")

    @property
    def greedy(self) -> bool:
        return self.temp == 0


def device_key(rng: np.random.Generator) -> mx.array:
    """A device random key drawn from a generation's seeded generator."""
    return mx.random.key(int(rng.integers(2**31)))


def processed_logits(logits: mx.array, s: SamplerSettings) -> mx.array:
    """THE definition of the processed distribution, as log-weights (up to a constant; -inf
    where filtered). With q = softmax(logits / temp):
      top-k  keeps the tokens at least as likely as the k-th most likely (ties kept);
      top-p  keeps, of those, the most likely ones until the mass strictly before a token
             reaches top_p of their mass, and every token as likely as the last one kept;
      min-p  keeps, of those, the tokens with q >= min_p * max(q).
    Found on the sorted row: one sort and one exp pass, the least a top-p filter costs.
    `target_probs`, `host_probs` and every acceptance path follow this (tests check each
    against a reference written from the three lines above)."""
    x = logits.astype(mx.float32) / s.temp
    if not (s.top_k or s.top_p < 1.0 or s.min_p > 0):
        return x
    v = x.shape[-1]
    desc = mx.sort(x, axis=-1)[..., ::-1]
    p = mx.softmax(desc, axis=-1)
    keep = mx.ones(p.shape, dtype=mx.bool_)
    if s.top_k and s.top_k < v:
        keep = desc >= desc[..., s.top_k - 1:s.top_k]
        p = mx.where(keep, p, 0.0)
    if s.top_p < 1.0:
        before = mx.cumsum(p, axis=-1) - p       # mass strictly above each rank
        keep = keep & (before < s.top_p * p.sum(-1, keepdims=True))
    if s.min_p > 0:
        keep = keep & (p >= s.min_p * p[..., :1])
    # The smallest kept logit: everything at least as likely stays (ties included).
    threshold = mx.min(mx.where(keep, desc, mx.inf), axis=-1, keepdims=True)
    return mx.where(x >= threshold, x, -mx.inf)


def target_probs(logits: mx.array, s: SamplerSettings) -> mx.array:
    """Probabilities (float32, rows sum to 1) of the processed distribution, per row: one-hot
    on the argmax when greedy, else the softmax of `processed_logits`."""
    x = logits.astype(mx.float32)
    if s.greedy:
        return (mx.arange(x.shape[-1]) == mx.argmax(x, -1, keepdims=True)).astype(mx.float32)
    return mx.softmax(processed_logits(x, s), axis=-1)


@lru_cache(maxsize=16)
def _compiled_sampler(s: SamplerSettings):
    return mx.compile(lambda logits, key: mx.random.categorical(processed_logits(logits, s),
                                                                key=key))


def sample_token(logits: mx.array, s: SamplerSettings, key: Optional[mx.array]) -> mx.array:
    """A lazily evaluated draw from the processed distribution (argmax when greedy): what the
    pipelined AR step queues before the previous token is read back."""
    if s.greedy:
        return mx.argmax(logits, -1)
    return _compiled_sampler(s)(logits, key)


class DeviceDraws:
    """Tokens drawn from the processed distribution on the device, nothing read back: what a
    sampled chain queued on the device drafts with (drafters.Draw). Each draw takes the next
    key split from the one given, and also returns q, the distribution it was drawn from,
    which acceptance reads (min(1, p/q), verify.py)."""

    def __init__(self, settings: SamplerSettings, key: mx.array):
        self.settings, self.key = settings, key

    def __call__(self, logits: mx.array) -> tuple[mx.array, mx.array]:
        self.key, sub = mx.random.split(self.key)
        x = processed_logits(logits.astype(mx.float32), self.settings)
        return mx.random.categorical(x, key=sub), mx.softmax(x)


def host_probs(logits: np.ndarray, s: SamplerSettings) -> np.ndarray:
    """`target_probs` of one row in numpy (float64), for acceptance on the host: it visits one
    row per accepted node, and a row that has left the device costs a few vectorised passes
    instead of one device evaluation per node. Same rules as `processed_logits`."""
    x = np.asarray(logits, dtype=np.float64)
    if s.greedy:
        p = np.zeros_like(x)
        p[int(np.argmax(x))] = 1.0
        return p
    x = x / s.temp
    p = np.exp(x - x.max())
    p /= p.sum()
    if s.top_k and s.top_k < len(p):
        p = np.where(p >= np.partition(p, -s.top_k)[-s.top_k], p, 0.0)
    if s.top_p < 1.0:
        p = np.where(p >= top_p_threshold(p, s.top_p), p, 0.0)
    if s.min_p > 0:
        p = np.where(p >= s.min_p * p.max(), p, 0.0)
    return p / p.sum()


NUCLEUS_GUESS = 256   # top-p looks among this many of the likeliest tokens first


def top_p_threshold(p: np.ndarray, top_p: float) -> float:
    """The smallest probability top-p keeps (processed_logits' rule): found among the
    NUCLEUS_GUESS likeliest tokens, partitioned out in O(V), and by a full sort only where
    the nucleus does not end among them (a flat distribution)."""
    mass = top_p * p.sum()
    for k in (min(NUCLEUS_GUESS, len(p)), len(p)):
        desc = -np.sort(-np.partition(p, len(p) - k)[len(p) - k:])
        before = np.cumsum(desc) - desc
        kept = before < mass
        if not kept.all() or k == len(p):
            return float(desc[kept].min())
    raise AssertionError("unreachable")


def draw(p: np.ndarray, rng: np.random.Generator) -> int:
    """One token from a probability vector (inverse CDF on a single uniform)."""
    c = np.cumsum(p)
    return int(min(np.searchsorted(c, rng.random() * c[-1], side="right"), len(p) - 1))
