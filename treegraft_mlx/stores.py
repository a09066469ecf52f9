"""The GGUF models LM Studio and Ollama keep on disk, under the names those tools show.

LM Studio keeps files as `~/.lmstudio/models/<publisher>/<repo>/<file>.gguf` (older versions
under `~/.cache/lm-studio/models`); its name for one is `<publisher>/<repo>/<file>.gguf`, and
`<publisher>/<repo>` where that folder holds one model. Ollama keeps a manifest per
`name:tag` under `$OLLAMA_MODELS` (default `~/.ollama/models`) whose model layer names a blob
by digest; `ollama list` shows `name:tag`, with `registry.ollama.ai/library/` left out. Only
these files are read: nothing here starts or asks either tool.
"""

from __future__ import annotations

import json
import os
from dataclasses import dataclass
from pathlib import Path
from typing import Optional

from .errors import LoadError

OLLAMA_MODEL_LAYER = "application/vnd.ollama.image.model"
OLLAMA_DEFAULT = ("registry.ollama.ai", "library")


@dataclass(frozen=True)
class StoredModel:
    """One GGUF model a local store holds."""
    store: str        # "lmstudio" or "ollama"
    name: str         # as that tool shows it
    path: Path        # the GGUF file (for a split set, its first file)


def lmstudio_roots() -> list[Path]:
    home = Path.home()
    return [r for r in (home / ".lmstudio" / "models", home / ".cache" / "lm-studio" / "models")
            if r.is_dir()]


def ollama_root() -> Path:
    return Path(os.environ.get("OLLAMA_MODELS") or Path.home() / ".ollama" / "models")


def lmstudio_models() -> list[StoredModel]:
    """Every GGUF in LM Studio's folders (a split set once, by its first file)."""
    out = []
    for root in lmstudio_roots():
        for f in sorted(root.glob("*/*/*.gguf")):
            if "-of-" in f.name and "-00001-of-" not in f.name:
                continue
            if f.name.startswith("mmproj"):      # vision projectors, not language models
                continue
            out.append(StoredModel("lmstudio", str(f.relative_to(root)), f))
    return out


def ollama_models() -> list[StoredModel]:
    """Every Ollama manifest with a model layer whose blob is on disk."""
    root = ollama_root()
    manifests = root / "manifests"
    out = []
    for m in sorted(manifests.glob("*/*/*/*")) if manifests.is_dir() else []:
        host, namespace, model, tag = m.relative_to(manifests).parts
        blob = _ollama_blob(root, m)
        if blob is not None:
            out.append(StoredModel("ollama", _ollama_name(host, namespace, model, tag), blob))
    return out


def _ollama_name(host: str, namespace: str, model: str, tag: str) -> str:
    if (host, namespace) == OLLAMA_DEFAULT:
        return f"{model}:{tag}"
    if host == OLLAMA_DEFAULT[0]:
        return f"{namespace}/{model}:{tag}"
    return f"{host}/{namespace}/{model}:{tag}"


def _ollama_blob(root: Path, manifest: Path) -> Optional[Path]:
    try:
        layers = json.loads(manifest.read_text()).get("layers", [])
    except (OSError, json.JSONDecodeError, AttributeError):
        return None
    for layer in layers:
        if layer.get("mediaType") == OLLAMA_MODEL_LAYER and "digest" in layer:
            blob = root / "blobs" / layer["digest"].replace(":", "-")
            return blob if blob.is_file() else None
    return None


def stored_models() -> list[StoredModel]:
    return lmstudio_models() + ollama_models()


def find_gguf(name: str) -> Optional[Path]:
    """The GGUF file a store name stands for, or None when no store knows the name. A
    `<publisher>/<repo>` of LM Studio that holds several files is refused, naming them."""
    ollama = {m.name: m.path for m in ollama_models()}
    full = name if ":" in name else f"{name}:latest"
    if full in ollama:
        return ollama[full]
    lmstudio = lmstudio_models()
    exact = [m.path for m in lmstudio if m.name == name]
    if exact:
        return exact[0]
    inside = [m for m in lmstudio if m.name.startswith(name.rstrip("/") + "/")]
    if len(inside) > 1:
        raise LoadError(f"LM Studio's {name} holds several models; name one: "
                        f"{', '.join(m.name for m in inside)}")
    return inside[0].path if inside else None
