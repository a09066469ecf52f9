"""A plain checkpoint quantized once into the cache (`--q-bits`), keyed by repo and revision."""

from __future__ import annotations

import hashlib
from pathlib import Path
from typing import Callable

from ..hub import treegraft_cache
from ..loading import read_config
from .bundle import QuantSpec, convert_family


def cache_key(path: Path, spec: QuantSpec) -> str:
    """A Hub snapshot (…/models--owner--name/snapshots/<commit>) is keyed by repo and commit;
    a local directory by its resolved path."""
    path = Path(path).resolve()
    if path.parent.name == "snapshots" and path.parent.parent.name.startswith("models--"):
        name = f"{path.parent.parent.name[len('models--'):]}--{path.name[:12]}"
    else:
        name = f"{path.name}--{hashlib.sha256(str(path).encode()).hexdigest()[:12]}"
    return f"{name}--q{spec.bits}g{spec.group_size}"


def quantized_once(path: Path, bits: int, log: Callable[[str], None] = print) -> Path:
    """The model quantized to `bits` (converted on first use with `treegraft convert`'s code,
    then reused); a checkpoint mlx_lm already quantized is used as it is."""
    if read_config(path).get("quantization"):
        log(f"{path.name}: already quantized, used as it is")
        return path
    spec = QuantSpec(bits)
    bundle = treegraft_cache() / "converted" / cache_key(path, spec)
    if not (bundle / "treegraft.json").exists():
        bundle.parent.mkdir(parents=True, exist_ok=True)
        log(f"quantizing {path} to {bits} bits once, into {bundle}")
        convert_family(str(path), [], str(bundle), spec, log=log)
    return bundle / "target"
