"""What both calibrations share: a generation played step by step on one prompt, and the
resumable per-prompt log they write it to (one JSON line per prompt, one regime per log)."""

from __future__ import annotations

import json
from dataclasses import asdict
from pathlib import Path
from typing import Callable, Optional

import numpy as np

from .step import VerifiedStep
from .sampling import SamplerSettings
from .session import Session


def play(session: Session, ids: list[int], settings: SamplerSettings, rng: np.random.Generator,
         max_tokens: int, step: Callable[[int], VerifiedStep]) -> None:
    """Prefill `ids`, then run `step(root)` (build a tree under the root, step.tree_step
    it) until `max_tokens` are committed or one of them is EOS: the text follows the
    regime's own trajectory, as decoding's does."""
    root = session.prefill(ids, settings, rng)
    eos = set(session.family.tokenizer.eos_token_ids)
    generated = 0
    while generated < max_tokens:
        verified = step(root)
        generated += len(verified.block)
        if eos & set(verified.block):
            return
        root = verified.acceptance.bonus


def read_entries(path: Path) -> dict[str, dict]:
    """Entries of a resumable JSONL log, one per prompt id; a torn last line (an interrupted
    write) is ignored."""
    done: dict[str, dict] = {}
    if Path(path).exists():
        for line in Path(path).read_text().splitlines():
            try:
                entry = json.loads(line)
            except ValueError:
                continue
            done[entry["prompt_id"]] = entry
    return done


def resume(log_file: Path, prompts: list[dict], settings: SamplerSettings,
           run: Callable[[int, dict], dict],
           progress: Optional[Callable[[int], None]] = None) -> dict[str, dict]:
    """Every prompt's entry: those already in `log_file`, then `run(index, prompt)` for each
    prompt missing, appended (and flushed) as it finishes, so an interrupted run resumes where
    it stopped. Each entry records its sampling settings: a log of another regime is refused,
    never mixed into."""
    log_file = Path(log_file)
    log_file.parent.mkdir(parents=True, exist_ok=True)
    regime = asdict(settings)
    done = read_entries(log_file)
    for entry in done.values():
        if entry.get("sampling") != regime:
            raise ValueError(f"{log_file} was labelled with {entry.get('sampling')}, not "
                             f"{regime}; use another work directory")
    with open(log_file, "a") as f:
        for i, p in enumerate(prompts):
            if p["id"] not in done:
                entry = {"prompt_id": p["id"], "sampling": regime, **run(i, p)}
                f.write(json.dumps(entry) + "\n")
                f.flush()
                done[p["id"]] = entry
            if progress:
                progress(1)
    return done
