"""Small random Hugging Face checkpoints of every supported architecture, built on the fly."""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
from safetensors.numpy import save_file

SPECIAL = ["<|bos|>", "<|eos|>", "<|pad|>"]
TEXT = ["def add(a, b):\n    return a + b\n", "class Foo:\n    pass\n",
        "for i in range(10):\n    print(i)\n", "import os\nimport sys\n"] * 4


def write_tokenizer(dest: Path, vocab_size: int = 300) -> int:
    """A byte-level BPE tokenizer in Hugging Face format; returns its vocabulary size."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(vocab_size=vocab_size, special_tokens=SPECIAL,
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
                                  show_progress=False)
    tok.train_from_iterator(TEXT, trainer=trainer)
    dest.mkdir(parents=True, exist_ok=True)
    tok.save(str(dest / "tokenizer.json"))
    (dest / "tokenizer_config.json").write_text(json.dumps({
        "tokenizer_class": "PreTrainedTokenizerFast", "bos_token": "<|bos|>",
        "eos_token": "<|eos|>", "pad_token": "<|pad|>"}))
    return tok.get_vocab_size()


def make_checkpoint(dest: Path, model_type: str = "llama", *, hidden: int = 64, layers: int = 2,
                    heads: int = 4, kv_heads: int = 2, inter: int = 128, tied: bool = True,
                    shards: int = 1, dtype=np.float32, seed: int = 0,
                    rope_scaling: dict | None = None) -> Path:
    """Write config.json, random safetensors (optionally sharded with an index) and a tokenizer."""
    vocab = write_tokenizer(dest)
    rng = np.random.default_rng(seed)
    head_dim = hidden // heads
    bias = model_type == "qwen2"

    def w(*shape):
        return (rng.standard_normal(shape) * 0.05).astype(dtype)

    t = {"model.embed_tokens.weight": w(vocab, hidden), "model.norm.weight": 1 + w(hidden)}
    for i in range(layers):
        p = f"model.layers.{i}."
        t[p + "self_attn.q_proj.weight"] = w(heads * head_dim, hidden)
        t[p + "self_attn.k_proj.weight"] = w(kv_heads * head_dim, hidden)
        t[p + "self_attn.v_proj.weight"] = w(kv_heads * head_dim, hidden)
        t[p + "self_attn.o_proj.weight"] = w(hidden, heads * head_dim)
        if bias:
            for n, d in (("q", heads), ("k", kv_heads), ("v", kv_heads)):
                t[p + f"self_attn.{n}_proj.bias"] = w(d * head_dim)
        if model_type == "qwen3":
            t[p + "self_attn.q_norm.weight"] = 1 + w(head_dim)
            t[p + "self_attn.k_norm.weight"] = 1 + w(head_dim)
        t[p + "mlp.gate_proj.weight"] = w(inter, hidden)
        t[p + "mlp.up_proj.weight"] = w(inter, hidden)
        t[p + "mlp.down_proj.weight"] = w(hidden, inter)
        t[p + "input_layernorm.weight"] = 1 + w(hidden)
        t[p + "post_attention_layernorm.weight"] = 1 + w(hidden)
    if not tied:
        t["lm_head.weight"] = w(vocab, hidden)
    names = sorted(t)
    if shards == 1:
        save_file(t, str(dest / "model.safetensors"))
    else:
        weight_map = {}
        for s in range(shards):
            fname = f"model-{s + 1:05d}-of-{shards:05d}.safetensors"
            part = names[s::shards]
            save_file({n: t[n] for n in part}, str(dest / fname))
            weight_map.update({n: fname for n in part})
        (dest / "model.safetensors.index.json").write_text(
            json.dumps({"metadata": {}, "weight_map": weight_map}))
    arch = {"llama": "LlamaForCausalLM", "mistral": "MistralForCausalLM",
            "qwen2": "Qwen2ForCausalLM", "qwen3": "Qwen3ForCausalLM"}[model_type]
    config = {"architectures": [arch], "model_type": model_type, "hidden_size": hidden,
              "num_hidden_layers": layers, "num_attention_heads": heads,
              "num_key_value_heads": kv_heads, "intermediate_size": inter, "vocab_size": vocab,
              "rms_norm_eps": 1e-6, "rope_theta": 10000.0, "max_position_embeddings": 512,
              "tie_word_embeddings": tied, "head_dim": head_dim, "eos_token_id": 1,
              "bos_token_id": 0}
    if rope_scaling:
        config["rope_scaling"] = rope_scaling
    (dest / "config.json").write_text(json.dumps(config))
    return dest
