"""Which models a run uses: the target (fetched, converted once if asked) and its strong drafter.

TreeGraft's gain rests on a good pair: a small model of the target's family with exactly its
tokenizer. A target named without `--draft-model` gets the smallest such model among those
already in the local cache, else the one a short table of known pairs names (downloaded on
first use); the tokenizers are compared before it is used, and one line says what was picked
and why. `--draft-model none`, or nothing that fits, leaves the n-gram drafter alone.
"""

from __future__ import annotations

import json
import re
from dataclasses import dataclass
from pathlib import Path
from typing import Callable, Optional, Sequence, Union

from . import device, hub
from .convert.cached import quantized_once
from .convert.gguf import gguf_once, gguf_path
from .errors import LoadError
from .family import check_same_tokenizer, drafters_off
from .loading import has_tokenizer, load_tokenizer, read_config, weight_files
from .models import SUPPORTED_MODEL_TYPES

PAIRS_FILE = Path(__file__).with_name("pairs.json")
# model types that share one family's tokenizers
FAMILY_OF = {"qwen3_moe": "qwen3", "gemma3_text": "gemma3", "mixtral": "mistral",
             "gemma4_text": "gemma4", "gemma4_assistant": "gemma4"}


@dataclass(frozen=True)
class Models:
    """What a run loads: the target's directory, its drafters' and a line on the choice."""

    target: Path
    drafters: tuple[Path, ...]
    note: Optional[str] = None


@dataclass(frozen=True)
class DrafterChoice:
    name: Optional[str]        # None: no drafter fits, the n-gram drafter alone serves
    path: Optional[Path]
    line: str                  # what was picked and why, for the user


@dataclass(frozen=True)
class CachedModel:
    """One row of `treegraft ls`."""

    repo: str
    path: Path
    bytes: int
    quantization: str
    drafter: str


@dataclass(frozen=True)
class Candidate:
    name: str                  # repo id (or directory) as a user would type it
    path: Optional[Path]       # None: a known pair not in the cache yet
    bytes: int = 0


def family(config: dict) -> str:
    model_type = str(config.get("model_type"))
    return FAMILY_OF.get(model_type, model_type)


def text_settings(config: dict) -> dict:
    """The text model's settings (a multimodal or assistant config nests them)."""
    return config.get("text_config") or config


def drafts_for(other: dict, config: dict) -> bool:
    """Whether a model of config `other` may draft for a target of `config`: the same
    vocabulary size, and for a Gemma 4 assistant the width it was trained beside."""
    if text_settings(other).get("vocab_size") != text_settings(config).get("vocab_size"):
        return False
    return (other.get("model_type") != "gemma4_assistant"
            or other.get("backbone_hidden_size") == text_settings(config).get("hidden_size"))


def model_bytes(path: Path) -> int:
    try:
        return sum(f.stat().st_size for f in weight_files(path))
    except LoadError:
        return 0


def known_drafter(target: str, table: Path = PAIRS_FILE) -> Optional[str]:
    """The drafter repo the known-pairs table names for a target repo id, or None."""
    for pair in json.loads(table.read_text())["pairs"]:
        match = re.fullmatch(pair["target"], target)
        if match:
            return match.expand(pair["drafter"])
    return None


def runnable(path: Path) -> Optional[dict]:
    """The model's config if this runtime can run it (a supported architecture), else None."""
    try:
        config = read_config(path)
    except LoadError:
        return None
    return config if config.get("model_type") in SUPPORTED_MODEL_TYPES else None


def candidates(target: Path, config: dict, target_name: str, download: bool) -> list[Candidate]:
    """Models that may draft for the target (its config given), best first: cached ones of
    its family and vocabulary size, smaller than it, smallest first; then the known pair if
    it is not cached (only when it may be downloaded)."""
    size = model_bytes(target)
    out = []
    for repo, path in hub.cached_repos():
        other = runnable(path)
        if (other is None or path.resolve() == target.resolve()
                or family(other) != family(config) or not drafts_for(other, config)):
            continue
        other_size = model_bytes(path)
        if 0 < other_size < size:
            out.append(Candidate(repo, path, other_size))
    out.sort(key=lambda c: c.bytes)
    known = known_drafter(target_name) if hub.is_repo_id(target_name) else None
    if known and all(c.name != known for c in out):
        out.append(Candidate(known, None))
    return [c for c in out if c.path is not None or download]


def choose_drafter(target: Path, target_name: str, download: bool = True) -> DrafterChoice:
    """The strong drafter for a target named without one, or none."""
    config = read_config(target)
    tokenizer, skipped = load_tokenizer(target, config), []
    for c in candidates(target, config, target_name, download):
        try:
            path = c.path or hub.fetch(c.name)
        except LoadError as e:
            skipped.append(f"{c.name} ({e})")
            continue
        try:
            if has_tokenizer(path):           # an assistant may ship none: it uses its target's
                check_same_tokenizer(tokenizer, load_tokenizer(path, read_config(path)),
                                     "target", c.name)
        except LoadError:
            skipped.append(f"{c.name} (another tokenizer)")
            continue
        why = (f"the smallest cached model of the target's family ({family(config)}, "
               f"{c.bytes / 2**30:.2f} GiB) with its tokenizer" if c.path else
               f"the known pair for {target_name}, downloaded")
        return DrafterChoice(c.name, path, f"drafter: {c.name} ({why}); --draft-model chooses "
                             "another, or none")
    tried = f"; skipped {', '.join(skipped)}" if skipped else ""
    return DrafterChoice(None, None, f"drafter: none (no cached or known model of family "
                  f"{family(config)} shares the target's tokenizer{tried}); "
                  "the n-gram drafter alone serves")


def choose_models(model: Union[str, Path], draft_models: Sequence[Union[str, Path]] = (),
                  revision: Optional[str] = None, q_bits: Optional[int] = None,
                  log: Callable[[str], None] = print) -> Models:
    """The target (downloaded on first use; with q_bits, a plain checkpoint is quantized once
    into the cache) and its drafters: those named, none (`none`), or one chosen for it. A
    bundle (treegraft.json) names its own drafters, so none is chosen for it. A GGUF, named
    by path or by LM Studio's or Ollama's name, is converted once (gguf_bits)."""
    target = source_dir(model, revision, q_bits, log)
    named = [str(d) for d in draft_models]
    if drafters_off(named):
        drafters, note = [], "drafter: none (--draft-model none); the n-gram drafter alone serves"
    elif named or (target / "treegraft.json").exists():
        drafters, note = [source_dir(d, None, q_bits, log) for d in named], None
    else:
        choice = choose_drafter(target, str(model))
        drafters, note = [choice.path] if choice.path else [], choice.line
    if note:
        log(note)
    if q_bits is not None:
        target = quantized_once(target, q_bits, log)
        drafters = [quantized_once(d, q_bits, log) for d in drafters]
    return Models(target, tuple(drafters), note)


def model_dir(ref: Union[str, Path], revision: Optional[str] = None,
              q_bits: Optional[int] = None, log: Callable[[str], None] = print) -> Path:
    """The directory a model reference runs from: source_dir, quantized once to q_bits."""
    path = source_dir(ref, revision, q_bits, log)
    return quantized_once(path, q_bits, log) if q_bits is not None else path


def source_dir(ref: Union[str, Path], revision: Optional[str] = None,
               q_bits: Optional[int] = None, log: Callable[[str], None] = print) -> Path:
    """A GGUF converted once (to gguf_bits), or a directory or Hub snapshot as it is."""
    if gguf_path(ref) is not None:
        return gguf_once(ref, gguf_bits(q_bits, log), log)
    return hub.resolve_path(ref, revision)


def gguf_bits(q_bits: Optional[int], log: Callable[[str], None] = print) -> Optional[int]:
    """What a GGUF is converted to: the bits asked; else 4 bits on a GPU, as the file's own
    footprint suggests, and float32 on the CPU, where MLX's quantized matmul runs far slower
    than reading float weights (None: float32)."""
    if q_bits is not None:
        return q_bits
    if device.on_gpu():
        return 4
    log("a GGUF runs in float32 on the CPU (quantized matmul is slower there; --q-bits 4 "
        "to requantize anyway)")
    return None


def cached_models() -> list[CachedModel]:
    """The models in the local cache this runtime can run, each with the drafter it would get
    (from the cache alone: nothing is downloaded)."""
    out = []
    for repo, path in hub.cached_repos():
        config = runnable(path)
        if config is None:
            continue
        q = config.get("quantization") or {}
        quantization = f"{q['bits']}-bit" if "bits" in q else str(config.get("torch_dtype", "?"))
        choice = choose_drafter(path, repo, download=False)
        known = known_drafter(repo)
        drafter = choice.name or (f"{known} (not cached: downloaded on first run)" if known
                                  else "none (n-gram only)")
        out.append(CachedModel(repo, path, model_bytes(path), quantization, drafter))
    return out
