"""Decides, before each tree layer, whether the strong drafter expands it.

Fixed schedules cover the endpoints and ablations; the learned scheduler (docs/design.md §6)
computes 17 features of the tree being built and calls the strong drafter iff a tiny MLP
predicts a positive value and fewer than `b0` calls were made this step.

A schedule answers "which of the remaining layers is the next call?" from the states those
layers would have if the cheap drafter expanded each of them. The n-gram drafter is
deterministic, so these states are exactly the states the layers will have up to the first
call; the learned scheduler scores them in one batched MLP evaluation. One MLX evaluation per
run of skipped layers instead of one per layer is what keeps its overhead small on devices
where an evaluation costs ~100-300 us whatever its size.
"""

from __future__ import annotations

import json
import math
from dataclasses import dataclass, field
from pathlib import Path
from typing import Iterable, Optional, Protocol

import mlx.core as mx
import numpy as np

from .tree import DraftTree, reselect

FORMAT_VERSION = 1
BIT_LAYERS = 5  # "layer j already called" bits for j = 1..5 (deeper layers have no bit)
FEATURE_NAMES = (
    "log1p_context", "t_tgt_ms", "t_mid_ms", "log_t_tgt_over_t_mid", "layer_over_depth",
    "called_over_depth", *(f"called_layer_{j}" for j in range(1, BIT_LAYERS + 1)),
    "frontier_mean_depth", "frontier_leaf_ratio", "collapse_debt", "reselect_other_depth_share",
    "reselect_frontier_overlap", "reselect_mean_score",
)
HIDDEN = (64, 32)


@dataclass
class LayerState:
    """What a schedule may look at before expanding `layer` (1-based)."""

    layer: int
    depth: int
    context: int                      # committed tokens
    called: list[int]                 # layers the strong drafter expanded this step
    tree: DraftTree
    frontier: list[int]
    top_k: int
    lookback: int


class Schedule(Protocol):
    def first_call(self, ahead: Iterable[LayerState], num_drafters: int) -> Optional[int]:
        """Position in `ahead` of the first layer the strong drafter expands; None for none.

        `ahead` yields the remaining layers' states as the cheap drafter alone would leave
        them, lazily (each state after the first costs one cheap expansion): read only as
        far as needed."""
        ...


@dataclass(frozen=True)
class FixedSchedule:
    """The strong drafter (last drafter) expands exactly `combine_layers` (1-based)."""

    combine_layers: frozenset[int]

    def first_call(self, ahead: Iterable[LayerState], num_drafters: int) -> Optional[int]:
        if num_drafters < 2 or not self.combine_layers:
            return None
        last = max(self.combine_layers)
        for i, state in enumerate(ahead):
            if state.layer in self.combine_layers:
                return i
            if state.layer > last:
                return None
        return None


def parse_layers(spec: str) -> frozenset[int]:
    """'1,3' -> {1, 3}; '' -> no combine layer."""
    try:
        layers = frozenset(int(x) for x in spec.split(",") if x.strip())
    except ValueError:
        raise ValueError(f"combine layers must be comma-separated integers, got {spec!r}") from None
    if any(layer < 1 for layer in layers):
        raise ValueError(f"combine layers are 1-based, got {sorted(layers)}")
    return layers


def features(state: LayerState, t_tgt_ms: float, t_mid_ms: float) -> np.ndarray:
    """The 17 features, in FEATURE_NAMES order (float32).

    Tree-state signals: frontier_leaf_ratio = share of the tree's leaves that are on the
    frontier (the rest were terminated or cut); collapse_debt = mean frontier depth minus mean
    depth of the frontier a reselection would pick now; the reselected set's share of nodes
    from other depths than the deepest frontier depth, its overlap with the frontier (share of
    it already on the frontier), and its mean finite score (0 if none is finite).
    Plain Python over the tree's lists: it runs before every layer and must stay cheap.
    """
    tree, frontier = state.tree, state.frontier
    depth, score = tree.depth, tree.score
    f_depth = [depth[f] for f in frontier] or [0]
    d_max, f_mean = max(f_depth), sum(f_depth) / len(f_depth)
    leaves = len(tree) - len(tree.kids)
    on_frontier = sum(1 for f in frontier if f not in tree.kids)
    leaf_ratio = on_frontier / leaves if leaves else 0.0
    chosen = reselect(tree, state.top_k, state.lookback, state.depth, d_max)
    if chosen:
        r_depth = [depth[c] for c in chosen]
        debt = f_mean - sum(r_depth) / len(r_depth)
        other = sum(1 for d in r_depth if d != d_max) / len(r_depth)
        in_frontier = set(frontier)
        overlap = sum(1 for c in chosen if c in in_frontier) / len(chosen)
        finite = [score[c] for c in chosen if math.isfinite(score[c])]
        mean_score = sum(finite) / len(finite) if finite else 0.0
    else:
        debt = other = overlap = mean_score = 0.0
    bits = [1.0 if j in state.called else 0.0 for j in range(1, BIT_LAYERS + 1)]
    return np.array([
        math.log1p(state.context), t_tgt_ms, t_mid_ms, math.log(t_tgt_ms / t_mid_ms),
        state.layer / state.depth, len(state.called) / state.depth, *bits,
        f_mean, leaf_ratio, debt, other, overlap, mean_score,
    ], dtype=np.float32)


@dataclass
class SchedulerMLP:
    """z-scored input -> 17-64-32-1 ReLU MLP -> de-standardised value (call minus skip).

    Weights follow the (out, in) convention of `mlx.nn.Linear`. `value` runs an `mx.compile`d
    function of the parameters, so one decision is a single fused call.
    """

    params: dict[str, mx.array]
    _compiled: Optional[object] = field(default=None, repr=False)

    PARAM_NAMES = ("in_mean", "in_std", "l1.weight", "l1.bias", "l2.weight", "l2.bias",
                   "l3.weight", "l3.bias", "out_mean", "out_std")

    @classmethod
    def init(cls, seed: int = 0, n_in: int = len(FEATURE_NAMES)) -> "SchedulerMLP":
        """He-initialised weights, identity normalisation."""
        key = mx.random.key(seed)
        dims = (n_in, *HIDDEN, 1)
        p = {"in_mean": mx.zeros((n_in,)), "in_std": mx.ones((n_in,)),
             "out_mean": mx.zeros((1,)), "out_std": mx.ones((1,))}
        for i, (a, b) in enumerate(zip(dims[:-1], dims[1:]), start=1):
            key, sub = mx.random.split(key)
            p[f"l{i}.weight"] = mx.random.normal((b, a), key=sub) * math.sqrt(2.0 / a)
            p[f"l{i}.bias"] = mx.zeros((b,))
        return cls(p)

    def value(self, x: mx.array) -> mx.array:
        """Predicted value of calling the strong drafter, for (..., 17) features."""
        if self._compiled is None:
            self._compiled = mx.compile(mlp_forward)
        return self._compiled(self.params, x)

    def save(self, directory: Path, metadata: dict) -> None:
        """Write scheduler.safetensors and scheduler.json (each atomically)."""
        directory = Path(directory)
        directory.mkdir(parents=True, exist_ok=True)
        tmp = directory / "scheduler.tmp.safetensors"
        mx.save_safetensors(str(tmp), {k: self.params[k] for k in self.PARAM_NAMES})
        tmp.replace(directory / "scheduler.safetensors")
        meta = {"format_version": FORMAT_VERSION, "features": list(FEATURE_NAMES),
                "hidden": list(HIDDEN), **metadata}
        tmp_json = directory / "scheduler.json.tmp"
        tmp_json.write_text(json.dumps(meta, indent=2))
        tmp_json.replace(directory / "scheduler.json")


def mlp_forward(params: dict[str, mx.array], x: mx.array) -> mx.array:
    z = (x - params["in_mean"]) / params["in_std"]
    h = mx.maximum(z @ params["l1.weight"].T + params["l1.bias"], 0.0)
    h = mx.maximum(h @ params["l2.weight"].T + params["l2.bias"], 0.0)
    y = h @ params["l3.weight"].T + params["l3.bias"]
    return (y * params["out_std"] + params["out_mean"])[..., 0]


def load_artifact(directory: Path) -> tuple[SchedulerMLP, dict]:
    """Read a scheduler artifact; clear errors for what is missing or of another format."""
    directory = Path(directory)
    meta_file, weights = directory / "scheduler.json", directory / "scheduler.safetensors"
    for f in (meta_file, weights):
        if not f.exists():
            raise FileNotFoundError(f"scheduler artifact incomplete: {f} is missing")
    meta = json.loads(meta_file.read_text())
    if meta.get("format_version") != FORMAT_VERSION:
        raise ValueError(f"{meta_file}: format_version {meta.get('format_version')!r}, "
                         f"this runtime reads {FORMAT_VERSION}")
    if tuple(meta.get("features", ())) != FEATURE_NAMES:
        raise ValueError(f"{meta_file}: feature list differs from this runtime's")
    params = mx.load(str(weights))
    missing = set(SchedulerMLP.PARAM_NAMES) - set(params)
    if missing:
        raise ValueError(f"{weights}: missing tensors {sorted(missing)}")
    return SchedulerMLP(params), meta


@dataclass
class LearnedSchedule:
    """Strong drafter iff mlp(features) > 0 and fewer than b0 calls this step.

    Which rows go into one MLP evaluation changes the cost, never a decision (each row's
    value is the same however rows are grouped). The rows up to where the previous run's
    first call was are scored first: when the scheduler keeps calling at the same layer
    (sampling calls on most steps), the look-ahead past it is never built; otherwise the rest
    follows in a second evaluation."""

    mlp: SchedulerMLP
    t_tgt_ms: float
    t_mid_ms: float
    b0: int = 5
    evaluations: int = 0          # MLP evaluations so far (what a decision's cost is spread over)
    last_call: Optional[int] = None   # the previous run's first call (position), if any

    def first_call(self, ahead: Iterable[LayerState], num_drafters: int) -> Optional[int]:
        if num_drafters < 2:
            return None
        rows: list[np.ndarray] = []
        scored = 0                        # rows already evaluated (none of them calls)
        for state in ahead:
            if len(state.called) >= self.b0:   # the same on every state of a skip run
                break
            rows.append(features(state, self.t_tgt_ms, self.t_mid_ms))
            if scored == 0 and len(rows) - 1 == self.last_call:
                k = self._first_positive(rows)
                if k is not None:
                    self.last_call = k
                    return k
                scored = len(rows)
        if not rows:                      # budget spent: nothing decided, the hint kept
            return None
        k = self._first_positive(rows[scored:]) if len(rows) > scored else None
        self.last_call = None if k is None else scored + k
        return self.last_call

    def _first_positive(self, rows: list[np.ndarray]) -> Optional[int]:
        """Position of the first row whose value is positive (one MLP evaluation)."""
        self.evaluations += 1
        calls = np.flatnonzero(np.array(self.mlp.value(mx.array(np.stack(rows)))) > 0)
        return int(calls[0]) if len(calls) else None
