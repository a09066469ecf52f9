"""Gemma 2 and Gemma 3 (text): the decoder skeleton with Gemma's own layer.

What differs from Llama: RMSNorm scales by (1 + weight); a norm before and after both the
attention and the MLP; the embedding is scaled by sqrt(hidden size); GELU (tanh) MLP;
attention scaled by `query_pre_attn_scalar`; sliding-window and global layers (`layer_types`);
Gemma 2 tanh-caps attention scores and final logits, Gemma 3 normalises q and k instead and
gives its sliding layers their own RoPE base.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, ClassVar, Optional

import mlx.core as mx
import mlx.nn as nn

from .decoder import Attention, Model, ModelArgs, sliding_layers
from .rope import RoPE, RopeSpec, rope_spec

FAMILIES: dict[str, dict[str, Any]] = {
    "gemma2": {"tie_word_embeddings": True},
    "gemma3_text": {"tie_word_embeddings": True, "qk_norm": True},
}
# Defaults of transformers' configs for what older config files leave out.
GLOBAL_THETA = {"gemma2": 10_000.0, "gemma3_text": 1_000_000.0}
SLIDING_PATTERN = {"gemma2": 2, "gemma3_text": 6}  # every n-th layer is global


@dataclass
class GemmaArgs(ModelArgs):
    query_pre_attn_scalar: float = 256.0
    attn_logit_softcapping: Optional[float] = None
    final_logit_softcapping: Optional[float] = None
    hidden_activation: str = "gelu_pytorch_tanh"
    rope_local: RopeSpec = field(default_factory=RopeSpec)  # sliding layers' RoPE

    FAMILIES: ClassVar[dict[str, dict[str, Any]]] = FAMILIES
    DERIVED: ClassVar[tuple[str, ...]] = ModelArgs.DERIVED + ("rope_local",)

    def derive(self, config: dict) -> None:
        if self.hidden_activation not in ("gelu_pytorch_tanh", "gelu_tanh"):
            raise ValueError(f"unsupported hidden_activation {self.hidden_activation!r}")
        self.rope = rope_spec(config, "full_attention", GLOBAL_THETA[self.model_type])
        self.rope_local = (rope_spec(config, "sliding_attention", 10_000.0, "rope_local_base_freq")
                           if self.model_type == "gemma3_text" else self.rope)
        n = self.num_hidden_layers
        if not config.get("layer_types"):
            pattern = config.get("sliding_window_pattern", SLIDING_PATTERN[self.model_type])
            config = {**config, "layer_types": ["full_attention" if (i + 1) % pattern == 0
                                                else "sliding_attention" for i in range(n)]}
        self.sliding_window, self.sliding_layers = sliding_layers(self.model_type, config, n)


class GemmaRMSNorm(nn.Module):
    """RMSNorm whose weight is stored as an offset from 1 (zeros mean identity)."""

    def __init__(self, dims: int, eps: float = 1e-6):
        super().__init__()
        self.weight = mx.zeros((dims,))
        self.eps = eps

    def __call__(self, x: mx.array) -> mx.array:
        return mx.fast.rms_norm(x, 1.0 + self.weight, self.eps)


class GemmaAttention(Attention):
    """Llama's attention with Gemma's scale, score cap, norms and per-layer-type RoPE."""

    def __init__(self, args: GemmaArgs, layer: int):
        super().__init__(args, norm=GemmaRMSNorm)
        hd = args.head_dim
        self.scale = args.query_pre_attn_scalar ** -0.5
        self.softcap = args.attn_logit_softcapping
        self.o_proj = nn.Linear(self.n_heads * hd, args.hidden_size, bias=args.attention_bias)
        spec = args.rope_local if args.sliding_layers[layer] else args.rope
        self.rope = RoPE(spec, hd, args.max_position_embeddings)


class GemmaMLP(nn.Module):
    def __init__(self, args: GemmaArgs):
        super().__init__()
        d, h = args.hidden_size, args.intermediate_size
        self.gate_proj = nn.Linear(d, h, bias=False)
        self.up_proj = nn.Linear(d, h, bias=False)
        self.down_proj = nn.Linear(h, d, bias=False)

    def __call__(self, x):
        return self.down_proj(nn.gelu_approx(self.gate_proj(x)) * self.up_proj(x))


class GemmaBlock(nn.Module):
    def __init__(self, args: GemmaArgs, layer: int):
        super().__init__()
        d, eps = args.hidden_size, args.rms_norm_eps
        self.self_attn = GemmaAttention(args, layer)
        self.mlp = GemmaMLP(args)
        self.input_layernorm = GemmaRMSNorm(d, eps)
        self.post_attention_layernorm = GemmaRMSNorm(d, eps)
        self.pre_feedforward_layernorm = GemmaRMSNorm(d, eps)
        self.post_feedforward_layernorm = GemmaRMSNorm(d, eps)
        self.sliding = args.sliding_layers[layer]

    def __call__(self, x, positions, mask, cache, layer, first_key=0):
        a = self.self_attn(self.input_layernorm(x), positions, mask, cache, layer, first_key)
        h = x + self.post_attention_layernorm(a)
        return h + self.post_feedforward_layernorm(self.mlp(self.pre_feedforward_layernorm(h)))


class GemmaModel(Model):
    BLOCK: ClassVar[type] = GemmaBlock
    NORM: ClassVar[type] = GemmaRMSNorm

    def embed(self, inputs: mx.array) -> mx.array:
        h = self.model.embed_tokens(inputs)
        return h * mx.array(self.args.hidden_size ** 0.5, dtype=h.dtype)

    def logits(self, h: mx.array) -> mx.array:
        out = super().logits(h)
        cap = self.args.final_logit_softcapping
        return mx.tanh(out / cap) * cap if cap else out
