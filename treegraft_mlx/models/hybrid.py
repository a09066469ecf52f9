"""Qwen 3.5 and Qwen3-Next text models (`qwen3_5`, `qwen3_5_moe`, `qwen3_next`): Gated DeltaNet
linear attention on most layers, gated full attention on every `full_attention_interval`-th,
as transformers 5.24 defines them.

A linear-attention layer carries a recurrent state (heads x d_k x d_v) and the last K - 1
inputs of a depthwise causal convolution instead of keys and values. Verifying a draft tree
needs each row to see the state of its own root-to-node path, not of the row before it: the
layer reads the tree's parents from the compact tree mask, builds each row's convolution window
along its path, and runs the delta rule depth by depth from the parents' states (a chain, as in
a prefill, is the one-row-per-depth case). Every row's state stays pending in the cache
(`HybridCache`) until the accepted path's is committed. The models know nothing else about
trees: positions and masks come from the caller, as in decoder.py. A checkpoint's
multi-token-prediction head is built and loaded where the checkpoint carries it (mtp.py).
"""

from __future__ import annotations

import dataclasses
import warnings
from dataclasses import dataclass, field
from typing import Any, Callable, ClassVar, Optional

import mlx.core as mx
import mlx.nn as nn
import numpy as np

from ..cache import KVCache
from ..tree import TreeMask
from .decoder import MLP, Attention, Model, ModelArgs
from .gemma import GemmaRMSNorm
from .moe import MoE
from .mtp import MtpHead
from .rope import rope_spec
from .segments import Segment, Segments

FAMILIES: dict[str, dict[str, Any]] = {
    t: {"qk_norm": True} for t in ("qwen3_5", "qwen3_5_text", "qwen3_5_moe", "qwen3_5_moe_text",
                                   "qwen3_next")}
MOE_TYPES = ("qwen3_5_moe", "qwen3_5_moe_text")
# The norms stored as offsets from 1 (mlx_lm's converter adds the 1 in).
CENTRED_NORMS = (".input_layernorm.weight", ".post_attention_layernorm.weight",
                 "model.norm.weight", ".q_norm.weight", ".k_norm.weight", "mtp.norm.weight",
                 ".pre_fc_norm_hidden.weight", ".pre_fc_norm_embedding.weight")
STASH = 64      # a block's last rows whose states stay pending (a tree's rows: all of them)
SNAPSHOTS = 16  # committed lengths the recurrent state can be rewound to (HybridCache.reset)


@dataclass
class HybridArgs(ModelArgs):
    layer_types: list = field(default_factory=list)
    full_attention_interval: int = 4
    linear_num_key_heads: int = 16
    linear_num_value_heads: int = 32
    linear_key_head_dim: int = 128
    linear_value_head_dim: int = 128
    linear_conv_kernel_dim: int = 4
    shared_expert_intermediate_size: int = 0
    hidden_act: str = "silu"
    mtp_num_hidden_layers: int = 0        # the MTP head's decoder layers (0: none)

    FAMILIES: ClassVar[dict[str, dict[str, Any]]] = FAMILIES

    @classmethod
    def from_config(cls, config: dict) -> "HybridArgs":
        """A multimodal checkpoint's config nests the text model's under `text_config`."""
        if "text_config" in config:
            config = {**{k: config[k] for k in ("tie_word_embeddings", "eos_token_id")
                         if k in config}, **config["text_config"],
                      "model_type": config["model_type"]}
        return super().from_config(config)

    def derive(self, config: dict) -> None:
        if self.hidden_act != "silu":
            raise ValueError(f"unsupported hidden_act {self.hidden_act!r} for {self.model_type}")
        self.rope = rope_spec(config)
        n = self.num_hidden_layers
        if not self.layer_types:
            self.layer_types = ["full_attention" if (i + 1) % self.full_attention_interval == 0
                                else "linear_attention" for i in range(n)]
        if len(self.layer_types) != n or set(self.layer_types) - {"full_attention",
                                                                  "linear_attention"}:
            raise ValueError(f"layer_types must name {n} layers, each full_attention or "
                             f"linear_attention; got {self.layer_types}")
        self.sliding_window, self.sliding_layers = None, [False] * n
        if self.model_type in MOE_TYPES + ("qwen3_next",) and not self.num_experts:
            raise ValueError(f"{self.model_type} needs num_experts")
        self.mtp_num_hidden_layers = (self.mtp_num_hidden_layers
                                      or config.get("num_nextn_predict_layers", 0))

    def is_moe_layer(self, layer: int) -> bool:
        """Every layer in Qwen 3.5 MoE; Qwen3-Next as Qwen3-MoE decides (sparse step, MLP-only
        layers)."""
        return self.model_type in MOE_TYPES or super().is_moe_layer(layer)

    def is_linear(self, layer: int) -> bool:
        return self.layer_types[layer] == "linear_attention"

    @property
    def conv_dim(self) -> int:
        return 2 * self.linear_num_key_heads * self.linear_key_head_dim + self.value_dim

    @property
    def value_dim(self) -> int:
        return self.linear_num_value_heads * self.linear_value_head_dim


def tree_parents(mask, rows: int) -> np.ndarray:
    """Each row's parent within the block (-1: the committed context), from the tree's compact
    mask (the deepest ancestor a row sees is its parent: parents precede children); a causal
    or absent mask is a chain."""
    if mask is None or isinstance(mask, str):
        return np.arange(rows) - 1
    if not isinstance(mask, TreeMask):
        raise ValueError("a hybrid model verifies trees given as a TreeMask (tree.attention_mask)")
    seen = np.tril(mask.block(), -1)
    return np.where(seen.any(1), rows - 1 - np.argmax(seen[:, ::-1], 1), -1)


def conv_windows(parents: np.ndarray, kernel: int) -> np.ndarray:
    """(rows, kernel) indices into [committed window (kernel - 1 rows), block rows]: each row's
    convolution inputs along its own path, oldest first, the committed window where the path
    leaves the block."""
    rows = len(parents)
    idx = np.empty((rows, kernel), dtype=np.int64)
    for i in range(rows):
        node, back = i, kernel - 1
        idx[i, back] = kernel - 1 + i
        while back > 0 and parents[node] >= 0:
            node, back = parents[node], back - 1
            idx[i, back] = kernel - 1 + node
        idx[i, :back] = np.arange(kernel - 1 - back, kernel - 1)   # the window's last ones
    return idx


@dataclass(frozen=True)
class RowWalk:
    """What every linear-attention layer of one forward needs of the block's tree, derived
    once per forward (HybridModel.run_layers): each row's parent, its convolution window's
    indices, and the rows of each depth (with their parents) for the delta rule."""

    parents: np.ndarray
    windows: mx.array                     # (rows, kernel) conv_windows
    levels: list                          # per depth: (rows, their parents)

    @classmethod
    def of(cls, mask, rows: int, kernel: int) -> "RowWalk":
        parents = tree_parents(mask, rows)
        depth = np.zeros(rows, dtype=np.int64)
        for i, p in enumerate(parents):
            depth[i] = depth[p] + 1 if p >= 0 else 0
        levels = [(r, parents[r]) for r in (np.flatnonzero(depth == d)
                                            for d in range(int(depth.max(initial=-1)) + 1))]
        return cls(parents, mx.array(conv_windows(parents, kernel)), levels)


def l2_normalize(x: mx.array, eps: float = 1e-6) -> mx.array:
    return x * mx.rsqrt((x * x).sum(-1, keepdims=True) + eps)


class GatedRMSNorm(nn.Module):
    """RMSNorm of the delta rule's output, then gated by SiLU of the z projection."""

    def __init__(self, dims: int, eps: float):
        super().__init__()
        self.weight = mx.ones((dims,))
        self.eps = eps

    def __call__(self, x: mx.array, gate: mx.array) -> mx.array:
        return mx.fast.rms_norm(x, self.weight, self.eps) * nn.silu(gate.astype(mx.float32))


class DepthwiseConv(nn.Module):
    """The causal convolution's weight, (channels, 1, kernel) as transformers stores it."""

    def __init__(self, channels: int, kernel: int):
        super().__init__()
        self.weight = mx.zeros((channels, 1, kernel))


class GatedDeltaNet(nn.Module):
    def __init__(self, args: HybridArgs):
        super().__init__()
        self.hk, self.hv = args.linear_num_key_heads, args.linear_num_value_heads
        self.dk, self.dv = args.linear_key_head_dim, args.linear_value_head_dim
        self.kernel = args.linear_conv_kernel_dim
        d, key_dim = args.hidden_size, self.hk * self.dk
        self.splits = [key_dim, 2 * key_dim]
        self.in_proj_qkv = nn.Linear(d, args.conv_dim, bias=False)
        self.in_proj_z = nn.Linear(d, args.value_dim, bias=False)
        self.in_proj_b = nn.Linear(d, self.hv, bias=False)
        self.in_proj_a = nn.Linear(d, self.hv, bias=False)
        self.conv1d = DepthwiseConv(args.conv_dim, self.kernel)
        self.dt_bias = mx.ones((self.hv,))
        self.A_log = mx.zeros((self.hv,))
        self.norm = GatedRMSNorm(self.dv, args.rms_norm_eps)
        self.out_proj = nn.Linear(args.value_dim, d, bias=False)

    def __call__(self, x: mx.array, walk: RowWalk, cache: Optional["HybridCache"],
                 layer: int) -> mx.array:
        L = x.shape[1]
        inputs = self.in_proj_qkv(x)[0]                                  # (L, conv_dim)
        beta = mx.sigmoid(self.in_proj_b(x)[0].astype(mx.float32))      # (L, hv)
        decay = mx.exp(-mx.exp(self.A_log.astype(mx.float32))
                       * nn.softplus(self.in_proj_a(x)[0].astype(mx.float32) + self.dt_bias))
        if isinstance(cache, Segments):  # a packed forward: per request from here on
            out = cache.each(lambda s, i, b, d: self.recur(i, b, d, s.walk, s.cache, layer),
                             inputs, beta, decay, axis=0)
        else:
            out = self.recur(inputs, beta, decay, walk, cache, layer)
        z = self.in_proj_z(x).reshape(1, L, self.hv, self.dv)
        y = self.norm(out[None], z).astype(x.dtype)
        return self.out_proj(y.reshape(1, L, -1))

    def recur(self, inputs: mx.array, beta: mx.array, decay: mx.array, walk: RowWalk,
              cache: Optional["HybridCache"], layer: int) -> mx.array:
        """One request's rows from its committed state: each row's convolution over its own
        path's last `kernel` inputs, then the delta rule; the rows' states stay pending in
        its cache. Returns the outputs (L, hv, dv)."""
        L = inputs.shape[0]
        window, state = (cache.recurrent(layer) if cache is not None
                         else (mx.zeros((self.kernel - 1, inputs.shape[-1]), inputs.dtype),
                               mx.zeros((self.hv, self.dk, self.dv), mx.float32)))
        src = mx.concatenate([window.astype(inputs.dtype), inputs])
        taps = src[walk.windows]                                         # (L, K, conv_dim)
        w = self.conv1d.weight[:, 0, :].T                                # (K, conv_dim)
        mixed = nn.silu((taps * w).sum(1))
        q, k, v = mx.split(mixed.astype(mx.float32), self.splits, axis=-1)
        rep = self.hv // self.hk
        q = mx.repeat(l2_normalize(q.reshape(L, self.hk, self.dk)), rep, axis=1) * self.dk ** -0.5
        k = mx.repeat(l2_normalize(k.reshape(L, self.hk, self.dk)), rep, axis=1)
        v = v.reshape(L, self.hv, self.dv)
        states, out = delta_rule_tree(walk, state, q, k, v, beta, decay)
        if cache is not None:
            cache.stash(layer, inputs, states, walk.parents)
        return out


def delta_rule_tree(walk: RowWalk, state: mx.array, q, k, v, beta, decay
                    ) -> tuple[list[mx.array], mx.array]:
    """The gated delta rule per row, each from its parent's state (the committed `state` for a
    row whose parent is outside the block), depth by depth: S = decay * S_parent; S += k (beta
    (v - S^T k))^T; out = S^T q. Returns every row's state (hv, dk, dv) and the outputs (L, hv,
    dv)."""
    states: list[Optional[mx.array]] = [None] * len(walk.parents)
    outs: list[Optional[mx.array]] = [None] * len(walk.parents)
    for rows, parents in walk.levels:
        idx = mx.array(rows)
        prev = mx.stack([state if p < 0 else states[p] for p in parents])
        s = prev * decay[idx][:, :, None, None]
        kr, vr = k[idx], v[idx]
        remembered = (s * kr[..., None]).sum(-2)                          # (n, hv, dv)
        s = s + kr[..., None] * ((vr - remembered) * beta[idx][..., None])[:, :, None, :]
        o = (s * q[idx][..., None]).sum(-2)
        for j, r in enumerate(rows):
            states[r], outs[r] = s[j], o[j]
    return states, mx.stack(outs)


class GatedAttention(Attention):
    """Full attention whose q projection also yields a per-head output gate (sigmoid), with
    zero-centred q/k norms and partial rotary embedding."""

    def __init__(self, args: HybridArgs):
        super().__init__(args, norm=GemmaRMSNorm)
        hd, bias = self.head_dim, args.attention_bias
        self.q_proj = nn.Linear(args.hidden_size, 2 * self.n_heads * hd, bias=bias)
        self.o_proj = nn.Linear(self.n_heads * hd, args.hidden_size, bias=bias)

    def __call__(self, x, positions, mask, cache, layer, first_key=0):
        B, L, _ = x.shape
        q, gate = mx.split(self.q_proj(x).reshape(B, L, self.n_heads, 2 * self.head_dim), 2, -1)
        out = self.attend(q, self.k_proj(x), self.v_proj(x), positions, mask, cache, layer)
        return self.o_proj(out * mx.sigmoid(gate.reshape(B, L, -1)))


class SharedExpertMoE(MoE):
    """Routed experts plus one always-on shared expert, scaled by its sigmoid gate."""

    def __init__(self, args: HybridArgs):
        super().__init__(args.hidden_size, args.moe_intermediate_size, args.num_experts,
                         args.num_experts_per_tok,
                         args.model_type in MOE_TYPES or args.norm_topk_prob)
        self.shared_expert = MLP(dataclasses.replace(
            args, intermediate_size=args.shared_expert_intermediate_size))
        self.shared_expert_gate = nn.Linear(args.hidden_size, 1, bias=False)

    def __call__(self, x: mx.array) -> mx.array:
        return super().__call__(x) + mx.sigmoid(self.shared_expert_gate(x)) * self.shared_expert(x)


class HybridBlock(nn.Module):
    def __init__(self, args: HybridArgs, layer: int):
        super().__init__()
        self.linear = args.is_linear(layer)
        if self.linear:
            self.linear_attn = GatedDeltaNet(args)
        else:
            self.self_attn = GatedAttention(args)
        self.mlp = SharedExpertMoE(args) if args.is_moe_layer(layer) else MLP(args)
        self.input_layernorm = GemmaRMSNorm(args.hidden_size, eps=args.rms_norm_eps)
        self.post_attention_layernorm = GemmaRMSNorm(args.hidden_size, eps=args.rms_norm_eps)

    def __call__(self, x, positions, mask, cache, layer, walk: RowWalk):
        h = self.input_layernorm(x)
        if self.linear:
            h = x + self.linear_attn(h, walk, cache, layer)
        else:
            h = x + self.self_attn(h, positions, mask, cache, layer)
        return h + self.mlp(self.post_attention_layernorm(h))


class HybridModel(Model):
    BLOCK: ClassVar[type] = HybridBlock
    NORM: ClassVar[type] = GemmaRMSNorm
    RECURRENT: ClassVar[bool] = True
    # The decay parameters the recurrent state compounds every token: kept in fp32, as
    # mlx_lm keeps A_log (bf16 rounding would compound through every step).
    FULL_PRECISION: ClassVar[tuple[str, ...]] = ("A_log", "dt_bias")

    def run_layers(self, h: mx.array, cache: Optional["HybridCache"] = None,
                   positions: Optional[mx.array] = None, mask=None) -> mx.array:
        """The decoder layers; the block's tree walk is derived once for all linear layers
        (no sliding windows here)."""
        pos, mask, walk = self.block_walk(h.shape[1], cache, positions, mask)
        for i, layer in enumerate(self.model.layers):
            h = layer(h, pos, mask, cache, i, walk)
        return h

    def block_walk(self, rows: int, cache: Optional["HybridCache"],
                   positions: Optional[mx.array], mask) -> tuple:
        """A block's positions, its mask (causal by default for several rows) and its tree
        walk."""
        pos = (cache.offset if cache is not None else 0) if positions is None else positions
        walk = RowWalk.of(mask, rows, self.args.linear_conv_kernel_dim)
        if mask is None and rows > 1:
            mask = "causal"
        return pos, mask, walk

    def run_packed(self, h: mx.array, blocks: list) -> mx.array:
        """`run_layers` over several requests' rows (packed.py): each request's tree walk and
        mask as a forward of it alone derives them; attention and the recurrent layers' delta
        rule per request (models/segments.py), everything else on all rows."""
        parts, start = [], 0
        for b in blocks:
            pos, mask, walk = self.block_walk(b.rows, b.cache, b.positions, b.mask)
            parts.append(Segment(start, start + b.rows, b.cache, pos, mask, walk=walk))
            start += b.rows
        segments = Segments(parts)
        for i, layer in enumerate(self.model.layers):
            h = layer(h, None, None, segments, i, None)
        return h

    def slot_pool(self) -> None:
        """None: its recurrent layers' states are not keys and values, so each request
        decoded together keeps its own cache."""
        return None

    def make_cache(self, max_len: Optional[int] = None,
                   dtype: Optional[mx.Dtype] = None) -> "HybridCache":
        a = self.args
        dtype = dtype or self.model.norm.weight.dtype
        return HybridCache(a, max_len or a.max_position_embeddings, dtype)

    def checkpoint_names(self, weights: dict, halves: Optional[Callable] = None,
                         unfuse: bool = True) -> dict:
        """A released checkpoint's tensors (or header shapes) under this model's names. A
        multimodal checkpoint's text tower is read and its vision weights left out (one warning
        says so); the multi-token-prediction head (`mtp.*`) is kept as it is; experts stored
        fused (`experts.gate_up_proj`, as the Qwen 3.5 MoE releases) are
        split into the stacked layout by `halves` (default: arrays). Qwen3-Next's fused
        `in_proj_qkvz` / `in_proj_ba` (grouped per key head) become Qwen 3.5's four
        projections (unless not to `unfuse`), so one layer serves both; given header shapes,
        only shapes move."""
        if self.args.model_type == "qwen3_next" and unfuse:
            weights = self.unfused(weights, shapes=halves is not None)
        halves = halves or (lambda w: mx.split(w, 2, axis=-2))
        vision = [k for k in weights if k.startswith(("model.visual", "vision_tower"))]
        if vision:
            warnings.warn(f"reading the text model only: {len(vision)} vision weights left out")
        out = {}
        for name, w in weights.items():
            if name in vision:
                continue
            name = name.replace("model.language_model.", "model.").removeprefix("language_model.")
            if name.endswith(".experts.gate_up_proj"):
                prefix = name.removesuffix(".experts.gate_up_proj")
                out[f"{prefix}.switch_mlp.gate_proj.weight"], out[
                    f"{prefix}.switch_mlp.up_proj.weight"] = halves(w)
            elif name.endswith(".experts.down_proj"):
                out[f"{name.removesuffix('.experts.down_proj')}.switch_mlp.down_proj.weight"] = w
            else:
                out[name] = w
        return out

    def unfused(self, weights: dict, shapes: bool) -> dict:
        """Qwen3-Next's grouped projections as Qwen 3.5 lays them out: per key head g, the
        rows [q_g, k_g, v_g, z_g] and [b_g, a_g] regrouped into [q; k; v], [z], [b], [a]
        (weights, and the scales and biases of a quantized one, row for row)."""
        a = self.args
        r = a.linear_num_value_heads // a.linear_num_key_heads
        qkvz = (a.linear_key_head_dim, a.linear_key_head_dim, r * a.linear_value_head_dim,
                r * a.linear_value_head_dim)
        out = {}
        for name, w in weights.items():
            for fused, sizes, parts in ((".in_proj_qkvz.", qkvz, ("qkv", "qkv", "qkv", "z")),
                                        (".in_proj_ba.", (r, r), ("b", "a"))):
                if fused in name:
                    pieces = grouped_rows(w, a.linear_num_key_heads, sizes, shapes)
                    for part in dict.fromkeys(parts):
                        mine = [p for p, n in zip(pieces, parts) if n == part]
                        out[name.replace(fused, f".in_proj_{part}.")] = (
                            [sum(p[0] for p in mine), *mine[0][1:]] if shapes
                            else mx.concatenate(mine))
                    break
            else:
                out[name] = w
        return out

    def sanitize(self, weights: dict[str, mx.array]) -> dict[str, mx.array]:
        """Checkpoint names -> this model's (`checkpoint_names`, then experts stacked); the MTP
        head is built where the checkpoint carries one (`adopt_mtp`). An `mlx_lm`-converted
        directory stores the convolution as (channels, kernel, 1) and the zero-centred norms
        with their 1 added: both are undone."""
        out = self.adopt_mtp(self.checkpoint_names(weights))
        k = self.args.linear_conv_kernel_dim
        converted = any(n.endswith("conv1d.weight") and w.shape[-1] != k for n, w in out.items())
        if converted:
            out = {name: (w.transpose(0, 2, 1) if name.endswith("conv1d.weight") else
                          w - 1.0 if name.endswith(CENTRED_NORMS) and w.ndim == 1 else w)
                   for name, w in out.items()}
        return super().sanitize(out)

    def adopt_mtp(self, weights: dict) -> dict:
        """Builds the MTP head (`self.mtp`) where the config names one and the checkpoint
        carries its weights (mlx_lm's converter drops them but keeps the config key, so the
        weights decide); returns the weights this model then reads, the head's left out where
        it is not built (a head of more than one layer: one warning says so)."""
        names = [n for n in weights if n.startswith("mtp.")]
        layers = self.args.mtp_num_hidden_layers
        if names and layers == 1:
            full = dataclasses.replace(self.args, layer_types=["full_attention"])
            self.mtp = MtpHead(self.args.hidden_size, self.args.rms_norm_eps,
                               HybridBlock(full, 0))
            return weights
        if names and layers > 1:
            warnings.warn(f"the MTP head has {layers} layers; only one-layer heads (every "
                          f"released Qwen 3.5 / Qwen3-Next head) run: its weights are left out")
        return {n: w for n, w in weights.items() if n not in names}


def grouped_rows(w, groups: int, sizes: tuple, shapes: bool) -> list:
    """The rows of w, laid out as `groups` repeats of blocks of `sizes`, as one piece per
    size with every group's block of it in order (a shape: its rows counted)."""
    if shapes:
        return [[groups * n, *w[1:]] for n in sizes]
    blocks = w.reshape(groups, sum(sizes), *w.shape[1:])
    cuts = np.cumsum(sizes)[:-1].tolist()
    return [b.reshape(groups * n, *w.shape[1:])
            for b, n in zip(mx.split(blocks, cuts, axis=1), sizes)]


@dataclass
class Recurrent:
    """One linear-attention layer's committed state and the block pending after it."""

    window: mx.array                       # (K - 1, conv_dim): the last committed inputs
    state: mx.array                        # (hv, dk, dv)
    inputs: Optional[mx.array] = None      # (L, conv_dim): the pending block's inputs
    states: list = field(default_factory=list)   # the pending rows' states (last STASH kept)
    first: int = 0                         # block row of states[0]
    parents: Optional[np.ndarray] = None


class HybridCache:
    """The cache of a hybrid model: keys and values of its full-attention layers (a KVCache)
    and, per linear-attention layer, the recurrent state and convolution window. A forward
    leaves its block pending; `commit` and `keep` take the state of the last row kept (which
    must be a path from the block's first row), and record where the state may later be
    rewound to: a recurrent state cannot be truncated, so `reset` restores one of the last
    SNAPSHOTS committed lengths (`rewindable` says which)."""

    def __init__(self, args: HybridArgs, max_len: int, dtype: mx.Dtype):
        self.args, self.max_len = args, max_len
        self.attention = [i for i in range(args.num_hidden_layers) if not args.is_linear(i)]
        self.slot = {layer: j for j, layer in enumerate(self.attention)}
        self.kv = KVCache(len(self.attention), args.num_key_value_heads, args.head_dim,
                          max_len, dtype)
        self.linear = [i for i in range(args.num_hidden_layers) if args.is_linear(i)]
        self.dtype = dtype
        self.layers: dict[int, Recurrent] = {}
        self.snapshots: dict[int, dict[int, tuple[mx.array, mx.array]]] = {}
        self._clear()

    def _clear(self) -> None:
        a = self.args
        zero_window = mx.zeros((a.linear_conv_kernel_dim - 1, a.conv_dim), self.dtype)
        zero_state = mx.zeros((a.linear_num_value_heads, a.linear_key_head_dim,
                               a.linear_value_head_dim), mx.float32)
        self.layers = {i: Recurrent(zero_window, zero_state) for i in self.linear}
        self.snapshots = {0: self._snapshot()}

    def _snapshot(self) -> dict[int, tuple[mx.array, mx.array]]:
        return {i: (r.window, r.state) for i, r in self.layers.items()}

    @property
    def offset(self) -> int:
        return self.kv.offset

    @property
    def pending(self) -> int:
        return self.kv.pending

    def write(self, layer: int, k: mx.array, v: mx.array) -> tuple[mx.array, mx.array]:
        return self.kv.write(self.slot[layer], k, v)

    def recurrent(self, layer: int) -> tuple[mx.array, mx.array]:
        """The committed convolution window and state a forward of `layer` starts from."""
        r = self.layers[layer]
        return r.window, r.state

    def stash(self, layer: int, inputs: mx.array, states: list, parents: np.ndarray) -> None:
        """A forward's block for `layer`: its inputs, its rows' states, its tree."""
        r = self.layers[layer]
        r.inputs, r.parents = inputs, parents
        r.first = max(0, len(states) - STASH)
        r.states = states[r.first:]
        if not self.attention:      # no full-attention layer's write opened the block
            self.kv.pend(inputs.shape[0])

    def commit(self, n: Optional[int] = None) -> None:
        """Commit the first n rows of the pending block (all of it by default): a chain."""
        n = self.pending if n is None else n
        self._advance(list(range(n)))
        self.kv.commit(n)

    def keep(self, rows) -> None:
        """Commit the given rows of the pending block: a path from its first row."""
        rows = [int(r) for r in rows]
        self._advance(rows)
        self.kv.keep(rows)

    def _advance(self, rows: list[int]) -> None:
        """The committed state becomes the last row's; the lengths before its last two rows
        are recorded for `reset` (a drafter's chain rewinds to the row before its root)."""
        K, start = self.args.linear_conv_kernel_dim, self.offset
        for r in self.layers.values():
            if rows and r.inputs is not None:
                parents = r.parents
                if parents[rows[0]] >= 0 or any(parents[b] != a for a, b in zip(rows, rows[1:])):
                    raise ValueError(f"rows {rows} are not a path from the block's first row")
                if min(rows[-2:]) < r.first:
                    raise ValueError(f"rows {rows[-2:]}: states not kept (the last {STASH} are)")
        if rows and self.linear and self.layers[self.linear[0]].inputs is not None:
            for n in range(max(1, len(rows) - 1), len(rows) + 1):
                self.snapshots[start + n] = {
                    i: (mx.concatenate([r.window, r.inputs[mx.array(rows[:n])].astype(
                        r.window.dtype)])[-(K - 1):], r.states[rows[n - 1] - r.first])
                    for i, r in self.layers.items()}
            for i, (window, state) in self.snapshots[start + len(rows)].items():
                self.layers[i] = Recurrent(window, state)
        else:
            for r in self.layers.values():
                r.inputs, r.states, r.parents = None, [], None
        for old in sorted(self.snapshots)[:-SNAPSHOTS]:
            if old:
                del self.snapshots[old]

    def rewindable(self, length: int) -> int:
        """The longest committed length at most `length` that `reset` can return to."""
        return max(s for s in self.snapshots if s <= length)

    def reset(self, length: int = 0) -> None:
        """Truncate the committed context to `length` tokens, one `rewindable` names."""
        if length == self.offset:
            self.kv.reset(length)
            return
        if length not in self.snapshots:
            raise ValueError(f"the recurrent state cannot be rewound to {length} tokens; "
                             f"the nearest is {self.rewindable(length)}")
        self.kv.reset(length)
        for i, (window, state) in self.snapshots[length].items():
            self.layers[i] = Recurrent(window, state)
        self.snapshots = {s: v for s, v in self.snapshots.items() if s <= length}

    def state(self) -> list[mx.array]:
        return self.kv.state() + [a for r in self.layers.values() for a in (r.window, r.state)]

    @property
    def nbytes(self) -> int:
        return sum(a.nbytes for a in self.state())

    def node_bytes(self) -> int:
        """Memory one pending tree row adds: its state and inputs in every linear layer."""
        a = self.args
        return len(self.linear) * 4 * (a.linear_num_value_heads * a.linear_key_head_dim
                                       * a.linear_value_head_dim + a.conv_dim)
