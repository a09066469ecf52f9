"""The processed target distribution (temperature, top-k, top-p, min-p) and draws from it.

Every strategy samples from exactly this distribution, so speculative sampling can be checked
against plain autoregressive sampling. Order: logits / temperature -> log-softmax -> top-k ->
top-p -> min-p -> renormalise. Temperature 0 means greedy (argmax).
"""

from __future__ import annotations

from dataclasses import dataclass

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


def target_probs(logits: np.ndarray, s: SamplerSettings) -> np.ndarray:
    """Probabilities (float64, rows sum to 1) of the processed distribution, per row of logits."""
    x = np.asarray(logits, dtype=np.float64)
    if s.greedy:
        p = np.zeros_like(x)
        np.put_along_axis(p, x.argmax(-1)[..., None], 1.0, axis=-1)
        return p
    x = x / s.temp
    p = np.exp(x - x.max(-1, keepdims=True))
    p /= p.sum(-1, keepdims=True)
    if s.top_k and s.top_k < p.shape[-1]:
        kth = -np.partition(-p, s.top_k - 1, axis=-1)[..., s.top_k - 1: s.top_k]
        p = np.where(p >= kth, p, 0.0)
    if s.top_p < 1.0:
        order = np.argsort(-p, axis=-1, kind="stable")
        sorted_p = np.take_along_axis(p, order, -1)
        before = np.cumsum(sorted_p, -1) - sorted_p  # mass strictly above each token
        keep_sorted = before < s.top_p * sorted_p.sum(-1, keepdims=True)
        keep = np.zeros_like(keep_sorted)
        np.put_along_axis(keep, order, keep_sorted, -1)
        p = np.where(keep, p, 0.0)
    if s.min_p > 0:
        p = np.where(p >= s.min_p * p.max(-1, keepdims=True), p, 0.0)
    return p / p.sum(-1, keepdims=True)


def draw(p: np.ndarray, rng: np.random.Generator) -> int:
    """One token from a probability vector (inverse CDF on a single uniform)."""
    c = np.cumsum(p)
    return int(min(np.searchsorted(c, rng.random() * c[-1], side="right"), len(p) - 1))
