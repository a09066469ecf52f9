"""Gemma 4 text (`gemma4_text`, and the text tower of `gemma4` multimodal checkpoints), as
transformers 5.24-5.25 defines it.

What differs from Gemma 3: RMSNorms scale by their weight (not 1 + weight) and the value norm
has no scale; attention is unscaled (1.0) and uncapped; every layer's output is multiplied by
its `layer_scalar`. Full layers may use their own head dim and KV heads (`per_layer_config`,
or the older top-level `global_head_dim` / `num_global_key_value_heads`), and with
`attention_k_eq_v` they have no `v_proj`: V is the value-normed raw K projection, unrotated.
Full layers rotate with "proportional" RoPE (frequencies of the rotated fraction, zeros for
the rest, over the whole head dim). The last `num_kv_shared_layers` layers hold no keys and
values: each attends to those of the last earlier layer of its type (its producer, within the
same forward, pending tree rows included), and `use_double_wide_mlp` doubles their MLP.
Per-layer inputs (PLE): a per-token table and a projection of the embedding feed every layer
through gate -> GELU -> x input -> projection -> norm -> residual; the token part travels
beside the embedding through `embed` (the model's input carries it, so every caller that
runs `run_layers(embed(ids))` gets it). MoE layers run a dense MLP and routed experts on the
same input. The model knows nothing about trees: positions and masks come from the caller.
"""

from __future__ import annotations

import math
import warnings
from dataclasses import dataclass, field
from typing import Any, Callable, ClassVar, Optional

import mlx.core as mx
import mlx.nn as nn
from mlx_lm.models.switch_layers import SwitchGLU

from ..kernels import tree_attention
from ..layered_cache import LayeredCache
from .decoder import Model, ModelArgs, sliding_layers
from .rope import Positions, RoPE, RopeSpec, rope_spec
from .segments import Segments

FAMILIES: dict[str, dict[str, Any]] = {t: {"tie_word_embeddings": True}
                                       for t in ("gemma4_text", "gemma4")}
FULL, SLIDING = "full_attention", "sliding_attention"
# transformers' defaults for what a config leaves out
DEFAULT_ROPE = {SLIDING: {"rope_type": "default", "rope_theta": 10_000.0},
                FULL: {"rope_type": "proportional", "partial_rotary_factor": 0.25,
                       "rope_theta": 1_000_000.0}}
DEFAULT_GLOBAL_HEAD_DIM = 512
SLIDING_PATTERN = 6
WRAPPER_PREFIXES = ("model.language_model.", "language_model.model.")
NOT_TEXT = ("model.vision_tower", "model.embed_vision", "model.audio_tower", "model.embed_audio",
            "vision_tower", "embed_vision", "audio_tower", "embed_audio", "multi_modal_projector")


@dataclass(frozen=True)
class LayerSpec:
    """What one layer is: its attention type and K/V shape, and whose K/V it attends to."""

    sliding: bool
    head_dim: int
    kv_heads: int
    k_eq_v: bool        # no v_proj: V is the value-normed K projection
    producer: int       # the layer whose keys and values it reads (itself, if it has its own)
    double_mlp: bool

    @property
    def layer_type(self) -> str:
        return SLIDING if self.sliding else FULL


@dataclass
class Gemma4Args(ModelArgs):
    hidden_activation: str = "gelu_pytorch_tanh"
    final_logit_softcapping: Optional[float] = None
    layer_types: list = field(default_factory=list)
    attention_k_eq_v: bool = False
    num_kv_shared_layers: int = 0
    use_double_wide_mlp: bool = False
    enable_moe_block: bool = False
    top_k_experts: Optional[int] = None
    hidden_size_per_layer_input: int = 0
    vocab_size_per_layer_input: int = 0
    rope_parameters: dict = field(default_factory=dict)
    specs: list = field(default_factory=list)          # derived: LayerSpec per layer

    FAMILIES: ClassVar[dict[str, dict[str, Any]]] = FAMILIES
    DERIVED: ClassVar[tuple[str, ...]] = ModelArgs.DERIVED + ("specs",)

    @classmethod
    def from_config(cls, config: dict) -> "Gemma4Args":
        """A multimodal checkpoint's config nests the text model's under `text_config`."""
        if "text_config" in config:
            outer = {k: config[k] for k in ("tie_word_embeddings", "eos_token_id") if k in config}
            config = {**outer, **config["text_config"], "model_type": config["model_type"]}
        return super().from_config(config)

    def derive(self, config: dict) -> None:
        if self.hidden_activation not in ("gelu_pytorch_tanh", "gelu_tanh"):
            raise ValueError(f"unsupported hidden_activation {self.hidden_activation!r}")
        if config.get("use_bidirectional_attention") == "all":
            raise ValueError("use_bidirectional_attention 'all' makes an encoder, not a "
                             "causal language model: not supported")
        n = self.num_hidden_layers
        types = list(self.layer_types or [FULL if (i + 1) % SLIDING_PATTERN == 0 else SLIDING
                                          for i in range(n)])
        if len(types) != n or set(types) - {FULL, SLIDING}:
            raise ValueError(f"layer_types must name {n} layers, each {FULL} or {SLIDING}")
        types[-1] = FULL                       # transformers forces the last layer full
        self.layer_types = types
        self.rope_parameters = {**DEFAULT_ROPE, **(self.rope_parameters or {})}
        self.num_experts = self.num_experts or 0
        if self.enable_moe_block:
            if not (self.num_experts and self.top_k_experts and self.moe_intermediate_size):
                raise ValueError("enable_moe_block needs num_experts, top_k_experts and "
                                 "moe_intermediate_size")
            self.num_experts_per_tok = self.top_k_experts
        self.specs = layer_specs(self, config)
        self.sliding_window, self.sliding_layers = sliding_layers(
            self.model_type, {**config, "layer_types": types}, n)
        if self.sliding_window is None:
            self.sliding_layers = [False] * n
        # The full layers' base (what a reader of `args.rope` expects); each layer builds
        # its own RoPE from `rope_parameters` (layer_rope).
        self.rope = RopeSpec(float(self.rope_parameters[FULL].get("rope_theta", 1e6)))

    def is_moe_layer(self, layer: int) -> bool:
        return self.enable_moe_block

    @property
    def producers(self) -> list[int]:
        """The layers holding keys and values of their own, in order."""
        return [i for i, s in enumerate(self.specs) if s.producer == i]

    @property
    def store_layers(self) -> dict[str, int]:
        """Per layer type, the last producer of that type: the K/V an assistant reads."""
        return {s.layer_type: i for i, s in enumerate(self.specs) if s.producer == i}

    def kv_bytes(self, context: int, dtype: mx.Dtype, layers: Optional[int] = None) -> int:
        """Memory the KV cache needs for `context` tokens: producer layers only."""
        shapes = [(s.kv_heads, s.head_dim) for i, s in enumerate(self.specs[:layers])
                  if s.producer == i]
        return LayeredCache.bytes_for(shapes, context, dtype)


def text_config(config: dict) -> dict:
    """A Gemma 4 config as a text model's (what a converted directory holds, with no other
    towers' weights): a multimodal wrapper's `text_config` as `gemma4_text`, and the full
    layers' head dim and KV heads also at the top level, where older configs and mlx_lm read
    them."""
    if config.get("model_type") == "gemma4" and "text_config" in config:
        outer = {k: config[k] for k in ("tie_word_embeddings", "eos_token_id") if k in config}
        config = {**config["text_config"], **outer, "model_type": "gemma4_text"}
    out = dict(config)
    overrides = [v for k, v in (config.get("per_layer_config") or {}).items()
                 if str(k).isdigit() and "head_dim" in v]
    if overrides and "global_head_dim" not in config:
        out["global_head_dim"] = overrides[0]["head_dim"]
        if config.get("attention_k_eq_v") and "num_key_value_heads" in overrides[0]:
            out["num_global_key_value_heads"] = overrides[0]["num_key_value_heads"]
    return out


def layer_specs(args: Gemma4Args, config: dict) -> list[LayerSpec]:
    """Every layer's LayerSpec: per-layer overrides (`per_layer_config`, keyed by index) or,
    without them, the top-level global settings for full layers, as transformers reads them;
    KV sharing as transformers' `kv_sharing_modes`."""
    n, types = args.num_hidden_layers, args.layer_types
    overrides = {int(k): v for k, v in (config.get("per_layer_config") or {}).items()
                 if str(k).isdigit()}
    if not overrides:
        global_heads = config.get("num_global_key_value_heads")
        full = {"head_dim": config.get("global_head_dim", DEFAULT_GLOBAL_HEAD_DIM)}
        if global_heads is not None and args.attention_k_eq_v:
            full["num_key_value_heads"] = global_heads
        overrides = {i: full for i, t in enumerate(types) if t == FULL}
    first_shared = n - args.num_kv_shared_layers
    if not 0 <= first_shared <= n:
        raise ValueError(f"num_kv_shared_layers {args.num_kv_shared_layers} exceeds {n} layers")
    specs = []
    for i, t in enumerate(types):
        o = overrides.get(i, {})
        producer = i
        if i >= first_shared:
            earlier = [j for j in range(first_shared) if types[j] == t]
            # no earlier producer (an assistant): the K/V come from elsewhere (-1)
            producer = earlier[-1] if earlier else -1
        specs.append(LayerSpec(
            sliding=t == SLIDING, head_dim=int(o.get("head_dim", args.head_dim)),
            kv_heads=int(o.get("num_key_value_heads", args.num_key_value_heads)),
            k_eq_v=args.attention_k_eq_v and t == FULL, producer=producer,
            double_mlp=args.use_double_wide_mlp and i >= first_shared))
    return specs


def layer_rope(params: dict, head_dim: int, max_positions: int) -> RoPE:
    """RoPE of one layer type. "proportional": the first `partial_rotary_factor` of the
    frequencies of a full-head-dim RoPE (divided by `factor`), the rest zero, so the whole
    head dim goes through the rotation and the unrotated part comes out unchanged."""
    kind = params.get("rope_type", "default")
    theta = float(params.get("rope_theta", 10_000.0))
    if kind != "proportional":
        spec = rope_spec({"rope_parameters": {k: v for k, v in params.items()
                                              if k != "partial_rotary_factor"}})
        return RoPE(spec, head_dim, max_positions)
    rope = RoPE(RopeSpec(theta), head_dim, max_positions)
    rotated = int(params.get("partial_rotary_factor", 1.0) * head_dim // 2)
    exponents = mx.arange(0, 2 * rotated, 2, dtype=mx.float32) / head_dim
    rope._freqs = mx.concatenate([float(params.get("factor", 1.0)) * theta ** exponents,
                                  mx.full((head_dim // 2 - rotated,), math.inf)])
    rope.dims, rope.base = head_dim, None
    return rope


class Gemma4Attention(nn.Module):
    """Unscaled attention with q/k norms (weights), an unscaled value norm, per-layer K/V
    shape; a KV-shared layer reads its producer's keys and values of the same forward."""

    def __init__(self, args: Gemma4Args, layer: int):
        super().__init__()
        s = args.specs[layer]
        d, hd, bias = args.hidden_size, s.head_dim, args.attention_bias
        self.n_heads, self.n_kv_heads, self.head_dim = args.num_attention_heads, s.kv_heads, hd
        # whose K/V it reads: a layer of this model, or (an assistant's) the K/V of its type
        # handed in from elsewhere
        self.producer = s.producer if s.producer >= 0 else s.layer_type
        self.eps = args.rms_norm_eps
        self.q_proj = nn.Linear(d, self.n_heads * hd, bias=bias)
        self.q_norm = nn.RMSNorm(hd, eps=args.rms_norm_eps)
        if s.producer == layer:
            self.k_proj = nn.Linear(d, s.kv_heads * hd, bias=bias)
            if not s.k_eq_v:
                self.v_proj = nn.Linear(d, s.kv_heads * hd, bias=bias)
            self.k_norm = nn.RMSNorm(hd, eps=args.rms_norm_eps)
        self.o_proj = nn.Linear(self.n_heads * hd, d, bias=bias)
        self.rope = layer_rope(args.rope_parameters[s.layer_type], hd,
                               args.max_position_embeddings)

    def queries(self, x: mx.array, positions: Positions) -> mx.array:
        """Normed, rotated queries (B, heads, L, head_dim)."""
        return self.rope(self.normed_queries(x), positions)

    def normed_queries(self, x: mx.array) -> mx.array:
        """Normed queries before RoPE (B, heads, L, head_dim)."""
        B, L, _ = x.shape
        q = self.q_norm(self.q_proj(x).reshape(B, L, self.n_heads, self.head_dim))
        return q.transpose(0, 2, 1, 3)

    def keys_values(self, x: mx.array, positions: Positions) -> tuple[mx.array, mx.array]:
        """This layer's own keys (normed, rotated) and values (normed), (B, heads, L, dim)."""
        k, v = self.normed_keys_values(x)
        return self.rope(k, positions), v

    def normed_keys_values(self, x: mx.array) -> tuple[mx.array, mx.array]:
        """This layer's own keys (normed, before RoPE) and values (normed), (B, heads, L,
        dim)."""
        B, L, _ = x.shape
        raw = self.k_proj(x).reshape(B, L, self.n_kv_heads, self.head_dim)
        v = self.v_proj(x).reshape(raw.shape) if "v_proj" in self else raw
        return (self.k_norm(raw).transpose(0, 2, 1, 3),
                mx.fast.rms_norm(v, None, self.eps).transpose(0, 2, 1, 3))

    def __call__(self, x, positions: Positions, mask, cache, layer: int, first_key: int,
                 shared: dict) -> mx.array:
        B, L, _ = x.shape
        q = self.normed_queries(x)
        k, v = self.normed_keys_values(x) if "k_proj" in self else (None, None)
        if isinstance(cache, Segments):  # a packed forward: per request from here on
            out = cache.each(lambda s, q, k, v: self.attend_block(
                q, k, v, s.positions, s.mask, s.cache, layer, s.first_key, s.shared), q, k, v)
        else:
            out = self.attend_block(q, k, v, positions, mask, cache, layer, first_key, shared)
        return self.o_proj(out.transpose(0, 2, 1, 3).reshape(B, L, -1))

    def attend_block(self, q: mx.array, k: Optional[mx.array], v: Optional[mx.array],
                     positions: Positions, mask, cache, layer: int, first_key: int,
                     shared: dict) -> mx.array:
        """One request's normed queries (and, in a producer layer, keys and values) at its
        positions, against its cache or its producer's keys and values; (1, heads, L, dim)."""
        q = self.rope(q, positions)
        if k is not None:
            k = self.rope(k, positions)
            if cache is not None:
                k, v = cache.write(layer, k, v)
            shared[layer] = (k, v)
        else:
            k, v = shared[self.producer]
        if first_key:  # a sliding-window layer: keys before the window are never read
            k, v = k[:, :, first_key:], v[:, :, first_key:]
        return tree_attention(q, k, v, scale=1.0, mask=mask, softcap=None)


class GeluGate(nn.Module):
    """The experts' activation: GELU (tanh) of the gate times the up projection."""

    def __call__(self, up: mx.array, gate: mx.array) -> mx.array:
        return nn.gelu_approx(gate) * up


class Gemma4MLP(nn.Module):
    def __init__(self, hidden: int, inner: int):
        super().__init__()
        self.gate_proj = nn.Linear(hidden, inner, bias=False)
        self.up_proj = nn.Linear(hidden, inner, bias=False)
        self.down_proj = nn.Linear(inner, hidden, bias=False)

    def __call__(self, x):
        return self.down_proj(nn.gelu_approx(self.gate_proj(x)) * self.up_proj(x))


class Router(nn.Module):
    """Softmax over experts of the unscaled-normed input (times `scale` / sqrt(D)), top-k,
    renormalised, then each chosen expert's `per_expert_scale`."""

    def __init__(self, args: Gemma4Args):
        super().__init__()
        d, e = args.hidden_size, args.num_experts
        self.proj = nn.Linear(d, e, bias=False)
        self.scale = mx.ones((d,))
        self.per_expert_scale = mx.ones((e,))
        self.top_k, self.eps, self.root = args.top_k_experts, args.rms_norm_eps, d ** -0.5

    def __call__(self, x: mx.array) -> tuple[mx.array, mx.array]:
        h = mx.fast.rms_norm(x, None, self.eps) * self.scale * self.root
        probs = mx.softmax(self.proj(h).astype(mx.float32), axis=-1)
        chosen = mx.argpartition(-probs, kth=self.top_k - 1, axis=-1)[..., :self.top_k]
        weights = mx.take_along_axis(probs, chosen, axis=-1)
        weights = weights / weights.sum(axis=-1, keepdims=True)
        return chosen, weights * self.per_expert_scale[chosen].astype(mx.float32)


class Experts(nn.Module):
    """Routed GELU-gated experts as one batched gather-matmul per projection (`switch_glu`,
    mlx_lm's layout: transformers' fused `gate_up_proj` is split on load)."""

    def __init__(self, args: Gemma4Args):
        super().__init__()
        self.switch_glu = SwitchGLU(args.hidden_size, args.moe_intermediate_size,
                                    args.num_experts, activation=GeluGate())

    def __call__(self, x: mx.array, chosen: mx.array, weights: mx.array) -> mx.array:
        y = self.switch_glu(x, chosen)
        return (y * weights[..., None].astype(y.dtype)).sum(axis=-2)


class Gemma4Block(nn.Module):
    def __init__(self, args: Gemma4Args, layer: int):
        super().__init__()
        d, eps, s = args.hidden_size, args.rms_norm_eps, args.specs[layer]
        self.self_attn = Gemma4Attention(args, layer)
        self.mlp = Gemma4MLP(d, args.intermediate_size * (2 if s.double_mlp else 1))
        for name in ("input_layernorm", "post_attention_layernorm", "pre_feedforward_layernorm",
                     "post_feedforward_layernorm"):
            setattr(self, name, nn.RMSNorm(d, eps=eps))
        if args.enable_moe_block:
            self.router = Router(args)
            self.experts = Experts(args)
            for name in ("post_feedforward_layernorm_1", "post_feedforward_layernorm_2",
                         "pre_feedforward_layernorm_2"):
                setattr(self, name, nn.RMSNorm(d, eps=eps))
        p = args.hidden_size_per_layer_input
        if p:
            self.per_layer_input_gate = nn.Linear(d, p, bias=False)
            self.per_layer_projection = nn.Linear(p, d, bias=False)
            self.post_per_layer_input_norm = nn.RMSNorm(d, eps=eps)
        self.layer_scalar = mx.ones((1,))
        self.sliding = s.sliding

    def feed_forward(self, h: mx.array) -> mx.array:
        f = self.mlp(self.pre_feedforward_layernorm(h))
        if "router" in self:
            chosen, weights = self.router(h)
            routed = self.experts(self.pre_feedforward_layernorm_2(h), chosen, weights)
            f = self.post_feedforward_layernorm_1(f) + self.post_feedforward_layernorm_2(routed)
        return self.post_feedforward_layernorm(f)

    def __call__(self, x, positions, mask, cache, layer, first_key, shared,
                 per_layer: Optional[mx.array] = None):
        a = self.self_attn(self.input_layernorm(x), positions, mask, cache, layer, first_key,
                           shared)
        h = x + self.post_attention_layernorm(a)
        h = h + self.feed_forward(h)
        if per_layer is not None:
            g = nn.gelu_approx(self.per_layer_input_gate(h)) * per_layer
            h = h + self.post_per_layer_input_norm(self.per_layer_projection(g))
        return h * self.layer_scalar


class Gemma4Model(Model):
    """Gemma 4's text model. `embed` returns the scaled embedding, with the PLE table's row
    of each token beside it where the model has per-layer inputs (width D + layers x P);
    `run_layers` splits them again."""

    BLOCK: ClassVar[type] = Gemma4Block

    def __init__(self, args: Gemma4Args):
        super().__init__(args)
        p = args.hidden_size_per_layer_input
        if p:
            n = args.num_hidden_layers
            self.model.embed_tokens_per_layer = nn.Embedding(args.vocab_size_per_layer_input,
                                                             n * p)
            self.model.per_layer_model_projection = nn.Linear(args.hidden_size, n * p,
                                                              bias=False)
            self.model.per_layer_projection_norm = nn.RMSNorm(p, eps=args.rms_norm_eps)

    def token_embedding(self, inputs: mx.array) -> mx.array:
        """The scaled embedding (1, L, D) alone (what an assistant drafter reads)."""
        h = self.model.embed_tokens(inputs)
        return h * mx.array(self.args.hidden_size ** 0.5, dtype=h.dtype)

    def embed(self, inputs: mx.array) -> mx.array:
        h = self.token_embedding(inputs)
        p = self.args.hidden_size_per_layer_input
        if not p:
            return h
        t = self.model.embed_tokens_per_layer(inputs)
        return mx.concatenate([h, t * mx.array(p ** 0.5, dtype=t.dtype)], axis=-1)

    def per_layer_inputs(self, h: mx.array, tokens: mx.array) -> mx.array:
        """(1, L, layers, P): the projected embedding, normed, plus the token's table row,
        times 1/sqrt(2)."""
        a, (B, L, _) = self.args, h.shape
        shape = (B, L, a.num_hidden_layers, a.hidden_size_per_layer_input)
        proj = self.model.per_layer_model_projection(h) * (a.hidden_size ** -0.5)
        proj = self.model.per_layer_projection_norm(proj.reshape(shape))
        return (proj + tokens.reshape(shape)) * (2.0 ** -0.5)

    def run_layers(self, h: mx.array, cache: Optional[LayeredCache] = None,
                   positions: Optional[mx.array] = None, mask=None) -> mx.array:
        """The decoder layers over `embed`'s output; the sliding window is built once."""
        h, per_layer = self.split_per_layer(h)
        pos, mask, local = self.block_masks(h, cache, positions, mask)
        shared: dict = {}
        for i, layer in enumerate(self.model.layers):
            lm, first = (local.mask, local.first_key) if layer.sliding else (mask, 0)
            h = layer(h, pos, lm, cache, i, first, shared,
                      None if per_layer is None else per_layer[:, :, i])
        return h

    def run_packed(self, h: mx.array, blocks: list) -> mx.array:
        """`run_layers` over several requests' rows (packed.py): per-layer inputs on all rows,
        attention and KV sharing per request (models/segments.py)."""
        h, per_layer = self.split_per_layer(h)
        full, local = self.segments(h, blocks)
        for i, layer in enumerate(self.model.layers):
            h = layer(h, None, None, local if layer.sliding else full, i, 0, {},
                      None if per_layer is None else per_layer[:, :, i])
        return h

    def split_per_layer(self, h: mx.array) -> tuple[mx.array, Optional[mx.array]]:
        """`embed`'s output as the embedding and the per-layer inputs (None without PLE)."""
        d = self.args.hidden_size
        if h.shape[-1] == d:
            return h, None
        return h[..., :d], self.per_layer_inputs(h[..., :d], h[..., d:])

    def logits(self, h: mx.array) -> mx.array:
        out = super().logits(h)
        cap = self.args.final_logit_softcapping
        return mx.tanh(out / cap) * cap if cap else out

    def slot_pool(self) -> None:
        """None: its layers hold keys and values of several shapes (a LayeredCache), so
        each request decoded together keeps its own cache."""
        return None

    def make_cache(self, max_len: Optional[int] = None,
                   dtype: Optional[mx.Dtype] = None) -> LayeredCache:
        a = self.args
        shapes = {i: (a.specs[i].kv_heads, a.specs[i].head_dim) for i in a.producers}
        return LayeredCache(shapes, max_len or a.max_position_embeddings,
                            dtype or self.model.norm.weight.dtype)

    @staticmethod
    def pipeline_refusal(args: Gemma4Args) -> Optional[str]:
        """Why --pipeline cannot split this model: a KV-shared layer reads another layer's
        keys and values and per-layer inputs feed every layer from the embedding, neither of
        which travels between ranks; and a stage's cache would have to follow the per-layer
        K/V shapes of its slice of layers, which is not built."""
        if args.num_kv_shared_layers or args.hidden_size_per_layer_input:
            return ("--pipeline does not carry Gemma 4's shared keys and values or per-layer "
                    "inputs between ranks; run this model in one process")
        return ("--pipeline does not split Gemma 4's per-layer K/V shapes over ranks yet; "
                "run this model in one process")

    def checkpoint_names(self, weights: dict, halves: Optional[Callable] = None,
                         unfuse: bool = True) -> dict:
        """A checkpoint's tensors (or header shapes) under this model's names: a multimodal
        checkpoint's text tower (`model.language_model.*`, mlx_lm's `language_model.model.*`)
        read and its other towers left out (one warning says so); the fused experts
        (`experts.gate_up_proj`, `experts.down_proj`) as mlx_lm's `experts.switch_glu.*`
        (`halves` splits a fused pair; default: arrays); the K/V weights transformers keeps
        for KV-shared layers, which never read them, dropped."""
        halves = halves or (lambda w: mx.split(w, 2, axis=-2))
        others = [k for k in weights if k.startswith(NOT_TEXT)]
        if others:
            warnings.warn(f"reading the text model only: {len(others)} vision/audio weights "
                          "left out")
        out = {}
        for name, w in weights.items():
            if name in others or "rotary_emb" in name:
                continue
            for prefix in WRAPPER_PREFIXES:
                if name.startswith(prefix):
                    name = "model." + name[len(prefix):]
            name = name.replace("language_model.lm_head.", "lm_head.")
            if self.borrowed_kv(name):
                continue
            if name.endswith(".experts.gate_up_proj"):
                prefix = name.removesuffix(".gate_up_proj")
                out[f"{prefix}.switch_glu.gate_proj.weight"], out[
                    f"{prefix}.switch_glu.up_proj.weight"] = halves(w)
            elif name.endswith(".experts.down_proj"):
                out[f"{name.removesuffix('.down_proj')}.switch_glu.down_proj.weight"] = w
            else:
                out[name] = w
        return out

    def borrowed_kv(self, name: str) -> bool:
        """Whether `name` is a K/V weight of a layer that reads another layer's K/V."""
        parts = name.split(".")
        if len(parts) < 5 or parts[:2] != ["model", "layers"] or parts[3] != "self_attn":
            return False
        layer = int(parts[2])
        return (parts[4] in ("k_proj", "v_proj", "k_norm", "v_norm")
                and self.args.specs[layer].producer != layer)

    def sanitize(self, weights: dict[str, mx.array]) -> dict[str, mx.array]:
        return self.checkpoint_names(weights)
