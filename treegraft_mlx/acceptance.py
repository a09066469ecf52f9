"""Per-node acceptance estimates a(v) = P(v accepted | its parent accepted), from drafter-side
evidence only, and their calibration on logged verification outcomes.

The evidence is what the drafters already know about a node (tree.DraftTree): for an n-gram
node its match length, how many continuations voted for it and the target's recorded log-prob
of the token where the match was seen; for a node the strong drafter has scored, its log-prob
and rank there. a(v) is a logistic function of those features, one weight vector per decoding
regime (greedy, sampled): n-gram drafts are accepted far less often when sampling.

Calibration labels every verified node with its exact conditional acceptance probability, the
target's processed probability of the node's token at its parent (one-hot when greedy: a
drafted child is accepted iff the target's draw at its parent is its token), and fits the
weights by Newton's method on the log-loss. Nothing here may read the current step's target
logits at run time: the estimates must be known before verification, or sampling is no longer
lossless.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path
from typing import Optional

import numpy as np

from .tree import DraftTree

FORMAT_VERSION = 1
FEATURES = ("bias", "ngram", "ngram_match", "ngram_target_lp", "ngram_log_votes", "draft",
            "draft_p", "draft_lp", "draft_top1", "both", "depth")
LP_FLOOR = -10.0          # log-probs below this carry no more information
REGIMES = ("greedy", "sampled")
RELIABILITY_BINS = 10

# Without a calibration: the weights of the fits on the fixture family (acceptance.json of
# tg-tiny, 2026-11-30), rounded and shrunk towards no effect: long n-gram matches the target
# liked where they were seen, and the strong drafter's own probability, predict acceptance.
DEFAULT_WEIGHTS = {
    "greedy": (-1.5, 0.5, 1.5, 3.0, 0.0, -0.5, 1.5, 1.0, 1.0, 0.5, 0.0),
    "sampled": (-1.5, 0.3, 0.5, 3.0, 0.0, -0.5, 2.0, 2.0, 0.5, 0.5, 0.0),
}


def node_features(tree: DraftTree, n_max: int, depth: int) -> np.ndarray:
    """(N, len(FEATURES)) float64; row 0 (the root) is computed but never used."""
    ngram_lp = np.asarray(tree.ngram_lp, dtype=np.float64)
    draft_lp = np.asarray(tree.draft_lp, dtype=np.float64)
    ng = (~np.isnan(ngram_lp)).astype(np.float64)
    dr = (~np.isnan(draft_lp)).astype(np.float64)
    ng_lp = np.maximum(np.nan_to_num(ngram_lp, nan=0.0), LP_FLOOR) / -LP_FLOOR
    dr_lp = np.maximum(np.nan_to_num(draft_lp, nan=LP_FLOOR), LP_FLOOR)
    return np.stack([
        np.ones(len(tree)), ng, ng * np.asarray(tree.match_len) / n_max, ng * ng_lp,
        ng * np.log1p(np.asarray(tree.votes)), dr, dr * np.exp(dr_lp), dr * dr_lp / -LP_FLOOR,
        dr * (np.asarray(tree.draft_rank) == 0), ng * dr, np.asarray(tree.depth) / depth,
    ], axis=1)


def logistic(z: np.ndarray) -> np.ndarray:
    return 1.0 / (1.0 + np.exp(-np.clip(z, -30.0, 30.0)))


@dataclass(frozen=True)
class AcceptanceModel:
    """Weights per regime; `estimate` gives a(v) for every node of a tree (a(root) = 1)."""

    weights: dict[str, np.ndarray]
    calibrated: bool = False
    source: Optional[Path] = None

    @classmethod
    def default(cls) -> "AcceptanceModel":
        return cls({r: np.asarray(w, dtype=np.float64) for r, w in DEFAULT_WEIGHTS.items()})

    @classmethod
    def load(cls, path: Path) -> "AcceptanceModel":
        """From a bundle's acceptance.json; clear errors for another format."""
        meta = json.loads(Path(path).read_text())
        if meta.get("format_version") != FORMAT_VERSION:
            raise ValueError(f"{path}: format_version {meta.get('format_version')!r}, this "
                             f"runtime reads {FORMAT_VERSION}")
        if tuple(meta.get("features", ())) != FEATURES:
            raise ValueError(f"{path}: feature list differs from this runtime's")
        weights = cls.default().weights
        weights.update({r: np.asarray(meta[r]["weights"], dtype=np.float64)
                        for r in REGIMES if r in meta})
        return cls(weights, calibrated=True, source=Path(path))

    def estimate(self, tree: DraftTree, sampled: bool, n_max: int, depth: int) -> np.ndarray:
        a = logistic(node_features(tree, n_max, depth) @ self.weights[regime(sampled)])
        a[0] = 1.0
        return a


def regime(sampled: bool) -> str:
    return "sampled" if sampled else "greedy"


def fit(x: np.ndarray, y: np.ndarray, l2: float = 1e-3, iterations: int = 50) -> np.ndarray:
    """Logistic weights minimising the mean log-loss against soft labels y in [0, 1] (Newton's
    method; a small ridge keeps features that never vary at 0)."""
    w = np.zeros(x.shape[1])
    for _ in range(iterations):
        p = logistic(x @ w)
        grad = x.T @ (p - y) / len(y) + l2 * w
        hess = (x * (p * (1 - p))[:, None]).T @ x / len(y) + l2 * np.eye(x.shape[1])
        step = np.linalg.solve(hess, grad)
        w -= step
        if np.abs(step).max() < 1e-8:
            break
    return w


def log_loss(p: np.ndarray, y: np.ndarray) -> float:
    p = np.clip(p, 1e-9, 1 - 1e-9)
    return float(-np.mean(y * np.log(p) + (1 - y) * np.log(1 - p)))


def reliability(p: np.ndarray, y: np.ndarray, bins: int = RELIABILITY_BINS) -> list[dict]:
    """Predicted vs observed acceptance per bin of predictions (equal widths on [0, 1])."""
    edges = np.linspace(0.0, 1.0, bins + 1)
    which = np.clip(np.digitize(p, edges[1:-1]), 0, bins - 1)
    return [{"lo": float(edges[b]), "hi": float(edges[b + 1]), "nodes": int((which == b).sum()),
             "predicted": float(p[which == b].mean()) if (which == b).any() else None,
             "observed": float(y[which == b].mean()) if (which == b).any() else None}
            for b in range(bins)]


def calibrate_regime(x: np.ndarray, y: np.ndarray, groups: np.ndarray,
                     holdout: float = 0.25, seed: int = 0) -> dict:
    """Fit on the training groups (prompts), report log-loss and reliability on the held-out
    ones (and on the training rows), then refit on everything for the stored weights."""
    ids = np.unique(groups)
    rng = np.random.default_rng(seed)
    rng.shuffle(ids)
    held = set(ids[:max(1, int(round(holdout * len(ids))))].tolist()) if len(ids) > 1 else set()
    test = np.array([g in held for g in groups])
    w_train = fit(x[~test], y[~test])
    report = {"rows": int(len(y)), "heldout_rows": int(test.sum()),
              "base_rate": float(y.mean())}
    for name, rows in (("train", ~test), ("heldout", test)):
        if rows.any():
            p = logistic(x[rows] @ w_train)
            report[name] = {"log_loss": log_loss(p, y[rows]),
                            "log_loss_constant": log_loss(np.full(rows.sum(), y[~test].mean()),
                                                          y[rows]),
                            "reliability": reliability(p, y[rows])}
    report["weights"] = fit(x, y).tolist()
    return report


def save(path: Path, reports: dict[str, dict], metadata: dict) -> None:
    """Write acceptance.json atomically: weights and reliability per regime."""
    out = {"format_version": FORMAT_VERSION, "features": list(FEATURES), **metadata, **reports}
    path = Path(path)
    tmp = path.with_suffix(".tmp")
    tmp.write_text(json.dumps(out, indent=1))
    tmp.replace(path)
