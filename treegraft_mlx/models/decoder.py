"""One decoder skeleton for the Llama family of architectures (llama, mistral, qwen2, qwen3).

Why our own instead of `mlx_lm.models`: speculative decoding needs a forward over a block of
tree nodes with a position per node, a tree-shaped mask and logits for chosen rows only. The
families differ in a few explicit switches (`ModelArgs.attention_bias`, `ModelArgs.qk_norm`,
RoPE scaling); everything else is shared. The model knows nothing about trees: positions and
masks come from the caller.
"""

from __future__ import annotations

import inspect
from dataclasses import dataclass, field
from typing import Any, Optional, Union

import mlx.core as mx
import mlx.nn as nn

from ..cache import KVCache
from ..kernels import tree_attention

# What each supported `model_type` changes relative to plain Llama.
FAMILY_DEFAULTS: dict[str, dict[str, Any]] = {
    "llama": {},
    "mistral": {},
    "qwen2": {"attention_bias": True},
    "qwen3": {"qk_norm": True},
}

Positions = Union[int, mx.array]


@dataclass
class ModelArgs:
    model_type: str
    hidden_size: int
    num_hidden_layers: int
    intermediate_size: int
    num_attention_heads: int
    vocab_size: int
    rms_norm_eps: float = 1e-6
    num_key_value_heads: Optional[int] = None
    head_dim: Optional[int] = None
    max_position_embeddings: int = 4096
    rope_theta: float = 10000.0
    rope_scaling: Optional[dict] = None
    attention_bias: bool = False
    mlp_bias: bool = False
    qk_norm: bool = False
    tie_word_embeddings: bool = False
    eos_token_id: Any = None
    extra: dict = field(default_factory=dict)

    @classmethod
    def from_config(cls, config: dict) -> "ModelArgs":
        model_type = config.get("model_type")
        if model_type not in FAMILY_DEFAULTS:
            raise ValueError(
                f"unsupported model_type {model_type!r}; supported: {sorted(FAMILY_DEFAULTS)}")
        names = set(inspect.signature(cls).parameters) - {"extra"}
        values = {**FAMILY_DEFAULTS[model_type], **{k: v for k, v in config.items() if k in names}}
        if model_type == "qwen2":  # Qwen2 configs carry no attention_bias key: it is always on
            values["attention_bias"] = True
        values["extra"] = {k: v for k, v in config.items() if k not in names}
        args = cls(**values)
        if args.num_key_value_heads is None:
            args.num_key_value_heads = args.num_attention_heads
        if args.head_dim is None:
            args.head_dim = args.hidden_size // args.num_attention_heads
        return args


class RoPE(nn.Module):
    """Rotary embedding at a contiguous offset or at an arbitrary position per token.

    Supports the default, "linear" and "llama3" scalings. Per-token positions reuse
    `mx.fast.rope` by moving tokens onto the batch axis, where offsets may differ per row.
    """

    def __init__(self, args: ModelArgs):
        super().__init__()
        dims, base = args.head_dim, args.rope_theta
        self.dims = dims
        self.scale = 1.0
        self._freqs = None
        self.base: Optional[float] = base
        scaling = args.rope_scaling or {}
        kind = scaling.get("rope_type", scaling.get("type", "default"))
        if kind == "linear":
            self.scale = 1.0 / scaling["factor"]
        elif kind == "llama3":
            self._freqs = _llama3_freqs(dims, base, scaling)
            self.base = None
        elif kind != "default":
            raise ValueError(f"unsupported rope_scaling type {kind!r} "
                             "(supported: default, linear, llama3)")

    def __call__(self, x: mx.array, positions: Positions) -> mx.array:
        kwargs = dict(traditional=False, base=self.base, scale=self.scale, freqs=self._freqs)
        if isinstance(positions, int):
            return mx.fast.rope(x, self.dims, offset=positions, **kwargs)
        # x: (1, H, L, D) -> (L, H, 1, D): one token per batch row, one offset per row.
        y = mx.fast.rope(x.transpose(2, 1, 0, 3), self.dims, offset=positions, **kwargs)
        return y.transpose(2, 1, 0, 3)


def _llama3_freqs(dims: int, base: float, cfg: dict) -> mx.array:
    """Llama 3.x frequency smoothing between the low- and high-frequency bands."""
    factor = cfg["factor"]
    low, high = cfg.get("low_freq_factor", 1.0), cfg.get("high_freq_factor", 4.0)
    old_len = cfg.get("original_max_position_embeddings", 8192)
    freqs = base ** (mx.arange(0, dims, 2) / dims)
    wavelens = 2 * mx.pi * freqs
    freqs = mx.where(wavelens > old_len / low, freqs * factor, freqs)
    medium = (wavelens > old_len / high) & (wavelens < old_len / low)
    smooth = (old_len / wavelens - low) / (high - low)
    return mx.where(medium, freqs / ((1 - smooth) / factor + smooth), freqs)


class Attention(nn.Module):
    def __init__(self, args: ModelArgs):
        super().__init__()
        self.n_heads, self.n_kv_heads = args.num_attention_heads, args.num_key_value_heads
        self.head_dim = hd = args.head_dim
        self.scale = hd ** -0.5
        bias = args.attention_bias
        self.q_proj = nn.Linear(args.hidden_size, self.n_heads * hd, bias=bias)
        self.k_proj = nn.Linear(args.hidden_size, self.n_kv_heads * hd, bias=bias)
        self.v_proj = nn.Linear(args.hidden_size, self.n_kv_heads * hd, bias=bias)
        self.o_proj = nn.Linear(self.n_heads * hd, args.hidden_size, bias=False)
        if args.qk_norm:
            self.q_norm = nn.RMSNorm(hd, eps=args.rms_norm_eps)
            self.k_norm = nn.RMSNorm(hd, eps=args.rms_norm_eps)
        self.rope = RoPE(args)

    def __call__(self, x, positions: Positions, mask, cache: Optional[KVCache], layer: int):
        B, L, _ = x.shape
        q = self.q_proj(x).reshape(B, L, self.n_heads, -1)
        k = self.k_proj(x).reshape(B, L, self.n_kv_heads, -1)
        v = self.v_proj(x).reshape(B, L, self.n_kv_heads, -1)
        if "q_norm" in self:
            q, k = self.q_norm(q), self.k_norm(k)
        q, k, v = (t.transpose(0, 2, 1, 3) for t in (q, k, v))
        q, k = self.rope(q, positions), self.rope(k, positions)
        if cache is not None:
            k, v = cache.write(layer, k, v)
        out = tree_attention(q, k, v, scale=self.scale, mask=mask)
        return self.o_proj(out.transpose(0, 2, 1, 3).reshape(B, L, -1))


class MLP(nn.Module):
    def __init__(self, args: ModelArgs):
        super().__init__()
        d, h, b = args.hidden_size, args.intermediate_size, args.mlp_bias
        self.gate_proj = nn.Linear(d, h, bias=b)
        self.up_proj = nn.Linear(d, h, bias=b)
        self.down_proj = nn.Linear(h, d, bias=b)

    def __call__(self, x):
        return self.down_proj(nn.silu(self.gate_proj(x)) * self.up_proj(x))


class Block(nn.Module):
    def __init__(self, args: ModelArgs):
        super().__init__()
        self.self_attn = Attention(args)
        self.mlp = MLP(args)
        self.input_layernorm = nn.RMSNorm(args.hidden_size, eps=args.rms_norm_eps)
        self.post_attention_layernorm = nn.RMSNorm(args.hidden_size, eps=args.rms_norm_eps)

    def __call__(self, x, positions, mask, cache, layer):
        h = x + self.self_attn(self.input_layernorm(x), positions, mask, cache, layer)
        return h + self.mlp(self.post_attention_layernorm(h))


class Body(nn.Module):
    def __init__(self, args: ModelArgs):
        super().__init__()
        self.embed_tokens = nn.Embedding(args.vocab_size, args.hidden_size)
        self.layers = [Block(args) for _ in range(args.num_hidden_layers)]
        self.norm = nn.RMSNorm(args.hidden_size, eps=args.rms_norm_eps)


class Model(nn.Module):
    """Decoder LM. `model(ids)` is a plain causal forward returning (1, L, V) logits."""

    def __init__(self, args: ModelArgs):
        super().__init__()
        self.args = args
        self.model_type = args.model_type
        self.model = Body(args)
        if not args.tie_word_embeddings:
            self.lm_head = nn.Linear(args.hidden_size, args.vocab_size, bias=False)

    def __call__(
        self,
        inputs: mx.array,
        cache: Optional[KVCache] = None,
        positions: Optional[mx.array] = None,
        mask: Optional[mx.array] = None,
        logits_rows: Optional[mx.array] = None,
    ) -> mx.array:
        """Forward a block of tokens.

        inputs: (1, L) token ids. cache: committed context; the block is written after it and
        stays pending until the caller commits or keeps rows of it. positions: (L,) position
        per token, default contiguous after the cache. mask: (L, context + L) boolean or
        additive, default causal. logits_rows: rows whose logits are wanted, default all.
        """
        offset = cache.offset if cache is not None else 0
        L = inputs.shape[1]
        pos: Positions = offset if positions is None else positions
        if mask is None and L > 1:
            mask = "causal"
        h = self.model.embed_tokens(inputs)
        for i, layer in enumerate(self.model.layers):
            h = layer(h, pos, mask, cache, i)
        if logits_rows is not None:
            h = h[:, logits_rows]
        h = self.model.norm(h)
        if self.args.tie_word_embeddings:
            return self.model.embed_tokens.as_linear(h)
        return self.lm_head(h)

    def make_cache(self, max_len: Optional[int] = None, dtype: Optional[mx.Dtype] = None) -> KVCache:
        a = self.args
        if dtype is None:
            dtype = self.model.norm.weight.dtype
        return KVCache(a.num_hidden_layers, a.num_key_value_heads, a.head_dim,
                       max_len or a.max_position_embeddings, dtype)

    @property
    def layers(self):
        return self.model.layers
