"""Writes the tiny random Gemma 4 checkpoints the Gemma 4 tests compare against, saved by
transformers itself (eager attention, fp32), with its own logits; and a tiny assistant
drafter with the logits transformers' SinglePositionMultiTokenCandidateGenerator drafts with.

Run once where torch and transformers (5.24 or later) are installed (the tests need neither):
    python tests/hf_reference/gemma4/make_gemma4_references.py [case ...]
Each case: tests/hf_reference/gemma4/<name>/{config.json, model.safetensors, logits.npz}.
"""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import numpy as np
import torch
import transformers
from transformers import (AutoModelForCausalLM, Gemma4AssistantConfig, Gemma4AssistantForCausalLM,
                          Gemma4Config, Gemma4ForConditionalGeneration, Gemma4TextConfig,
                          GenerationConfig)
from transformers.generation.candidate_generator import SinglePositionMultiTokenCandidateGenerator

HERE = Path(__file__).parent
S, F = "sliding_attention", "full_attention"
COMMON = dict(vocab_size=300, hidden_size=32, intermediate_size=48, num_attention_heads=4,
              num_key_value_heads=2, head_dim=8, global_head_dim=16, sliding_window=8,
              max_position_embeddings=512, pad_token_id=2, bos_token_id=0, eos_token_id=1,
              hidden_size_per_layer_input=0, vocab_size_per_layer_input=0,
              final_logit_softcapping=5.0)
ROPE = {S: {"rope_type": "default", "rope_theta": 10000.0},
        F: {"rope_type": "proportional", "partial_rotary_factor": 0.25, "factor": 2.0,
            "rope_theta": 1000000.0}}
CASES = {
    # global head dim, proportional RoPE, soft-cap, layer scalars
    "dense": dict(num_hidden_layers=4, layer_types=[S, F, S, F], rope_parameters=ROPE),
    # full layers without v_proj, one global KV head
    "k_eq_v": dict(num_hidden_layers=4, layer_types=[S, S, F, F], attention_k_eq_v=True,
                   num_global_key_value_heads=1, rope_parameters=ROPE),
    # dense MLP and routed experts side by side
    "moe": dict(num_hidden_layers=3, layer_types=[S, S, F], enable_moe_block=True,
                num_experts=4, top_k_experts=2, moe_intermediate_size=16, rope_parameters=ROPE),
    # the small sizes: KV sharing, double-wide MLP on the shared layers, per-layer inputs
    "shared_ple": dict(num_hidden_layers=5, layer_types=[S, F, S, S, F], num_kv_shared_layers=2,
                       use_double_wide_mlp=True, hidden_size_per_layer_input=4,
                       vocab_size_per_layer_input=300, rope_parameters=ROPE),
}
MULTIMODAL = "multimodal"          # the `gemma4` wrapper around the shared_ple text model
ASSISTANT = "assistant"            # drafts for shared_ple
INPUTS = {"short": list(range(3, 15)),
          "long": [int(t) for t in np.random.default_rng(0).integers(3, 290, size=40)]}
DRAFTS = 4


def randomize(model: torch.nn.Module) -> None:
    """Weights large enough that a wrong detail shows in the logits; scales near 1."""
    g = torch.Generator().manual_seed(0)
    with torch.no_grad():
        for name, p in model.named_parameters():
            noise = torch.randn(p.shape, generator=g)
            if name.endswith(("norm.weight", "router.scale", "per_expert_scale")):
                p.copy_(1 + 0.2 * noise)
            else:
                p.copy_(0.15 * noise)
        for name, b in model.named_buffers():
            if name.endswith("layer_scalar"):
                b.copy_(0.7 + 0.6 * torch.rand(b.shape, generator=g))


def text_config(spec: dict) -> Gemma4TextConfig:
    return Gemma4TextConfig(**{**COMMON, **spec})


def save(model, out: Path, logits: dict) -> None:
    shutil.rmtree(out, ignore_errors=True)
    model.save_pretrained(out)
    np.savez_compressed(out / "logits.npz", **logits,
                        **{f"ids_{k}": np.array(v) for k, v in INPUTS.items()})
    meta = {"transformers": transformers.__version__, "torch": torch.__version__}
    (out / "generated_by.json").write_text(json.dumps(meta))
    print(out.name, sorted(p.name for p in out.iterdir()))


def all_logits(model) -> dict:
    with torch.no_grad():
        return {k: model(torch.tensor([ids])).logits[0].float().numpy()
                for k, ids in INPUTS.items()}


def text_case(name: str):
    config = text_config(CASES[name])
    config._attn_implementation = "eager"
    model = AutoModelForCausalLM.from_config(config).eval()
    randomize(model)
    save(model, HERE / name, all_logits(model))
    return model


def multimodal_case():
    vision = dict(hidden_size=16, intermediate_size=32, num_hidden_layers=1,
                  num_attention_heads=2, num_key_value_heads=2, head_dim=8, patch_size=4,
                  position_embedding_size=64)
    config = Gemma4Config(text_config={**COMMON, **CASES["shared_ple"]}, vision_config=vision,
                          audio_config=None)
    config._attn_implementation = "eager"
    config.text_config._attn_implementation = "eager"
    model = Gemma4ForConditionalGeneration(config).eval()
    randomize(model)
    save(model, HERE / MULTIMODAL, all_logits(model))


def assistant_case(target) -> None:
    """An assistant for `target` (its store layers' head dims and KV heads), with ordered
    embeddings (30 tokens per centroid, 3 of 10 centroids); its drafts after the long
    prompt's prefill, as transformers' generator makes them."""
    t = target.config
    text = dict(COMMON, hidden_size=16, intermediate_size=32, num_hidden_layers=2,
                layer_types=[S, F], rope_parameters=ROPE, final_logit_softcapping=None,
                num_global_key_value_heads=None)
    config = Gemma4AssistantConfig(text_config=text, backbone_hidden_size=t.hidden_size,
                                   use_ordered_embeddings=True, num_centroids=10,
                                   centroid_intermediate_top_k=3)
    config._attn_implementation = "eager"
    config.text_config._attn_implementation = "eager"
    model = Gemma4AssistantForCausalLM(config).eval()
    randomize(model)
    with torch.no_grad():
        order = torch.randperm(t.vocab_size, generator=torch.Generator().manual_seed(1))
        model.masked_embedding.token_ordering.copy_(order)
        prompt = torch.tensor([INPUTS["long"]])
        out = target(prompt, output_hidden_states=True, return_shared_kv_states=True)
        root = int(out.logits[0, -1].argmax())
        ids = torch.cat([prompt, torch.tensor([[root]])], dim=1)
        gen = SinglePositionMultiTokenCandidateGenerator(
            model, target.get_input_embeddings(),
            GenerationConfig(max_length=512, num_assistant_tokens=DRAFTS))
        gen.num_assistant_tokens = DRAFTS
        drafts, logits = gen.get_candidates(ids, {"attention_mask": torch.ones_like(ids)}, out,
                                            is_first_iteration=False, n_last_matches=0)
    shutil.rmtree(HERE / ASSISTANT, ignore_errors=True)
    model.save_pretrained(HERE / ASSISTANT)
    np.savez_compressed(HERE / ASSISTANT / "drafts.npz", prompt=np.array(INPUTS["long"]),
                        root=np.array(root), drafts=drafts[0, ids.shape[1]:].numpy(),
                        logits=logits[0].float().numpy())
    meta = {"transformers": transformers.__version__, "torch": torch.__version__}
    (HERE / ASSISTANT / "generated_by.json").write_text(json.dumps(meta))
    print(ASSISTANT, drafts[0, ids.shape[1]:].tolist())


def main(names=None) -> None:
    torch.manual_seed(0)
    models = {}
    for name in CASES:
        if not names or name in names or (name == "shared_ple" and ASSISTANT in names):
            models[name] = text_case(name)
    if not names or MULTIMODAL in names:
        multimodal_case()
    if not names or ASSISTANT in names:
        assistant_case(models["shared_ple"])


if __name__ == "__main__":
    import sys

    main(sys.argv[1:])
