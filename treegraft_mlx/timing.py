"""Measures what a verification and a strong-drafter call cost on this machine (the scheduler's
T_tgt and T_mid), once per model pair and device, and caches the result on disk."""

from __future__ import annotations

import json
import os
import platform
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Optional

import mlx.core as mx

# A short code prompt for the warm-up: repetitive enough that the tree fills up.
WARMUP_PROMPT = ("def add(a, b):\n    return a + b\n\n\ndef sub(a, b):\n    return a - b\n\n\n"
                 "def mul(a, b):\n")
WARMUP_TOKENS = 48


@dataclass(frozen=True)
class Timing:
    t_tgt_ms: float   # one verification forward of a pruned tree
    t_mid_ms: float   # one strong-drafter call (forward of the nodes new since its last call)


def default_cache_file() -> Path:
    root = os.environ.get("TREEGRAFT_CACHE") or Path.home() / ".cache" / "treegraft_mlx"
    return Path(root) / "timings.json"


def timing_key(family, tree) -> str:
    """Model pair (paths), tree shape and device: what the two costs depend on."""
    paths = family.model_paths
    strong = list(family.drafters)[-1]
    return "|".join([str(paths.get("target")), str(paths.get(strong)), str(mx.default_device()),
                     platform.node(), platform.processor() or platform.machine(),
                     f"k{tree.top_k}d{tree.depth}b{tree.budget}"])


def measure_timing(family, tree) -> Timing:
    """Warm-up with the strong drafter forced on every layer (the `draft` endpoint)."""
    from .engine import generate

    generate(family, WARMUP_PROMPT, "draft", max_tokens=8, tree=tree)  # first-call costs
    res = generate(family, WARMUP_PROMPT, "draft", max_tokens=WARMUP_TOKENS, tree=tree)
    steps = res.step_stats
    calls = max(1, res.drafter_calls)
    return Timing(t_tgt_ms=1000 * sum(s.t_verify for s in steps) / len(steps),
                  t_mid_ms=1000 * sum(s.t_draft for s in steps) / calls)


def cached_timing(family, tree, cache_file: Optional[Path] = None) -> Timing:
    """The measured timing for this family, tree shape and device; measured on first use."""
    cache_file = Path(cache_file or default_cache_file())
    key = timing_key(family, tree)
    table = {}
    if cache_file.exists():
        try:
            table = json.loads(cache_file.read_text())
        except (OSError, ValueError):
            table = {}  # a damaged cache is re-measured, never trusted
    if key in table:
        return Timing(**table[key])
    timing = measure_timing(family, tree)
    table[key] = asdict(timing)
    try:
        cache_file.parent.mkdir(parents=True, exist_ok=True)
        tmp = cache_file.with_suffix(".tmp")
        tmp.write_text(json.dumps(table, indent=1))
        tmp.replace(cache_file)
    except OSError:
        pass  # a read-only home only costs the warm-up again next time
    return timing
