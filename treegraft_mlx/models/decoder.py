"""One decoder skeleton for the Llama family (llama, mistral, qwen2, qwen3, phi3, mixtral, qwen3_moe).

Why our own instead of `mlx_lm.models`: speculative decoding needs a forward over a block of
tree nodes with a position per node, a tree-shaped mask and logits for chosen rows only. The
families differ in a few explicit switches (`ModelArgs.attention_bias`, `qk_norm`,
`fused_projections` for Phi-3, routed experts for the mixtures, sliding-window layers, RoPE
scaling); everything else is shared. The model knows nothing about trees: positions and masks
come from the caller.
"""

from __future__ import annotations

import inspect
from dataclasses import dataclass, field
from typing import Any, Callable, ClassVar, Optional

import mlx.core as mx
import mlx.nn as nn

from ..cache import KVCache
from ..kernels import pooled_kernel, tree_attention, varlen_tree_attention, windowed
from ..slots import SlotPool, pool_of
from .forward import Forward
from .moe import MoE, stack_experts
from .rope import Positions, RoPE, RopeSpec, rope_spec
from .segments import Segment, Segments

# What each supported `model_type` changes relative to plain Llama.
FAMILY_DEFAULTS: dict[str, dict[str, Any]] = {
    "llama": {},
    "mistral": {},
    "qwen2": {"attention_bias": True},
    "qwen3": {"qk_norm": True},
    "phi3": {"fused_projections": True},
    "mixtral": {},
    "qwen3_moe": {"qk_norm": True},
}
WINDOW_ON_ALL_LAYERS = ("mistral", "mixtral", "phi3")  # a set sliding_window applies everywhere


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
    attention_bias: bool = False
    mlp_bias: bool = False
    qk_norm: bool = False
    fused_projections: bool = False
    tie_word_embeddings: bool = False
    eos_token_id: Any = None
    # mixtures of experts (Mixtral: num_local_experts; Qwen3-MoE: num_experts)
    num_local_experts: int = 0
    num_experts: int = 0
    num_experts_per_tok: int = 2
    moe_intermediate_size: Optional[int] = None
    norm_topk_prob: bool = True
    decoder_sparse_step: int = 1
    mlp_only_layers: list = field(default_factory=list)
    # derived by from_config
    rope: RopeSpec = field(default_factory=RopeSpec)
    sliding_window: Optional[int] = None
    sliding_layers: list = field(default_factory=list)  # per layer: windowed or not
    extra: dict = field(default_factory=dict)

    FAMILIES: ClassVar[dict[str, dict[str, Any]]] = FAMILY_DEFAULTS
    DERIVED: ClassVar[tuple[str, ...]] = ("extra", "rope", "sliding_window", "sliding_layers")

    @classmethod
    def from_config(cls, config: dict) -> "ModelArgs":
        model_type = config.get("model_type")
        if model_type not in cls.FAMILIES:
            raise ValueError(
                f"unsupported model_type {model_type!r}; supported: {sorted(cls.FAMILIES)}")
        names = set(inspect.signature(cls).parameters) - set(cls.DERIVED)
        values = {**cls.FAMILIES[model_type], **{k: v for k, v in config.items() if k in names}}
        if model_type == "qwen2":  # Qwen2 configs carry no attention_bias key: it is always on
            values["attention_bias"] = True
        if model_type == "mixtral":  # renormalises the chosen experts' probabilities always
            values["norm_topk_prob"] = True
        values["extra"] = {k: v for k, v in config.items() if k not in names}
        args = cls(**values)
        if args.num_key_value_heads is None:
            args.num_key_value_heads = args.num_attention_heads
        if args.head_dim is None:
            args.head_dim = args.hidden_size // args.num_attention_heads
        args.derive(config)
        return args

    def derive(self, config: dict) -> None:
        """The settings config.json spells differently across families and versions."""
        self.rope = rope_spec(config)
        self.sliding_window, self.sliding_layers = sliding_layers(
            self.model_type, config, self.num_hidden_layers)

    @property
    def experts(self) -> int:
        return self.num_local_experts or self.num_experts

    def is_moe_layer(self, layer: int) -> bool:
        return (self.experts > 0 and layer not in self.mlp_only_layers
                and (layer + 1) % self.decoder_sparse_step == 0)


def sliding_layers(model_type: str, config: dict, layers: int) -> tuple[Optional[int], list]:
    """(window, which layers use it), as transformers decides for each family."""
    window = config.get("sliding_window")
    if not window:
        return None, [False] * layers
    if config.get("layer_types"):
        return window, [t == "sliding_attention" for t in config["layer_types"]]
    if model_type in WINDOW_ON_ALL_LAYERS:
        return window, [True] * layers
    if model_type in ("qwen2", "qwen3", "qwen3_moe") and config.get("use_sliding_window"):
        first = config.get("max_window_layers", 0) if model_type != "qwen3_moe" else 0
        return window, [i >= first for i in range(layers)]
    return None, [False] * layers


class Attention(nn.Module):
    def __init__(self, args: ModelArgs, norm: type = nn.RMSNorm):
        super().__init__()
        self.n_heads, self.n_kv_heads = args.num_attention_heads, args.num_key_value_heads
        self.head_dim = hd = args.head_dim
        self.scale = hd ** -0.5
        self.softcap: Optional[float] = None  # tanh cap on the scores (Gemma 2)
        bias = args.attention_bias
        if args.fused_projections:  # Phi-3: one matmul for q, k and v
            self.splits = [self.n_heads * hd, (self.n_heads + self.n_kv_heads) * hd]
            self.qkv_proj = nn.Linear(args.hidden_size, (self.n_heads + 2 * self.n_kv_heads) * hd,
                                      bias=bias)
        else:
            self.q_proj = nn.Linear(args.hidden_size, self.n_heads * hd, bias=bias)
            self.k_proj = nn.Linear(args.hidden_size, self.n_kv_heads * hd, bias=bias)
            self.v_proj = nn.Linear(args.hidden_size, self.n_kv_heads * hd, bias=bias)
        self.o_proj = nn.Linear(self.n_heads * hd, args.hidden_size, bias=False)
        if args.qk_norm:
            self.q_norm = norm(hd, eps=args.rms_norm_eps)
            self.k_norm = norm(hd, eps=args.rms_norm_eps)
        self.rope = RoPE(args.rope, hd, args.max_position_embeddings)

    def __call__(self, x, positions: Positions, mask, cache: Optional[KVCache], layer: int,
                 first_key: int = 0):
        if "qkv_proj" in self:
            q, k, v = mx.split(self.qkv_proj(x), self.splits, axis=-1)
        else:
            q, k, v = self.q_proj(x), self.k_proj(x), self.v_proj(x)
        return self.o_proj(self.attend(q, k, v, positions, mask, cache, layer, first_key))

    def attend(self, q: mx.array, k: mx.array, v: mx.array, positions: Positions, mask,
               cache: Optional[KVCache], layer: int, first_key: int = 0) -> mx.array:
        """Attention of projected queries, keys and values (B, L, ...): norms, RoPE, the
        cache, the tree mask; (B, L, heads x head_dim), before the output projection."""
        B, L = q.shape[:2]
        q = q.reshape(B, L, self.n_heads, -1)
        k = k.reshape(B, L, self.n_kv_heads, -1)
        v = v.reshape(B, L, self.n_kv_heads, -1)
        if "q_norm" in self:
            q, k = self.q_norm(q), self.k_norm(k)
        q, k, v = (t.transpose(0, 2, 1, 3) for t in (q, k, v))
        if isinstance(cache, Segments) and self.rope.window is None:
            # A packed forward: one RoPE for every request's rows at their own positions
            # (longrope picks its factors per request, below), then attention per request,
            # or over a slot pool: one write, the AR rows (all rows, on a GPU) in one call.
            q, k = self.rope(q, cache.positions), self.rope(k, cache.positions)
            out = (self.attend_pooled(q, k, v, cache, layer) if cache.pool is not None else
                   cache.each(lambda s, q, k, v: self.attend_roped(
                       q, k, v, s.mask, s.cache, layer, s.first_key), q, k, v))
        elif isinstance(cache, Segments):
            out = cache.each(lambda s, q, k, v: self.attend_block(
                q, k, v, s.positions, s.mask, s.cache, layer, s.first_key), q, k, v)
        else:
            out = self.attend_block(q, k, v, positions, mask, cache, layer, first_key)
        return out.transpose(0, 2, 1, 3).reshape(B, L, -1)

    def attend_block(self, q: mx.array, k: mx.array, v: mx.array, positions: Positions, mask,
                     cache: Optional[KVCache], layer: int, first_key: int) -> mx.array:
        """One request's normed q, k, v (1, heads, L, head_dim): RoPE at its positions, its
        cache, its mask; the attention output (1, heads, L, head_dim)."""
        q, k = self.rope(q, positions), self.rope(k, positions)
        return self.attend_roped(q, k, v, mask, cache, layer, first_key)

    def attend_roped(self, q: mx.array, k: mx.array, v: mx.array, mask,
                     cache: Optional[KVCache], layer: int, first_key: int) -> mx.array:
        """attend_block after RoPE: the cache write, the window, the masked attention."""
        if cache is not None:
            k, v = cache.write(layer, k, v)
        return self.attend_cached(q, k, v, mask, first_key)

    def attend_cached(self, q: mx.array, k: mx.array, v: mx.array, mask,
                      first_key: int) -> mx.array:
        """attend_roped after the cache write: k, v are the context + block."""
        if first_key:  # a sliding-window layer: keys before the window are never read
            k, v = k[:, :, first_key:], v[:, :, first_key:]
        return tree_attention(q, k, v, scale=self.scale, mask=mask, softcap=self.softcap)

    def attend_pooled(self, q: mx.array, k: mx.array, v: mx.array, cache: Segments,
                      layer: int) -> mx.array:
        """Every request's roped rows over the pool (Segments.pooled); soft-capped scores
        (Gemma 2) have neither batched call, so they attend per request."""
        gpu = None if self.softcap else pooled_kernel(q.dtype, q.shape[-1],
                                                       self.n_heads // self.n_kv_heads)
        return cache.pooled(
            layer, q, k, v,
            lambda s, q, k, v: self.attend_cached(q, k, v, s.mask, s.first_key),
            None if self.softcap else self.attend_slots,
            gpu and (lambda q, k, v, blocks: varlen_tree_attention(
                q, k, v, self.scale, blocks, gpu)))

    def attend_slots(self, q: mx.array, k: mx.array, v: mx.array, mask: mx.array) -> mx.array:
        """Several requests' AR rows at once: q (slots, heads, 1, dim) against their slots
        k, v (slots, KV heads, length, dim), each masked to its own length."""
        return mx.fast.scaled_dot_product_attention(q, k, v, scale=self.scale, mask=mask)


class MLP(nn.Module):
    def __init__(self, args: ModelArgs):
        super().__init__()
        d, h, b = args.hidden_size, args.intermediate_size, args.mlp_bias
        if args.fused_projections:  # Phi-3: gate and up in one matmul, gate first
            self.gate_up_proj = nn.Linear(d, 2 * h, bias=b)
        else:
            self.gate_proj = nn.Linear(d, h, bias=b)
            self.up_proj = nn.Linear(d, h, bias=b)
        self.down_proj = nn.Linear(h, d, bias=b)

    def __call__(self, x):
        if "gate_up_proj" in self:
            gate, up = mx.split(self.gate_up_proj(x), 2, axis=-1)
        else:
            gate, up = self.gate_proj(x), self.up_proj(x)
        return self.down_proj(nn.silu(gate) * up)


def feed_forward(args: ModelArgs, layer: int) -> nn.Module:
    if not args.is_moe_layer(layer):
        return MLP(args)
    return MoE(args.hidden_size, args.moe_intermediate_size or args.intermediate_size,
               args.experts, args.num_experts_per_tok, args.norm_topk_prob)


class Block(nn.Module):
    def __init__(self, args: ModelArgs, layer: int):
        super().__init__()
        self.self_attn = Attention(args)
        if args.model_type == "mixtral":  # Mixtral names its expert layer differently
            self.block_sparse_moe = feed_forward(args, layer)
        else:
            self.mlp = feed_forward(args, layer)
        self.input_layernorm = nn.RMSNorm(args.hidden_size, eps=args.rms_norm_eps)
        self.post_attention_layernorm = nn.RMSNorm(args.hidden_size, eps=args.rms_norm_eps)
        self.sliding = args.sliding_layers[layer]

    def __call__(self, x, positions, mask, cache, layer, first_key=0):
        h = x + self.self_attn(self.input_layernorm(x), positions, mask, cache, layer, first_key)
        ff = self.block_sparse_moe if "block_sparse_moe" in self else self.mlp
        return h + ff(self.post_attention_layernorm(h))


class Body(nn.Module):
    def __init__(self, args: ModelArgs, block=Block, norm=nn.RMSNorm):
        super().__init__()
        self.embed_tokens = nn.Embedding(args.vocab_size, args.hidden_size)
        self.layers = [block(args, i) for i in range(args.num_hidden_layers)]
        self.norm = norm(args.hidden_size, eps=args.rms_norm_eps)


class Model(nn.Module):
    """Decoder LM. `model(ids)` is a plain causal forward returning (1, L, V) logits."""

    BLOCK: ClassVar[type] = Block
    NORM: ClassVar[type] = nn.RMSNorm
    RECURRENT: ClassVar[bool] = False   # layers carry a state a cache cannot truncate
    FULL_PRECISION: ClassVar[tuple[str, ...]] = ()   # weights (name endings) never cast down

    def __init__(self, args: ModelArgs):
        super().__init__()
        self.args = args
        self.model_type = args.model_type
        self.model = Body(args, self.BLOCK, self.NORM)
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
        h = self.run_layers(self.embed(inputs), cache, positions, mask)
        return self.head(h, logits_rows)

    def forward(self, inputs: mx.array, cache=None, positions: Optional[mx.array] = None,
                mask=None) -> Forward:
        """A block's last-layer hidden states and the head over chosen rows (models/forward.py);
        the block stays pending in `cache` as in `__call__`."""
        return Forward(self.run_layers(self.embed(inputs), cache, positions, mask)[0], self.head)

    def run_layers(self, h: mx.array, cache: Optional[KVCache] = None,
                   positions: Optional[mx.array] = None, mask=None) -> mx.array:
        """The decoder layers this model holds (all of them, or a pipeline stage's slice)."""
        pos, mask, local = self.block_masks(h, cache, positions, mask)
        for i, layer in enumerate(self.model.layers):
            if layer.sliding:
                h = layer(h, pos, local.mask, cache, i, local.first_key)
            else:
                h = layer(h, pos, mask, cache, i)
        return h

    def run_packed(self, h: mx.array, blocks: list) -> mx.array:
        """The decoder layers over several requests' rows (`packed.RequestBlock`s, in row order):
        each request's positions, masks and window built as `block_masks` builds a single
        forward's; attention per request (models/segments.py), everything else on all rows."""
        full, local = self.segments(h, blocks)
        for i, layer in enumerate(self.model.layers):
            h = layer(h, None, None, local if layer.sliding else full, i)
        return h

    def segments(self, h: mx.array, blocks: list) -> tuple[Segments, Segments]:
        """Each request's view for full and for sliding-window layers; both views of a
        request share one `shared` dict (Gemma 4's KV sharing spans both kinds of layer)."""
        full, local, start = [], [], 0
        for b in blocks:
            end = start + b.rows
            pos, mask, win = self.block_masks(h[:, start:end], b.cache, b.positions, b.mask)
            seg = Segment(start, end, b.cache, pos, mask)
            full.append(seg)
            local.append(seg if win is None else
                         Segment(start, end, b.cache, pos, win.mask, win.first_key, seg.shared))
            start = end
        pool = pool_of(blocks)
        if pool is not None:
            for b in blocks:         # room in the pool; each block pending in its slot
                b.cache.pend(b.rows)
        one = Segments(full, pool)
        return one, (one if all(a is b for a, b in zip(full, local)) else Segments(local, pool))

    def block_masks(self, h: mx.array, cache, positions: Optional[mx.array], mask):
        """A block's positions, its mask (causal by default for several rows) and, where a
        layer slides, the windowed mask, built once for every layer."""
        offset = cache.offset if cache is not None else 0
        L = h.shape[1]
        pos: Positions = offset if positions is None else positions
        if mask is None and L > 1:
            mask = "causal"
        local = (windowed(mask, pos, offset, L, self.args.sliding_window)
                 if any(layer.sliding for layer in self.model.layers) else None)
        return pos, mask, local

    def head(self, h: mx.array, logits_rows: Optional[mx.array] = None) -> mx.array:
        """Logits of the chosen rows (all by default) from the last layer's hidden states."""
        if logits_rows is not None:
            h = h[:, logits_rows]
        return self.logits(self.model.norm(h))

    def embed(self, inputs: mx.array) -> mx.array:
        return self.model.embed_tokens(inputs)

    def logits(self, h: mx.array) -> mx.array:
        if self.args.tie_word_embeddings:
            return self.model.embed_tokens.as_linear(h)
        return self.lm_head(h)

    def make_cache(self, max_len: Optional[int] = None, dtype: Optional[mx.Dtype] = None) -> KVCache:
        a = self.args
        if dtype is None:
            dtype = self.model.norm.weight.dtype
        return KVCache(len(self.model.layers), a.num_key_value_heads, a.head_dim,
                       max_len or a.max_position_embeddings, dtype)

    def slot_pool(self) -> Optional[SlotPool]:
        """A pool whose slots are caches of this model, for requests decoded together
        (slots.py); None for a model whose cache is not one `KVCache`."""
        a = self.args
        return SlotPool(len(self.model.layers), a.num_key_value_heads, a.head_dim,
                        self.model.norm.weight.dtype)

    def checkpoint_names(self, weights: dict, halves: Optional[Callable] = None,
                         unfuse: bool = True) -> dict:
        """A checkpoint's tensors (or header shapes: `halves` splits a fused pair) under this
        model's names, before experts are stacked: the same here."""
        return weights

    def sanitize(self, weights: dict[str, mx.array]) -> dict[str, mx.array]:
        """Checkpoint names -> this model's: per-expert tensors stacked (see moe.py)."""
        return stack_experts(weights, self.args.experts) if self.args.experts else weights

    @property
    def layers(self):
        return self.model.layers

