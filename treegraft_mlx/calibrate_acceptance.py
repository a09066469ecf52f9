"""Logs verification outcomes per drafted node on calibration prompts and fits the acceptance
estimates (acceptance.py) for one decoding regime.

Each step builds the tree with a random schedule (each layer expanded by the strong drafter
with probability CALL_PROB, and its greedy chain grafted from the root with probability
CHAIN_PROB, as `treegraft` and `draft` do), so nodes of every provenance are seen; the target verifies every
built node (up to MAX_LOGGED_NODES, best-scored first), and each node is labelled with its exact
conditional acceptance probability: the target's processed probability of the node's token at
its parent (for greedy decoding 1 if it is the argmax, else 0). The step then commits as
decoding would, so the text follows the regime's own trajectory. The log is written per prompt
(`<work>/<regime>.jsonl`), so an interrupted run resumes where it stopped.
"""

from __future__ import annotations

from dataclasses import asdict
from pathlib import Path
from typing import Callable, Optional

import mlx.core as mx
import numpy as np

from .acceptance import calibrate_regime, node_features, regime
from .build import TreeBuild
from .calibration import play, resume
from .step import VerifiedStep, tree_step
from .drafters import Drafters
from .family import Family
from .sampling import SamplerSettings, target_probs
from .scheduler import FixedSchedule
from .session import Session
from .tree import prune

CALL_PROB = 0.3
CHAIN_PROB = 0.5
MAX_LOGGED_NODES = 48


def log_prompt(session: Session, ids: list[int], settings: SamplerSettings, max_tokens: int,
               rng: np.random.Generator) -> dict:
    """Features and labels of every verified drafted node while generating up to max_tokens."""
    cfg = session.tree
    drafters = Drafters(session.ngram, session.strong)
    xs, ys = [], []

    def step(root: int) -> VerifiedStep:
        history = session.history
        layers = frozenset(j for j in range(1, cfg.depth + 1)
                           if drafters.strong is not None and rng.random() < CALL_PROB)
        build = TreeBuild.rooted_at(root)
        build.expand(range(1, cfg.depth + 1), FixedSchedule(layers), drafters, cfg, history)
        if drafters.strong is not None and rng.random() < CHAIN_PROB:
            build.graft_chain(drafters.strong, cfg.depth, cfg, history)
        tree = build.tree.subtree(prune(build.tree, MAX_LOGGED_NODES))
        verified = tree_step(session, drafters, tree, len(tree), settings, rng)
        if len(tree) > 1:
            parent, token = np.asarray(tree.parent[1:]), np.asarray(tree.token[1:])
            probs = target_probs(verified.logits[mx.array(parent)], settings)
            label = mx.take_along_axis(probs, mx.array(token)[:, None], -1)[:, 0]
            xs.append(node_features(tree, cfg.n_max, cfg.depth)[1:])
            ys.append(np.array(label, dtype=np.float64))
        return verified

    play(session, ids, settings, rng, max_tokens, step)
    x = np.concatenate(xs) if xs else np.zeros((0, 0))
    return {"x": x.round(6).tolist(), "y": np.concatenate(ys).round(6).tolist() if ys else []}


def calibrate_acceptance(family: Family, prompts: list[dict], work_dir: Path,
                         settings: SamplerSettings, max_tokens: int = 64, seed: int = 0,
                         progress: Optional[Callable[[int], None]] = None) -> dict:
    """Log (resumably) and fit the regime `settings` decodes in; returns its report (weights,
    held-out log-loss against a constant, reliability per bin)."""
    def run(i: int, p: dict) -> dict:
        return log_prompt(Session(family, family.tree), family.tokenizer.encode(p["prompt"]),
                          settings, max_tokens, np.random.default_rng([seed, i]))

    log_file = Path(work_dir) / f"{regime(not settings.greedy)}.jsonl"
    done = resume(log_file, prompts, settings, run, progress)
    rows = [(i, done[p["id"]]) for i, p in enumerate(prompts) if done[p["id"]]["y"]]
    x = np.concatenate([np.asarray(e["x"]) for _, e in rows])
    y = np.concatenate([np.asarray(e["y"]) for _, e in rows])
    groups = np.concatenate([np.full(len(e["y"]), i) for i, e in rows])
    report = calibrate_regime(x, y, groups, seed=seed)
    report["sampling"] = asdict(settings)
    report["prompts"] = len(rows)
    return report
