"""A GGUF file (llama.cpp's format, as LM Studio and Ollama keep models) read as a Hugging
Face-style checkpoint: config, tokenizer and float weights under transformers' names.

The file is read with ggml-org's own `gguf` package, which dequantizes every quant type in
numpy: nothing here parses the format by hand. What llama.cpp's converter changed is undone:
its tensor names and the Q and K rows of `llama` it permutes for its interleaved RoPE. The
tokenizer is rebuilt from the vocabulary and merges in
the metadata with the `tokenizers` library (a byte-level BPE, as every GPT-2-style vocabulary
is), so that `mlx_lm` and transformers load the result as they load any checkpoint.
"""

from __future__ import annotations

import json
import re
from dataclasses import dataclass
from pathlib import Path
from typing import Iterator

import numpy as np

from .errors import LoadError

# GGUF architecture -> transformers model_type. `llama` also carries Mistral 7B's files.
# Gemma 2/3 and Phi-3 are left out: their GGUF vocabularies are SentencePiece ones, which
# tokenizer_files does not rebuild yet, so no real file of theirs could load.
ARCHITECTURES = {"llama": "llama", "qwen2": "qwen2", "qwen3": "qwen3"}
SPLIT = re.compile(r"^(?P<stem>.*)-(?P<index>\d{5})-of-(?P<count>\d{5})\.gguf$")

# Per-layer tensors: llama.cpp's name -> transformers'.
LAYER_NAMES = {
    "attn_norm": "input_layernorm", "ffn_norm": "post_attention_layernorm",
    "attn_q": "self_attn.q_proj", "attn_k": "self_attn.k_proj", "attn_v": "self_attn.v_proj",
    "attn_output": "self_attn.o_proj", "attn_q_norm": "self_attn.q_norm",
    "attn_k_norm": "self_attn.k_norm", "ffn_gate": "mlp.gate_proj", "ffn_up": "mlp.up_proj",
    "ffn_down": "mlp.down_proj",
}
GLOBAL_NAMES = {"token_embd": "model.embed_tokens", "output_norm": "model.norm",
                "output": "lm_head"}

# How each pre-tokenizer named in `tokenizer.ggml.pre` splits text before the byte-level BPE
# (the splits the vocabulary's merges were learned on; the names are llama.cpp's).
GPT2_SPLIT = r"'s|'t|'re|'ve|'m|'ll|'d| ?\p{L}+| ?\p{N}+| ?[^\s\p{L}\p{N}]+|\s+(?!\S)|\s+"
LLAMA3_SPLIT = (r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}{1,3}"
                r"| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+")
QWEN2_SPLIT = (r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}"
               r"| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+")
PRE_TOKENIZERS = {  # name -> (split regex, digits split one by one first)
    "default": (GPT2_SPLIT, False), "gpt-2": (GPT2_SPLIT, False), "gpt2": (GPT2_SPLIT, False),
    "smollm": (GPT2_SPLIT, True),
    "llama3": (LLAMA3_SPLIT, False), "llama-v3": (LLAMA3_SPLIT, False),
    "llama-bpe": (LLAMA3_SPLIT, False), "smaug-bpe": (LLAMA3_SPLIT, False),
    "qwen2": (QWEN2_SPLIT, False), "deepseek-r1-qwen": (QWEN2_SPLIT, False),
}
CONTROL, USER_DEFINED = 3, 4          # llama.cpp's token types


class GGUFError(LoadError):
    """A GGUF file that cannot be read as a model here; the message names what was found."""


@dataclass(frozen=True)
class Tensor:
    """One tensor of the file, still in the file (read with `GGUFModel.weight`)."""
    name: str         # transformers' name
    source: str       # llama.cpp's name
    part: int         # which file of a split set
    quant: str        # the ggml type's name
    shape: tuple      # rows first, as numpy and transformers order them
    nbytes: int


@dataclass(frozen=True)
class GGUFModel:
    """What a GGUF file says: the architecture's config, the tokenizer, and its tensors."""
    files: tuple
    architecture: str
    config: dict
    tokenizer: dict            # tokenizer.json, as the `tokenizers` library writes it
    tokenizer_config: dict
    eos_token_ids: tuple
    tensors: tuple

    def weight(self, t: Tensor, readers) -> np.ndarray:
        """The tensor dequantized to float32, under transformers' layout (Q and K of `llama`
        un-permuted)."""
        from gguf.quants import dequantize

        raw = readers[t.part].tensors[_index(readers[t.part], t.source)]
        try:
            w = np.asarray(dequantize(raw.data, raw.tensor_type), dtype=np.float32)
        except NotImplementedError:
            raise GGUFError(f"{self.files[t.part]}: tensor {t.source} is quantized as {t.quant}, "
                            f"which the gguf package cannot dequantize") from None
        w = w.reshape(t.shape)
        if self.architecture == "llama" and t.source.endswith(("attn_q.weight", "attn_k.weight",
                                                                "attn_q.bias", "attn_k.bias")):
            heads = self.config["num_attention_heads"] if ".attn_q." in t.source \
                else self.config["num_key_value_heads"]
            w = unpermute(w, heads)
        return w


def unpermute(w: np.ndarray, heads: int) -> np.ndarray:
    """Undo llama.cpp's permutation of `llama`'s Q or K rows: within each head it interleaves
    the two rotary halves (row i*d/2 + j goes to 2j + i), which suits its RoPE kernel; MLX and
    transformers rotate the halves as they are."""
    rows = w.shape[0]
    half = rows // heads // 2
    return w.reshape(heads, half, 2, *w.shape[1:]).swapaxes(1, 2).reshape(w.shape)


def split_parts(path: Path) -> list[Path]:
    """A split set's files in order (from any one of them), or the file alone."""
    m = SPLIT.match(path.name)
    if not m:
        return [path]
    count = int(m["count"])
    parts = [path.with_name(f"{m['stem']}-{i:05d}-of-{count:05d}.gguf") for i in range(1, count + 1)]
    missing = [p.name for p in parts if not p.exists()]
    if missing:
        raise GGUFError(f"{path.name} is part of a split GGUF of {count} files; missing: "
                        f"{', '.join(missing)}")
    return parts


def open_readers(parts: list[Path]) -> list:
    """gguf's reader of each file, a truncated or foreign file named as such."""
    from gguf import GGUFReader

    readers = []
    for p in parts:
        with open(p, "rb") as f:
            if f.read(4) != b"GGUF":
                raise GGUFError(f"{p} is not a GGUF file (it does not start with 'GGUF')")
        try:
            reader = GGUFReader(str(p))
        except (ValueError, IndexError, OSError, KeyError) as e:
            raise GGUFError(f"{p}: cannot read the GGUF header ({e}); the file is truncated or "
                            "damaged: download it again") from None
        size = p.stat().st_size
        for t in reader.tensors:
            if t.data_offset + t.n_bytes > size or t.data.nbytes < t.n_bytes:
                raise GGUFError(f"{p} is truncated: tensor {t.name} ends at byte "
                                f"{t.data_offset + t.n_bytes:,}, the file has {size:,}; "
                                "download it again")
        readers.append(reader)
    return readers


def read_model(path: Path) -> tuple[GGUFModel, list]:
    """The model a GGUF file (or a split set, from any of its files) holds, and the open
    readers its tensors are read through. Everything is checked here, before any weight is
    dequantized: the architecture, every tensor's name and quant type, the tokenizer."""
    parts = split_parts(Path(path))
    readers = open_readers(parts)
    meta = metadata(readers[0])
    arch = meta.get("general.architecture")
    if arch not in ARCHITECTURES:
        raise GGUFError(f"{parts[0]}: architecture {arch!r} is not supported; supported: "
                        f"{sorted(ARCHITECTURES)}")
    tensors = tuple(t for i, r in enumerate(readers) for t in _tensors(r, i, arch, parts[i]))
    names = {t.name for t in tensors}
    config = model_config(meta, arch, tensors, "lm_head.weight" not in names)
    tokenizer, tok_config, eos = tokenizer_files(meta, parts[0])
    config["eos_token_id"] = list(eos) if len(eos) > 1 else eos[0]
    return GGUFModel(tuple(parts), arch, config, tokenizer, tok_config, eos, tensors), readers


def metadata(reader) -> dict:
    """The file's key-value metadata as Python values (arrays as lists)."""
    out = {}
    for key, field in reader.fields.items():
        if key.startswith("GGUF."):
            continue
        try:
            out[key] = field.contents()
        except Exception:  # a value type gguf cannot decode: not one this reader needs
            continue
    return out


def _index(reader, name: str) -> int:
    for i, t in enumerate(reader.tensors):
        if t.name == name:
            return i
    raise KeyError(name)


def _tensors(reader, part: int, arch: str, path: Path) -> Iterator[Tensor]:
    from gguf.quants import GGML_QUANT_SIZES

    for t in reader.tensors:
        name = hf_name(t.name, LAYER_NAMES)
        if name is None:
            if t.name in ("rope_freqs.weight",):
                raise GGUFError(f"{path}: it carries RoPE frequency factors ({t.name}), as "
                                "Llama 3.1 files do; their scaling is not supported here yet")
            raise GGUFError(f"{path}: tensor {t.name!r} has no counterpart in the "
                            f"{arch} architecture as supported here")
        if t.tensor_type not in GGML_QUANT_SIZES:
            raise GGUFError(f"{path}: tensor {t.name} has quant type {t.tensor_type.name}, "
                            "which the gguf package does not know")
        shape = tuple(int(d) for d in reversed(t.shape))
        yield Tensor(name, t.name, part, t.tensor_type.name, shape, int(t.n_bytes))


def hf_name(name: str, layer_names: dict) -> str | None:
    """transformers' name of a llama.cpp tensor name, None for one it has no counterpart of."""
    base, _, kind = name.rpartition(".")
    if kind not in ("weight", "bias"):
        return None
    m = re.fullmatch(r"blk\.(\d+)\.(\w+)", base)
    if m:
        mapped = layer_names.get(m[2])
        return f"model.layers.{m[1]}.{mapped}.{kind}" if mapped else None
    mapped = GLOBAL_NAMES.get(base)
    return f"{mapped}.{kind}" if mapped else None


def model_config(meta: dict, arch: str, tensors: tuple, tied: bool) -> dict:
    """config.json's fields from the metadata (under `<arch>.` keys, llama.cpp's names)."""
    def get(key, default=None):
        return meta.get(f"{arch}.{key}", default)

    embed = next(t for t in tensors if t.name == "model.embed_tokens.weight")
    heads = int(get("attention.head_count"))
    config = {
        "model_type": ARCHITECTURES[arch], "architectures": [_class_name(arch)],
        "hidden_size": int(get("embedding_length")),
        "intermediate_size": int(get("feed_forward_length")),
        "num_hidden_layers": int(get("block_count")),
        "num_attention_heads": heads,
        "num_key_value_heads": int(get("attention.head_count_kv", heads)),
        "max_position_embeddings": int(get("context_length", 4096)),
        "rms_norm_eps": float(get("attention.layer_norm_rms_epsilon", 1e-6)),
        "rope_theta": float(get("rope.freq_base", 10000.0)),
        "vocab_size": embed.shape[0], "tie_word_embeddings": tied,
        "torch_dtype": "float32",
    }
    head_dim = get("attention.key_length")
    if head_dim is not None:
        config["head_dim"] = int(head_dim)
    if arch == "qwen2":
        config["attention_bias"] = True
    scaling = get("rope.scaling.type")
    if scaling not in (None, "none"):
        raise GGUFError(f"RoPE scaling {scaling!r} in the metadata is not supported here yet")
    return config


def _class_name(arch: str) -> str:
    return {"llama": "LlamaForCausalLM", "qwen2": "Qwen2ForCausalLM",
            "qwen3": "Qwen3ForCausalLM"}[arch]


def tokenizer_files(meta: dict, path: Path) -> tuple[dict, dict, tuple]:
    """tokenizer.json, tokenizer_config.json and the end-of-sequence ids, from the metadata."""
    kind = meta.get("tokenizer.ggml.model")
    if kind != "gpt2":
        raise GGUFError(f"{path}: tokenizer model {kind!r} is not supported here yet; "
                        "supported: 'gpt2' (byte-level BPE: Llama 3, Qwen, SmolLM and the like)")
    pre = meta.get("tokenizer.ggml.pre", "default")
    if pre not in PRE_TOKENIZERS:
        raise GGUFError(f"{path}: pre-tokenizer {pre!r} is not supported; supported: "
                        f"{sorted(PRE_TOKENIZERS)}")
    tokens = [str(t) for t in meta["tokenizer.ggml.tokens"]]
    types = list(meta.get("tokenizer.ggml.token_type") or [1] * len(tokens))
    merges = [str(m) for m in meta.get("tokenizer.ggml.merges") or []]
    tok = byte_level_bpe(tokens, types, merges, *PRE_TOKENIZERS[pre])

    def token(key):
        i = meta.get(f"tokenizer.ggml.{key}_token_id")
        return tokens[int(i)] if i is not None and 0 <= int(i) < len(tokens) else None

    eos_ids = [int(meta[k]) for k in ("tokenizer.ggml.eos_token_id", "tokenizer.ggml.eot_token_id",
                                      "tokenizer.ggml.eom_token_id") if k in meta]
    add_bos = bool(meta.get("tokenizer.ggml.add_bos_token", False))
    if add_bos and token("bos"):
        from tokenizers import processors

        bos = token("bos")
        tok.post_processor = processors.TemplateProcessing(
            single=f"{bos} $A", pair=f"{bos} $A {bos} $B",
            special_tokens=[(bos, tokens.index(bos))])
    tok_config = {"tokenizer_class": "PreTrainedTokenizerFast", "bos_token": token("bos"),
                  "eos_token": token("eos"), "unk_token": token("unknown"),
                  "pad_token": token("padding"), "add_bos_token": add_bos,
                  "clean_up_tokenization_spaces": False,
                  "model_max_length": int(meta.get(f"{meta.get('general.architecture')}."
                                                   "context_length", 4096))}
    template = meta.get("tokenizer.chat_template")
    if template:
        tok_config["chat_template"] = str(template)
    return json.loads(tok.to_str()), tok_config, tuple(dict.fromkeys(eos_ids))


def byte_level_bpe(tokens: list, types: list, merges: list, split: str, digits: bool):
    """The byte-level BPE tokenizer a GPT-2-style vocabulary describes: text split by the
    pre-tokenizer's regex, each piece's bytes spelled in GPT-2's byte alphabet and merged by
    rank; control tokens matched whole as special, user-defined ones whole as plain text."""
    from tokenizers import AddedToken, Regex, Tokenizer, decoders, models, pre_tokenizers

    vocab = {t: i for i, t in enumerate(tokens)}
    pairs = [tuple(m.split(" ", 1)) for m in merges]
    tok = Tokenizer(models.BPE(vocab=vocab, merges=pairs, fuse_unk=False))
    steps = [pre_tokenizers.Digits(individual_digits=True)] if digits else []
    steps += [pre_tokenizers.Split(Regex(split), behavior="isolated"),
              pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False)]
    tok.pre_tokenizer = pre_tokenizers.Sequence(steps)
    tok.decoder = decoders.ByteLevel()
    tok.add_special_tokens([AddedToken(t, special=True, normalized=False)
                            for t, k in zip(tokens, types) if k == CONTROL])
    tok.add_tokens([AddedToken(t, special=False, normalized=False)
                    for t, k in zip(tokens, types) if k == USER_DEFINED])
    return tok
