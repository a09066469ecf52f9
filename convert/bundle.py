"""Hugging Face checkpoints (or mlx_lm directories) -> one quantized MLX TreeGraft bundle.

Layout written: OUT/target/, OUT/drafters/<name>/, OUT/treegraft.json. Every model directory
is a valid mlx_lm directory (same quantization keys), so `mlx_lm.load` opens it too.

Everything is checked before anything is written, written into a temporary sibling directory
shard by shard (never two full copies of a model in memory) and renamed into place at the end;
a failure or Ctrl-C leaves nothing behind.
"""

from __future__ import annotations

import hashlib
import json
import os
import re
import shutil
import tempfile
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path
from typing import Callable, Iterator, Optional, Sequence

import mlx.core as mx

from ..cache import KVCache
from ..device import available_memory
from ..family import check_same_tokenizer
from ..hub import resolve_path
from ..loading import LoadError, has_tokenizer, read_config, weight_files
from mlx.utils import tree_flatten

from ..models import build_model, legacy_config, model_args
from ..models.moe import EXPERT_TENSOR, stack_experts

DTYPES = {"float16": mx.float16, "bfloat16": mx.bfloat16, "float32": mx.float32}
RECIPES = ("uniform", "mixed-8-embed")  # mixed-8-embed: embeddings and LM head at 8 bits
# Every projection, Gated DeltaNet's input projections and Gemma 4's per-layer-input table
# and projections included (as mlx_lm quantizes them); routers, norms, the convolution and
# the decay parameters stay in full precision.
QUANTIZABLE_SUFFIXES = ("_proj.weight", "embed_tokens.weight", "lm_head.weight",
                        *(f".in_proj_{p}.weight" for p in ("qkv", "z", "a", "b", "qkvz", "ba")),
                        "embed_tokens_per_layer.weight", "per_layer_model_projection.weight",
                        "per_layer_input_gate.weight", "per_layer_projection.weight")
SHARD_BYTES = 2 * 2**30


class ConvertError(ValueError):
    """The inputs cannot be converted; the message says why."""


@dataclass(frozen=True)
class QuantSpec:
    bits: int = 4
    group_size: int = 64
    recipe: str = "uniform"

    def __post_init__(self):
        if self.bits not in (2, 3, 4, 6, 8):
            raise ConvertError(f"q-bits must be one of 2, 3, 4, 6, 8; got {self.bits}")
        if self.group_size not in (32, 64, 128):
            raise ConvertError(f"q-group-size must be 32, 64 or 128; got {self.group_size}")
        if self.recipe not in RECIPES:
            raise ConvertError(f"unknown quant recipe {self.recipe!r}; choose from {RECIPES}")

    def bits_for(self, module: str) -> int:
        if self.recipe == "mixed-8-embed" and module.endswith(("embed_tokens", "lm_head")):
            return 8
        return self.bits


@dataclass
class Source:
    """One input model, checked and ready to convert."""
    role: str            # "target" or the drafter's name
    path: Path
    config: dict
    files: list[Path]
    prequantized: bool   # an mlx_lm directory that is already quantized

    @property
    def out_dir(self) -> Path:
        return Path("target") if self.role == "target" else Path("drafters") / self.role


def _inspect(role: str, path_or_repo: str) -> Source:
    try:
        path = resolve_path(path_or_repo)
        config = read_config(path)
        model_args(config)
        files = weight_files(path)
    except (LoadError, ValueError) as e:
        raise ConvertError(f"{role}: {e}") from None
    except TypeError as e:  # the architecture's arguments: "missing 1 required ... 'hidden_size'"
        fields = ", ".join(re.findall(r"'(\w+)'", str(e))) or str(e)
        raise ConvertError(f"{role}: {path / 'config.json'} lacks required field(s): {fields}") from None
    if "quantization" in config and "bits" not in config["quantization"]:
        raise ConvertError(f"{role}: unsupported quantization config {config['quantization']}")
    return Source(role, path, config, files, "quantization" in config)


def _check_weights_match_config(src: Source) -> None:
    """Every weight the config implies is there with its shape, from headers only (per-expert
    tensors counted as stacked; shapes of an already quantized source are packed, so only
    names are checked there)."""
    args = model_args(src.config)
    model = build_model(args)
    expected = dict(tree_flatten(model.parameters()))
    if args.tie_word_embeddings:
        expected.pop("lm_head.weight", None)
    seen: dict = {}
    for f in src.files:
        seen.update(_header(f))
    seen = model.checkpoint_names(
        seen, halves=lambda shape: ([*shape[:-2], shape[-2] // 2, shape[-1]],) * 2)
    if args.experts:
        seen = stack_experts(seen, args.experts, stack=lambda shapes: [len(shapes), *shapes[0]])
        partial = _incomplete_experts(seen, args.experts)
        if partial:
            raise ConvertError(f"{src.role}: experts missing from {src.path}: "
                               f"{'; '.join(partial[:4])}{'...' if len(partial) > 4 else ''}")
    missing = sorted(set(expected) - set(seen))
    if missing:
        raise ConvertError(f"{src.role}: weights {missing[:4]}{'...' if len(missing) > 4 else ''} "
                           f"are missing from {src.path}")
    for name, param in expected.items():
        if not src.prequantized and tuple(seen[name]) != tuple(param.shape):
            raise ConvertError(f"{src.role}: {name} has shape {tuple(seen[name])} but config.json "
                               f"implies {tuple(param.shape)}")


def _incomplete_experts(names, experts: int) -> list[str]:
    """Per-expert tensors left unstacked (a group short of `experts`), named as the checkpoint
    names them: 'model.layers.1.mlp.experts.<e>.w3.weight lacks experts [2] of 4'."""
    have: dict[str, set[int]] = {}
    for name in names:
        m = EXPERT_TENSOR.match(name)
        if m:
            prefix, e, proj, kind = m.groups()
            have.setdefault(f"{prefix}.experts.<e>.{proj}.{kind}", set()).add(int(e))
    return [f"{group} lacks experts {sorted(set(range(experts)) - got)} of {experts}"
            for group, got in sorted(have.items())]


def _header(file: Path) -> dict[str, list[int]]:
    """Tensor shapes from a safetensors header, without reading any tensor data."""
    try:
        with open(file, "rb") as f:
            n = int.from_bytes(f.read(8), "little")
            if not 0 < n < 100 * 2**20:
                raise ValueError("bad header length")
            header = json.loads(f.read(n))
    except (OSError, ValueError) as e:
        raise ConvertError(f"cannot read {file}: corrupt or truncated safetensors ({e})") from None
    return {k: v["shape"] for k, v in header.items() if k != "__metadata__"}


def _tokenizer_hash(path: Path) -> str:
    h = hashlib.sha256()
    for name in ("tokenizer.json", "tokenizer.model", "tokenizer_config.json"):
        if (path / name).exists():
            h.update((path / name).read_bytes())
    return h.hexdigest()


def _check_family(sources: list[Source]) -> None:
    from ..loading import load_tokenizer

    if not any((sources[0].path / n).exists() for n in ("tokenizer.json", "tokenizer.model")):
        raise ConvertError(f"target: no tokenizer files in {sources[0].path}")
    target_tok = load_tokenizer(sources[0].path, sources[0].config)
    for s in sources[1:]:
        if not has_tokenizer(s.path):          # a Gemma 4 assistant uses its target's
            continue
        try:
            check_same_tokenizer(target_tok, load_tokenizer(s.path, s.config), "target", s.role)
        except LoadError as e:
            raise ConvertError(str(e)) from None


def _convert_tensors(src: Source, dest: Path, quant: Optional[QuantSpec], dtype: Optional[mx.Dtype],
                     progress: Callable[[int], None]) -> tuple[dict, int]:
    """Stream shard by shard: load, cast, quantize, save. Returns (quantization config, bytes)."""
    qconfig: dict = {}
    if quant:
        qconfig = {"group_size": quant.group_size, "bits": quant.bits}
    tie = src.config.get("tie_word_embeddings", False)
    args = model_args(src.config)
    model = build_model(args)
    experts, keep = args.experts, model.FULL_PRECISION
    written, index, shard_id = 0, {}, 0
    carried: dict[str, mx.array] = {}  # experts whose group another shard completes
    for f in src.files:
        # Names as the model reads them, but fused projections stay fused: mlx_lm reads them so.
        tensors = {**carried, **model.checkpoint_names(mx.load(str(f)), unfuse=False)}
        if experts:
            tensors = stack_experts(tensors, experts)
            carried = {k: v for k, v in tensors.items() if EXPERT_TENSOR.match(k)}
            tensors = {k: v for k, v in tensors.items() if k not in carried}
        out: dict[str, mx.array] = {}
        for name, w in tensors.items():
            if "rotary_emb.inv_freq" in name or (tie and name == "lm_head.weight"):
                continue
            if dtype is not None and mx.issubdtype(w.dtype, mx.floating) and not name.endswith(keep):
                w = w.astype(dtype)
            module = name.rsplit(".", 1)[0]
            if (quant and name.endswith(QUANTIZABLE_SUFFIXES) and w.ndim in (2, 3)
                    and w.shape[-1] % quant.group_size == 0):  # 3-D: stacked experts
                bits = quant.bits_for(module)
                wq, scales, biases = mx.quantize(w, group_size=quant.group_size, bits=bits)
                out[name], out[f"{module}.scales"], out[f"{module}.biases"] = wq, scales, biases
                if bits != quant.bits:
                    qconfig[module] = {"group_size": quant.group_size, "bits": bits}
            else:
                out[name] = w
        mx.eval(out)
        shard_id += 1
        fname = f"model-{shard_id:05d}-of-{len(src.files):05d}.safetensors"
        mx.save_safetensors(str(dest / fname), out, metadata={"format": "mlx"})
        written += sum(a.nbytes for a in out.values())
        index.update({k: fname for k in out})
        del tensors, out
        progress(1)
    if carried:
        raise ConvertError(f"{src.role}: experts missing for {sorted(carried)[:3]}")
    (dest / "model.safetensors.index.json").write_text(
        json.dumps({"metadata": {"total_size": written}, "weight_map": index}, indent=1))
    return qconfig, written


def _copy_side_files(src: Path, dest: Path) -> None:
    """Tokenizer, generation config, chat template: everything but weights and config."""
    for f in src.iterdir():
        if f.is_file() and not f.name.endswith(".safetensors") and f.name not in (
                "config.json", "model.safetensors.index.json"):
            shutil.copy2(f, dest / f.name)


@contextmanager
def written_beside(out: Path) -> Iterator[Path]:
    """A new directory beside `out`, renamed to `out` when the block ends and removed when it
    fails or is interrupted: nothing half-written is ever left at or beside `out`."""
    try:
        tmp = Path(tempfile.mkdtemp(prefix=f".{out.name}.tmp-", dir=out.parent))
    except OSError as e:
        raise ConvertError(f"cannot write to {out.parent}: {e.strerror}") from None
    try:
        yield tmp
        os.replace(tmp, out)
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise


def convert_family(target: str, drafters: Sequence[str], out: str, quant: Optional[QuantSpec] = None,
                   dtype: Optional[str] = None, context: int = 4096,
                   progress_factory: Optional[Callable[[str, int], object]] = None,
                   log: Callable[[str], None] = print) -> Path:
    """Convert a target and its drafters into one bundle at `out`; returns its path."""
    out_path = Path(out).expanduser().resolve()
    if out_path.exists():
        raise ConvertError(f"{out_path} already exists; choose another --mlx-path or remove it")
    parent = out_path.parent
    if not parent.is_dir():
        raise ConvertError(f"cannot write to {parent}: it is not an existing directory")
    if dtype is not None and dtype not in DTYPES:
        raise ConvertError(f"--dtype must be one of {sorted(DTYPES)}")
    names = [Path(str(d).rstrip("/")).name for d in drafters]
    if len(set(names)) != len(names):
        raise ConvertError(f"drafter names must be distinct: {names}")
    sources = [_inspect("target", target)] + [_inspect(n, d) for n, d in zip(names, drafters)]
    for s in sources:
        _check_weights_match_config(s)
    _check_family(sources)

    before = sum(f.stat().st_size for s in sources for f in s.files)
    with written_beside(out_path) as tmp:
        total_after, manifest_models = 0, {}
        for s in sources:
            dest = tmp / s.out_dir
            dest.mkdir(parents=True)
            bar = progress_factory(s.role, len(s.files)) if progress_factory else None
            step = (lambda n: bar.update(n)) if bar is not None else (lambda n: None)
            config = legacy_config(s.config)  # both RoPE forms: every reader sees one model
            if s.prequantized:
                if quant:
                    log(f"{s.role}: already quantized by mlx_lm; re-bundled without requantising")
                for f in s.files:
                    shutil.copy2(f, dest / f.name)
                    step(1)
                if (s.path / "model.safetensors.index.json").exists():
                    shutil.copy2(s.path / "model.safetensors.index.json", dest)
                written = sum(f.stat().st_size for f in s.files)
            else:
                qconfig, written = _convert_tensors(s, dest, quant, DTYPES.get(dtype), step)
                if quant:
                    config["quantization"] = qconfig
                    config["quantization_config"] = qconfig
                if dtype:
                    config["torch_dtype"] = dtype
            if bar is not None:
                bar.render_finish()
            (dest / "config.json").write_text(json.dumps(config, indent=2))
            _copy_side_files(s.path, dest)
            total_after += written
            manifest_models[s.role] = {"path": str(s.out_dir), "bytes": written,
                                       "quantization": config.get("quantization")}
        args = model_args(sources[0].config)
        kv = (args.kv_bytes(context, DTYPES.get(dtype or "float16")) if hasattr(args, "kv_bytes")
              else KVCache.bytes_for(args.num_hidden_layers, args.num_key_value_heads,
                                     args.head_dim, context, DTYPES.get(dtype or "float16")))
        need, have = total_after + kv, available_memory()
        log(f"memory estimate: weights {total_after / 2**20:.1f} MiB + KV cache for {context} "
            f"tokens {kv / 2**20:.1f} MiB = {need / 2**20:.1f} MiB (available {have / 2**20:.0f} MiB)")
        if need > have:
            log("WARNING: the bundle needs more memory than this machine has available")
        manifest = {
            "format_version": 1,
            "target": "target",
            "drafters": {n: f"drafters/{n}" for n in names},
            "roles": {"target": "target", "strong": names[-1] if names else None, "weak": "ngram"},
            "tokenizer_sha256": _tokenizer_hash(sources[0].path),
            "vocab_size": args.vocab_size,
            "quantization": ({"bits": quant.bits, "group_size": quant.group_size,
                              "recipe": quant.recipe} if quant else None),
            "models": manifest_models,
        }
        (tmp / "treegraft.json").write_text(json.dumps(manifest, indent=2))
    log(f"wrote {out_path}: {before / 2**20:.1f} MiB -> {total_after / 2**20:.1f} MiB")
    return out_path
