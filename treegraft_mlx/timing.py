"""What decoding costs on this machine, measured once per model pair and device, cached on disk.

Two records: the step costs the per-step size choice prices (the target's verification latency
for every block size, a pipelined AR step, a tree step's host work) and the scheduler's T_tgt /
T_mid. Measuring runs generations, which is probe.py's business: it passes in the measuring
functions, so this module only stores, keys and reuses what they return.
"""

from __future__ import annotations

import hashlib
import json
import platform
import statistics
import time
from dataclasses import asdict, dataclass
from functools import cached_property
from pathlib import Path
from typing import Callable, Optional, TypeVar

import mlx.core as mx
import numpy as np

from .hub import treegraft_cache
from .tree import attention_mask, positions

LATENCY_CONTEXT = 256      # committed tokens behind the measured blocks


@dataclass(frozen=True)
class Timing:
    t_tgt_ms: float   # one verification forward of a pruned tree
    t_mid_ms: float   # one strong-drafter call (forward of the nodes new since its last call)


@dataclass(frozen=True)
class StepCosts:
    """What one decoding step costs here, by the number of tree nodes it verifies."""

    sizes: tuple[int, ...]          # the block sizes measured (ascending, 1 first)
    latency_ms: tuple[float, ...]   # one target forward over a block of each size
    ar_ms: float                    # one pipelined AR step (the step that verifies the root alone)
    overhead_ms: float              # a tree step's host work besides the forward
    draft_ms: float                 # one step's n-gram drafting
    # ms each row past the first adds per committed token past LATENCY_CONTEXT: attention
    # over a long context makes rows dearer (measured at two contexts).
    row_context_ms: float = 0.0

    def __post_init__(self):
        object.__setattr__(self, "sizes", tuple(int(x) for x in self.sizes))
        object.__setattr__(self, "latency_ms", tuple(float(x) for x in self.latency_ms))

    @property
    def max_rows(self) -> int:
        return self.sizes[-1]

    def rows_for(self, n: int) -> int:
        """The block size to verify n nodes with: the fastest measured size >= n (BLAS kernels
        favour some row counts), n itself past the table."""
        fits = [(ms, m) for m, ms in zip(self.sizes, self.latency_ms) if m >= n]
        return min(fits)[1] if fits else n

    def step_ms(self, context: int = LATENCY_CONTEXT) -> np.ndarray:
        """[n - 1]: ms of a step that verifies n nodes (n = 1: an AR step) after `context`
        committed tokens, for n up to the largest measured block; drafting excluded."""
        base, extra_rows = self._table
        return base + extra_rows * (self.row_context_ms * (context - LATENCY_CONTEXT))

    @cached_property
    def _table(self) -> tuple[np.ndarray, np.ndarray]:
        """step_ms at LATENCY_CONTEXT, and the rows past the first each step verifies (what
        a longer context makes dearer): computed once, read on every step."""
        latency = dict(zip(self.sizes, self.latency_ms))
        rows = [self.rows_for(n) for n in range(2, self.max_rows + 1)]
        base = [self.ar_ms] + [latency[m] + self.overhead_ms for m in rows]
        return np.array(base), np.array([0] + [m - 1 for m in rows], dtype=np.float64)


def default_cache_file() -> Path:
    return treegraft_cache() / "timings.json"


def device_key() -> str:
    return "|".join([str(mx.default_device()), platform.node(),
                     platform.processor() or platform.machine()])


def model_key(path: Optional[Path]) -> str:
    """A model as it is on disk now: its resolved path and a hash of its config and weight
    files' names, sizes and modification times, so weights rewritten in place (a retrained
    family) are measured afresh."""
    if path is None:
        return "None"
    path = Path(path).resolve()
    files = sorted(path.glob("*.safetensors"))
    listing = [(f.name, f.stat().st_size, f.stat().st_mtime_ns) for f in files]
    config = path / "config.json"
    text = (config.read_text() if config.exists() else "") + json.dumps(listing)
    return f"{path}@{hashlib.sha256(text.encode()).hexdigest()[:16]}"


def timing_key(family, tree) -> str:
    """Model pair, tree shape and device: what T_tgt and T_mid depend on."""
    paths = family.model_paths
    strong = list(family.drafters)[-1]
    return "|".join(["timing", model_key(paths.get("target")), model_key(paths.get(strong)),
                     device_key(), f"k{tree.top_k}d{tree.depth}b{tree.budget}"])


def step_costs_key(family, tree) -> str:
    """Target and device (the forward's costs) and the n-gram tree shape (the drafting's)."""
    return "|".join(["steps", model_key(family.model_paths.get("target")), device_key(),
                     f"k{tree.top_k}d{tree.depth}n{tree.n_max}"])


R = TypeVar("R", Timing, StepCosts)


def cached(cls: type[R], key: str, measure: Callable[[], R],
           cache_file: Optional[Path] = None, refresh: bool = False) -> R:
    """The record stored under `key`, measured (and stored) on first use or when `refresh`.
    A damaged cache is re-measured, never trusted; a read-only home only costs the
    measurement again next time."""
    cache_file = Path(cache_file or default_cache_file())
    table = {}
    if cache_file.exists():
        try:
            table = json.loads(cache_file.read_text())
            if key in table and not refresh:
                return cls(**table[key])
        except (OSError, ValueError, TypeError):
            table = {}
    record = measure()
    table[key] = asdict(record)
    try:
        cache_file.parent.mkdir(parents=True, exist_ok=True)
        tmp = cache_file.with_suffix(".tmp")
        tmp.write_text(json.dumps(table, indent=1))
        tmp.replace(cache_file)
    except OSError:
        pass
    return record


def verification_latency(target, sizes=(1, 2, 4, 8, 16, 32, 64, 128),
                         context: int = LATENCY_CONTEXT, repeats: int = 5,
                         progress: Optional[Callable[[int], None]] = None) -> dict[int, float]:
    """Median ms of one target forward over n tree nodes (a chain) after `context` tokens.
    The sizes are measured in rounds (one forward of each per round, after a warm-up round),
    so that drift on a busy machine falls on every size alike; `progress` advances per round."""
    cache = target.make_cache()
    target(mx.array([list(range(3, 3 + context))]), cache=cache)
    cache.commit()
    blocks = {}
    vocab = target.args.vocab_size
    for n in sizes:  # distinct tokens, so a mixture of experts routes rows as a tree's would
        parent = list(range(-1, n - 1))
        tokens = [3 + (7919 * i + 11) % (vocab - 3) for i in range(n)]
        blocks[n] = (mx.array([tokens]), positions(parent, context),
                     attention_mask(parent, context))
    times: dict[int, list[float]] = {n: [] for n in sizes}
    for round_ in range(repeats + 1):
        for n, (tokens, pos, mask) in blocks.items():
            t0 = time.perf_counter()
            mx.eval(target(tokens, cache=cache, positions=pos, mask=mask))
            if round_:
                times[n].append(time.perf_counter() - t0)
        if progress:
            progress(1)
    return {n: statistics.median(t) * 1000 for n, t in times.items()}


class LatencyCurve:
    """Target verification ms for n nodes, interpolated from measured points."""

    def __init__(self, points: dict[int, float]):
        self.n = np.array(sorted(points), dtype=np.float64)
        self.ms = np.array([points[k] for k in sorted(points)], dtype=np.float64)

    def __call__(self, n: int) -> float:
        return float(np.interp(n, self.n, self.ms))


def pad_map(latency: dict[int, float], limit: int) -> tuple[int, ...]:
    """For n = 1..limit nodes: the block size m in [n, limit] with the lowest measured latency
    (ties to the smaller block). Measured, not assumed: BLAS kernels favour some row counts."""
    sizes = sorted(m for m in latency if m <= limit)
    return tuple(min((m for m in sizes if m >= n), key=lambda m: (latency[m], m))
                 for n in range(1, limit + 1))
