"""Load a checkpoint (Hugging Face or mlx_lm-converted, quantized or not) into `models.Model`.

Errors name the file and the problem: a user with a broken download should read what is wrong,
not a traceback from inside MLX.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Optional, Union

import mlx.core as mx
import mlx.nn as nn
from mlx.utils import tree_flatten

from . import device
from .cache import KVCache
from .errors import LoadError
from .hub import resolve_path
from .models import Model, ModelArgs, build_model, model_args


def read_config(path: Path) -> dict:
    file = path / "config.json"
    if not file.exists():
        raise LoadError(f"{path} has no config.json")
    try:
        config = json.loads(file.read_text())
    except json.JSONDecodeError as e:
        raise LoadError(f"{file} is not valid JSON: {e}") from None
    gen = path / "generation_config.json"
    if gen.exists():
        try:
            eos = json.loads(gen.read_text()).get("eos_token_id")
        except json.JSONDecodeError:
            eos = None
        if eos is not None:
            config["eos_token_id"] = eos
    return config


def weight_files(path: Path) -> list[Path]:
    """The safetensors files of a checkpoint: the shards its index names, or model*.safetensors."""
    index = path / "model.safetensors.index.json"
    if index.exists():
        shards = sorted(set(json.loads(index.read_text())["weight_map"].values()))
        missing = [s for s in shards if not (path / s).exists()]
        if missing:
            raise LoadError(f"{path}: shards named in {index.name} are missing: {missing}")
        return [path / s for s in shards]
    files = sorted(path.glob("model*.safetensors"))
    if not files:
        raise LoadError(f"no model*.safetensors in {path}")
    return files


def read_weights(files: list[Path]) -> dict[str, mx.array]:
    """Memory-mapped, lazily read weights of all shards."""
    weights: dict[str, mx.array] = {}
    for f in files:
        try:
            weights.update(mx.load(str(f)))
        except (RuntimeError, ValueError, OSError) as e:
            raise LoadError(f"cannot read {f}: corrupt or truncated safetensors ({e})") from None
    return weights


def _sanitize(weights: dict[str, mx.array], args: ModelArgs) -> dict[str, mx.array]:
    weights = {k: v for k, v in weights.items() if "rotary_emb.inv_freq" not in k}
    if "lm_head.weight" not in weights:
        args.tie_word_embeddings = True  # no separate head saved: the embedding is the head
    elif args.tie_word_embeddings:
        weights.pop("lm_head.weight")
    return weights


def _quantize(model: Model, config: dict, weights: dict[str, mx.array]) -> Optional[dict]:
    """Turn Linear/Embedding layers into quantized ones where the checkpoint is quantized."""
    q = config.get("quantization") or config.get("quantization_config")
    if not q or "bits" not in q:
        return None

    overrides = {k: v for k, v in q.items() if isinstance(v, (dict, bool))}

    def predicate(p: str, m: nn.Module):
        # A per-layer override, mlx_lm style, named as here or under a wrapper's prefix
        # (mlx_lm keeps a Qwen 3.5 text model under `language_model.`).
        for name in (p, f"language_model.{p}"):
            if name in overrides:
                return overrides[name]
        return hasattr(m, "to_quantized") and f"{p}.scales" in weights

    nn.quantize(model, group_size=q["group_size"], bits=q["bits"],
                mode=q.get("mode", "affine"), class_predicate=predicate)
    return q


def _check_weights(model: Model, weights: dict[str, mx.array], where: Path, stage=None) -> None:
    expected = dict(tree_flatten(model.parameters()))
    if stage is not None:  # a pipeline stage holds only some of the non-layer weights
        tied = model.args.tie_word_embeddings
        expected = {k: v for k, v in expected.items()
                    if k.startswith("model.layers.") or stage.keeps(k, tied)}
    missing = sorted(set(expected) - set(weights))
    unexpected = sorted(set(weights) - set(expected))
    if missing or unexpected:
        raise LoadError(
            f"{where}: weights do not match config.json "
            f"(missing {missing[:5]}{'...' if len(missing) > 5 else ''}, "
            f"unexpected {unexpected[:5]}{'...' if len(unexpected) > 5 else ''})")
    for name, w in weights.items():
        if tuple(w.shape) != tuple(expected[name].shape):
            raise LoadError(f"{where}: {name} has shape {tuple(w.shape)} but config.json implies "
                            f"{tuple(expected[name].shape)}")


def estimate_bytes(args: ModelArgs, weight_bytes: int, context: int, dtype: mx.Dtype,
                   layers: Optional[int] = None) -> int:
    """Weights (as they will sit in memory) plus a KV cache of `context` tokens for `layers`
    (default: all of the model's); a model whose layers differ in K/V shape, or hold none,
    counts its own (`args.kv_bytes`)."""
    if hasattr(args, "kv_bytes"):
        return weight_bytes + args.kv_bytes(context, dtype, layers)
    return weight_bytes + KVCache.bytes_for(layers or args.num_hidden_layers,
                                            args.num_key_value_heads, args.head_dim, context, dtype)


def load_model(path_or_repo: Union[str, Path], dtype: Optional[mx.Dtype] = None,
               context: Optional[int] = None, lazy: bool = False, stage=None,
               revision: Optional[str] = None):
    """Load a model and its tokenizer: `model, tokenizer = load_model(path)`.

    dtype: compute dtype (default: fp32 on CPU, the checkpoint's dtype on a GPU). context: the
    longest context to plan memory for (default: the model's limit); loading is refused with a
    clear message when weights plus KV cache would not fit in memory. stage: a
    `pipeline.Stage`: only its layers (and embedding / head) are read and held. A repo id is
    downloaded on first use (hub.py); revision pins its commit.
    """
    path = resolve_path(path_or_repo, revision)
    config = read_config(path)
    try:
        args = model_args(config)
    except ValueError as e:
        raise LoadError(f"{path / 'config.json'}: {e}") from None
    except TypeError as e:
        raise LoadError(f"{path / 'config.json'} lacks a required field: {e}") from None
    model = build_model(args)
    weights = _sanitize(model.sanitize(read_weights(weight_files(path))), args)
    if stage is not None:
        stage.apply(model)
        weights = {stage.local_name(k): v for k, v in weights.items()
                   if stage.keeps(k, args.tie_word_embeddings)}
    quant = _quantize(model, config, weights)
    _check_weights(model, weights, path, stage)

    float_dtypes = [w.dtype for w in weights.values() if mx.issubdtype(w.dtype, mx.floating)]
    target = device.compute_dtype(float_dtypes[0] if float_dtypes else mx.float32, dtype)
    weights = {k: (v.astype(target) if mx.issubdtype(v.dtype, mx.floating)
                   and not k.endswith(model.FULL_PRECISION) else v) for k, v in weights.items()}
    weight_bytes = sum(w.nbytes for w in weights.values())
    need = estimate_bytes(args, weight_bytes, context or args.max_position_embeddings, target,
                          len(model.model.layers))
    have = device.available_memory()
    if need > have:
        raise MemoryError(
            f"{path}: needs about {need / 2**30:.2f} GiB (weights {weight_bytes / 2**30:.2f} GiB "
            f"+ KV cache for {context or args.max_position_embeddings} tokens) but only "
            f"{have / 2**30:.2f} GiB is available; pass a shorter context or a quantized model")
    model.load_weights(list(weights.items()), strict=stage is None)
    model.quantization = quant
    if not lazy:
        mx.eval(list(weights.values()) if stage is not None else model.parameters())
    model.eval()
    if getattr(model, "ASSISTANT", False) and not has_tokenizer(path):
        return model, None                   # an assistant drafter reads its target's
    return model, load_tokenizer(path, config)


def has_tokenizer(path: Path) -> bool:
    return (path / "tokenizer.json").exists() or (path / "tokenizer_config.json").exists()


def load_tokenizer(path: Path, config: Optional[dict] = None):
    """mlx_lm's TokenizerWrapper (streaming detokenizer, chat template, eos ids)."""
    from mlx_lm.tokenizer_utils import load as load_tok

    if not has_tokenizer(path):
        raise LoadError(f"{path} has no tokenizer files (tokenizer.json / tokenizer_config.json)")
    eos = (config or {}).get("eos_token_id")
    eos_ids = eos if isinstance(eos, list) else ([eos] if eos is not None else None)
    return load_tok(path, eos_token_ids=eos_ids)
