"""GGUF files into model directories: dequantized once into the cache, keyed by the file.

`--model file.gguf` (or a name LM Studio or Ollama shows) and `treegraft convert --hf-path
file.gguf` both come here. The float checkpoint is a plain Hugging Face-style directory
(config.json, tokenizer.json, safetensors), so `mlx_lm.load` and transformers open it too;
a quantized one is that checkpoint passed through `convert_family`, the intermediate float
copy written to a temporary directory and removed. Each result is written beside its final
place and renamed into it: a failure or Ctrl-C leaves nothing half-written in the cache.
"""

from __future__ import annotations

import hashlib
import json
import os
import tempfile
from pathlib import Path
from typing import Callable, Optional

import mlx.core as mx

from ..gguf_file import GGUFError, read_model
from ..hub import treegraft_cache
from ..stores import find_gguf
from .bundle import DTYPES, SHARD_BYTES, QuantSpec, convert_family, written_beside


def is_gguf(ref) -> bool:
    """Whether a model reference names a GGUF: a .gguf file, or a model of LM Studio's or
    Ollama's store."""
    return gguf_path(ref) is not None


def gguf_path(ref) -> Optional[Path]:
    """The GGUF file a reference names (the first file of a split set as given), or None."""
    path = Path(str(ref)).expanduser()
    if path.suffix == ".gguf":
        if not path.is_file():
            raise GGUFError(f"GGUF file {path} does not exist")
        return path
    if path.exists():
        return None
    return find_gguf(str(ref))


def file_key(path: Path) -> str:
    """The cache name of a GGUF file: its name and a hash of its resolved path, size and
    modification time (a file replaced in place is converted again)."""
    path = path.resolve()
    st = path.stat()
    ident = f"{path}|{st.st_size}|{st.st_mtime_ns}"
    return f"{path.stem}--{hashlib.sha256(ident.encode()).hexdigest()[:12]}"


def model_name(ref, path: Path) -> str:
    """The directory name of a converted GGUF (a drafter's name in a bundle): the file's stem
    (a split set's without its part number), or a store's name for a blob (Ollama's)."""
    if path.suffix == ".gguf":
        return path.stem.split("-00001-of-")[0]
    return str(ref).replace("/", "-").replace(":", "-")


def gguf_once(ref, bits: Optional[int] = None, log: Callable[[str], None] = print,
              progress_factory=None) -> Path:
    """The model directory of a GGUF, converted on first use: float32 (bits None), or
    requantized to MLX's affine format at `bits`. Later calls reuse the cached copy."""
    path = gguf_path(ref)
    if path is None:
        raise GGUFError(f"{ref!r} is not a GGUF file, nor a model LM Studio or Ollama keeps")
    root = treegraft_cache() / "converted"
    root.mkdir(parents=True, exist_ok=True)
    key = file_key(path)
    if bits is None:
        out = root / f"{key}--float32" / model_name(ref, path)
        if not (out / "config.json").exists():
            log(f"reading {path.name} once into {out}")
            write_checkpoint(path, out, "float32", log, progress_factory)
        return out
    bundle = root / f"{key}--q{bits}g64"
    if not (bundle / "treegraft.json").exists():
        log(f"converting {path.name} once to {bits}-bit MLX weights, into {bundle}")
        with tempfile.TemporaryDirectory(prefix=".gguf-", dir=root) as tmp:
            float_dir = Path(tmp) / model_name(ref, path)
            write_checkpoint(path, float_dir, "float16", log, progress_factory)
            convert_family(str(float_dir), [], str(bundle), QuantSpec(bits), log=log)
    return bundle / "target"


def write_checkpoint(path: Path, out: Path, dtype: str = "float32",
                     log: Callable[[str], None] = print, progress_factory=None) -> Path:
    """Write the GGUF at `path` as a float checkpoint directory `out` (which must not exist):
    shards of at most 2 GiB, their index, config, generation config and tokenizer."""
    model, readers = read_model(path)
    out = Path(out)
    if out.exists():
        raise GGUFError(f"{out} already exists")
    out.parent.mkdir(parents=True, exist_ok=True)
    with written_beside(out) as tmp:
        tmp.chmod(0o755)
        bar = progress_factory(path.name, len(model.tensors)) if progress_factory else None
        index = _write_shards(model, readers, tmp, DTYPES[dtype], bar)
        if bar is not None:
            bar.render_finish()
        config = {**model.config, "torch_dtype": dtype}
        files = {"config.json": config, "model.safetensors.index.json": index,
                 "generation_config.json": {"eos_token_id": config["eos_token_id"]},
                 "tokenizer.json": model.tokenizer,
                 "tokenizer_config.json": model.tokenizer_config}
        for name, payload in files.items():
            (tmp / name).write_text(json.dumps(payload, indent=1, ensure_ascii=False))
    log(f"wrote {out} ({model.architecture}, {len(model.tensors)} tensors, {dtype})")
    return out


def _write_shards(model, readers, dest: Path, dtype, bar) -> dict:
    """Dequantize tensor by tensor, saving a shard whenever the next tensor would take it past
    2 GiB (so at most one shard is held); returns the shards' index."""
    saved: list[list[str]] = []       # the tensor names of each shard saved
    shard: dict[str, mx.array] = {}
    for t in model.tensors:
        w = mx.array(model.weight(t, readers)).astype(dtype)
        mx.eval(w)
        if shard and sum(a.nbytes for a in shard.values()) + w.nbytes > SHARD_BYTES:
            saved.append(_save(dest, shard, len(saved)))
            shard = {}
        shard[t.name] = w
        if bar is not None:
            bar.update(1)
    saved.append(_save(dest, shard, len(saved)))
    weight_map, total = {}, 0
    for i, names in enumerate(saved):     # the count is known now: the final names
        final = dest / f"model-{i + 1:05d}-of-{len(saved):05d}.safetensors"
        os.replace(dest / f"part-{i:05d}.safetensors", final)
        total += final.stat().st_size
        weight_map.update(dict.fromkeys(names, final.name))
    return {"metadata": {"total_size": total}, "weight_map": weight_map}


def _save(dest: Path, shard: dict, i: int) -> list[str]:
    """Save a shard under a provisional name (the shard count is not known yet)."""
    mx.save_safetensors(str(dest / f"part-{i:05d}.safetensors"), shard)
    return list(shard)
