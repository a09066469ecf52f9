"""Writes the tiny random checkpoints the parity tests compare against: saved by transformers
itself (its config.json and safetensors, transformers 5 format), with its own logits.

Run once where torch and transformers are installed (not needed by the tests):
    python tests/hf_reference/make_references.py [case ...]
Each case: tests/hf_reference/<name>/{config.json, model.safetensors, logits.npz}.
"""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import numpy as np
import torch
import transformers
from transformers import AutoConfig, AutoModelForCausalLM

HERE = Path(__file__).parent
COMMON = dict(vocab_size=300, hidden_size=64, intermediate_size=96, num_hidden_layers=2,
              num_attention_heads=4, num_key_value_heads=2, head_dim=16,
              max_position_embeddings=512, pad_token_id=2, bos_token_id=0, eos_token_id=1)
HYBRID = dict(linear_num_key_heads=2, linear_num_value_heads=4, linear_key_head_dim=8,
              linear_value_head_dim=12, linear_conv_kernel_dim=4, tie_word_embeddings=False)
CASES = {
    "llama3-rope": dict(model_type="llama", rope_parameters={
        "rope_type": "llama3", "rope_theta": 500000.0, "factor": 8.0, "low_freq_factor": 1.0,
        "high_freq_factor": 4.0, "original_max_position_embeddings": 64}),
    "qwen2-theta": dict(model_type="qwen2", rope_parameters={"rope_type": "default",
                                                             "rope_theta": 1000000.0}),
    "qwen3-linear": dict(model_type="qwen3", rope_parameters={
        "rope_type": "linear", "rope_theta": 1000000.0, "factor": 2.0}),
    "mistral-window": dict(model_type="mistral", sliding_window=8, rope_parameters={
        "rope_type": "linear", "rope_theta": 1000000.0, "factor": 2.0}),
    "phi3-longrope": dict(model_type="phi3", original_max_position_embeddings=24,
                          rope_parameters={
                              "rope_type": "longrope", "rope_theta": 20000.0,
                              "partial_rotary_factor": 0.5,
                              "short_factor": [1.0, 1.1, 1.3, 1.6],
                              "long_factor": [1.0, 2.0, 4.0, 8.0],
                              "original_max_position_embeddings": 24}),
    "gemma2": dict(model_type="gemma2", sliding_window=8, query_pre_attn_scalar=16,
                   attn_logit_softcapping=5.0, final_logit_softcapping=3.0,
                   rope_parameters={"rope_type": "linear", "rope_theta": 50000.0, "factor": 2.0}),
    "gemma3": dict(model_type="gemma3_text", sliding_window=8, query_pre_attn_scalar=16,
                   layer_types=["sliding_attention", "full_attention"],
                   rope_parameters={"sliding_attention": {"rope_type": "default",
                                                          "rope_theta": 10000.0},
                                    "full_attention": {"rope_type": "linear", "factor": 4.0,
                                                       "rope_theta": 1000000.0}}),
    "mixtral": dict(model_type="mixtral", num_local_experts=4, num_experts_per_tok=2,
                    sliding_window=8, rope_parameters={
                        "rope_type": "llama3", "rope_theta": 1000000.0, "factor": 4.0,
                        "low_freq_factor": 1.0, "high_freq_factor": 4.0,
                        "original_max_position_embeddings": 32}),
    "qwen3_moe": dict(model_type="qwen3_moe", num_experts=4, num_experts_per_tok=2,
                      moe_intermediate_size=32, norm_topk_prob=True, mlp_only_layers=[1],
                      rope_parameters={"rope_type": "linear", "rope_theta": 1000000.0,
                                       "factor": 4.0}),
    # Hybrids: 3 Gated DeltaNet layers, then one gated full-attention layer (partial rotary).
    "qwen3_5": dict(model_type="qwen3_5_text", num_hidden_layers=4, **HYBRID, rope_parameters={
        "rope_type": "default", "rope_theta": 1000000.0, "partial_rotary_factor": 0.5}),
    "qwen3_5_moe": dict(model_type="qwen3_5_moe_text", num_hidden_layers=4, **HYBRID,
                        num_experts=4, num_experts_per_tok=2, moe_intermediate_size=32,
                        shared_expert_intermediate_size=48, rope_parameters={
                            "rope_type": "default", "rope_theta": 500000.0,
                            "partial_rotary_factor": 0.25}),
}
INPUTS = {"short": list(range(3, 15)),
          "long": [int(t) for t in np.random.default_rng(0).integers(3, 290, size=40)]}


def randomize(model: torch.nn.Module, gemma: bool) -> None:
    """Weights large enough that a wrong detail shows in the logits."""
    g = torch.Generator().manual_seed(0)
    with torch.no_grad():
        for name, p in model.named_parameters():
            noise = torch.randn(p.shape, generator=g)
            if name.endswith("norm.weight"):
                p.copy_(0.2 * noise if gemma else 1 + 0.2 * noise)
            else:
                p.copy_(0.15 * noise)


def main(names=None) -> None:
    for name, spec in CASES.items():
        if names and name not in names:
            continue
        spec = dict(spec)
        model_type = spec.pop("model_type")
        config = AutoConfig.for_model(model_type, **{**COMMON, **spec})
        config._attn_implementation = "eager"
        model = AutoModelForCausalLM.from_config(config).eval()
        randomize(model, model_type.startswith("gemma"))
        out = HERE / name
        shutil.rmtree(out, ignore_errors=True)
        model.save_pretrained(out)
        logits = {}
        with torch.no_grad():
            for key, ids in INPUTS.items():
                logits[key] = model(torch.tensor([ids])).logits[0].float().numpy()
        np.savez_compressed(out / "logits.npz", **logits,
                            **{f"ids_{k}": np.array(v) for k, v in INPUTS.items()})
        meta = {"transformers": transformers.__version__, "torch": torch.__version__}
        (out / "generated_by.json").write_text(json.dumps(meta))
        print(name, sorted(p.name for p in out.iterdir()))


if __name__ == "__main__":
    import sys

    main(sys.argv[1:])
