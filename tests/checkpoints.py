"""Small random Hugging Face checkpoints of every supported architecture, built on the fly."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Optional

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


FIXTURE_TOKENIZER = ("tokenizer.json", "tokenizer_config.json", "special_tokens_map.json")


def copy_fixture_tokenizer(dest: Path) -> int:
    """The bundled tg-tiny tokenizer's files beside a checkpoint; returns its vocabulary size."""
    import shutil

    from treegraft_mlx import fixture_path

    src = fixture_path() / "target"
    dest.mkdir(parents=True, exist_ok=True)
    for name in FIXTURE_TOKENIZER:
        shutil.copy(src / name, dest / name)
    return len(json.loads((src / "tokenizer.json").read_text())["model"]["vocab"])


def default_layer_types(layers: int) -> list[str]:
    """What transformers' Qwen3_5TextConfig writes for `layers` layers by default: full
    attention every 4th layer, Gated DeltaNet elsewhere (2 layers: no full attention at all)."""
    return ["full_attention" if (i + 1) % 4 == 0 else "linear_attention" for i in range(layers)]


def make_hybrid(dest: Path, layers: int, *, hidden: int = 96, inter: int = 192, seed: int = 0,
                damp_from: Optional[int] = None) -> Path:
    """A random dense Qwen 3.5 text checkpoint (`qwen3_5_text` with transformers' default
    layer types, its names and shapes, norms stored around 1) with the bundled tokenizer.
    Layers from `damp_from` on write 1/20 of what they would into the residual stream, so a
    drafter of the layers before them guesses the target's next token often, not always."""
    layer_types = default_layer_types(layers)
    vocab = copy_fixture_tokenizer(dest)
    rng = np.random.default_rng(seed)
    heads, kv_heads, head_dim, kernel = 4, 2, 16, 4
    k_heads, v_heads, dk, dv = 2, 4, 8, 12
    conv_dim, value_dim = 2 * k_heads * dk + v_heads * dv, v_heads * dv

    def w(*shape, scale=0.15, centre=0.0):
        return (centre + scale * rng.standard_normal(shape)).astype(np.float32)

    t = {"model.embed_tokens.weight": w(vocab, hidden), "lm_head.weight": w(vocab, hidden),
         "model.norm.weight": w(hidden, scale=0.2, centre=1.0)}
    for i, kind in enumerate(layer_types):
        p, out = f"model.layers.{i}.", 0.15 if damp_from is None or i < damp_from else 0.0075
        if kind == "linear_attention":
            a = p + "linear_attn."
            t |= {a + "A_log": w(v_heads, scale=0.05, centre=-0.1), a + "dt_bias": w(v_heads),
                  a + "conv1d.weight": w(conv_dim, 1, kernel),
                  a + "in_proj_a.weight": w(v_heads, hidden),
                  a + "in_proj_b.weight": w(v_heads, hidden),
                  a + "in_proj_qkv.weight": w(conv_dim, hidden),
                  a + "in_proj_z.weight": w(value_dim, hidden),
                  a + "norm.weight": w(dv, scale=0.2, centre=1.0),
                  a + "out_proj.weight": w(hidden, value_dim, scale=out)}
        else:
            a = p + "self_attn."
            t |= {a + "q_proj.weight": w(2 * heads * head_dim, hidden),    # query and gate
                  a + "k_proj.weight": w(kv_heads * head_dim, hidden),
                  a + "v_proj.weight": w(kv_heads * head_dim, hidden),
                  a + "o_proj.weight": w(hidden, heads * head_dim, scale=out),
                  a + "q_norm.weight": w(head_dim, scale=0.2, centre=1.0),
                  a + "k_norm.weight": w(head_dim, scale=0.2, centre=1.0)}
        t |= {p + "mlp.gate_proj.weight": w(inter, hidden),
              p + "mlp.up_proj.weight": w(inter, hidden),
              p + "mlp.down_proj.weight": w(hidden, inter, scale=out),
              p + "input_layernorm.weight": w(hidden, scale=0.2, centre=1.0),
              p + "post_attention_layernorm.weight": w(hidden, scale=0.2, centre=1.0)}
    save_file(t, str(dest / "model.safetensors"))
    config = {"architectures": ["Qwen3_5ForCausalLM"], "model_type": "qwen3_5_text",
              "hidden_size": hidden, "intermediate_size": inter, "hidden_act": "silu",
              "num_hidden_layers": layers, "layer_types": layer_types,
              "num_attention_heads": heads, "num_key_value_heads": kv_heads,
              "head_dim": head_dim, "linear_conv_kernel_dim": kernel,
              "linear_num_key_heads": k_heads, "linear_num_value_heads": v_heads,
              "linear_key_head_dim": dk, "linear_value_head_dim": dv, "vocab_size": vocab,
              "max_position_embeddings": 2048, "rms_norm_eps": 1e-6,
              "rope_parameters": {"rope_type": "default", "rope_theta": 1000000.0,
                                  "partial_rotary_factor": 0.5},
              "tie_word_embeddings": False, "attention_bias": False, "bos_token_id": 0,
              "eos_token_id": 1, "pad_token_id": 2, "dtype": "float32"}
    (dest / "config.json").write_text(json.dumps(config, indent=2))
    return dest


def make_hybrid_pair(root: Path) -> tuple[Path, Path]:
    """A Qwen 3.5 target of 6 layers and its drafter of 2 (both in transformers' default
    layer types: the drafter has no full-attention layer), the drafter's weights the target's
    own first layers, embedding, norm and head (the target's later layers damped)."""
    from safetensors.numpy import load_file

    target = make_hybrid(root / "target", 6, damp_from=2)
    drafter = root / "drafter"
    copy_fixture_tokenizer(drafter)
    weights = {k: v for k, v in load_file(target / "model.safetensors").items()
               if not k.startswith("model.layers.") or int(k.split(".")[2]) < 2}
    save_file(weights, str(drafter / "model.safetensors"))
    config = json.loads((target / "config.json").read_text())
    config.update(num_hidden_layers=2, layer_types=default_layer_types(2))
    (drafter / "config.json").write_text(json.dumps(config, indent=2))
    return target, drafter
