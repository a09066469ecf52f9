"""Rotary position embeddings: the settings as either transformers version writes them, and RoPE.

transformers 4.x wrote `rope_theta` and `rope_scaling` at the top level of config.json;
transformers 5 writes `rope_parameters` (with `rope_theta` inside, and for models with several
layer types, one entry per type). `rope_spec` reads both into one `RopeSpec`; a `rope_type` it
does not know is an error, never a silent default.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from typing import Optional, Union

import mlx.core as mx
import mlx.nn as nn

KINDS = ("default", "linear", "llama3", "longrope")
ALIASES = {"su": "longrope"}  # Phi-3's first configs called longrope "su"
LAYER_TYPES = ("full_attention", "sliding_attention")

Positions = Union[int, mx.array]


@dataclass(frozen=True)
class RopeSpec:
    theta: float = 10000.0
    kind: str = "default"
    params: dict = field(default_factory=dict)  # the scaling's own keys (factor, ...)
    partial_rotary_factor: float = 1.0


def rope_spec(config: dict, layer_type: Optional[str] = None, default_theta: float = 10000.0,
              legacy_theta_key: str = "rope_theta") -> RopeSpec:
    """The RoPE settings of a config (either form), for one layer type where they differ.

    legacy_theta_key: where a 4.x config keeps this layer type's base (Gemma 3's sliding
    layers: `rope_local_base_freq`, and its scaling applies to the full layers only).
    """
    parameters = config.get("rope_parameters")
    if parameters:
        if any(t in parameters for t in LAYER_TYPES):
            parameters = parameters.get(layer_type or "full_attention") or {}
        theta = parameters.get("rope_theta", config.get(legacy_theta_key) or default_theta)
        scaling = parameters
    else:
        theta = config.get(legacy_theta_key) or default_theta
        scaling = {} if legacy_theta_key != "rope_theta" else (config.get("rope_scaling") or {})
    kind = scaling.get("rope_type", scaling.get("type", "default"))
    kind = ALIASES.get(kind, kind)
    if kind not in KINDS:
        raise ValueError(f"unsupported rope_type {kind!r} (supported: {', '.join(KINDS)})")
    params = {k: v for k, v in scaling.items() if k not in ("rope_type", "type", "rope_theta",
                                                          "partial_rotary_factor")}
    if kind == "longrope":
        params.setdefault("original_max_position_embeddings",
                          config.get("original_max_position_embeddings"))
    partial = scaling.get("partial_rotary_factor", config.get("partial_rotary_factor", 1.0))
    return RopeSpec(float(theta), kind, params, float(partial))


def legacy_keys(spec: RopeSpec) -> dict:
    """`rope_theta` / `rope_scaling` as transformers 4.x and mlx_lm read them."""
    scaling = (None if spec.kind == "default"
               else {"rope_type": spec.kind, "type": spec.kind, **spec.params})
    return {"rope_theta": spec.theta, "rope_scaling": scaling}


class RoPE(nn.Module):
    """Rotary embedding at a contiguous offset or at an arbitrary position per token.

    Per-token positions reuse `mx.fast.rope` by moving tokens onto the batch axis, where
    offsets may differ per row. longrope (Phi-3) uses its short factors while every position of
    a forward lies inside the original window and its long factors beyond, as transformers
    does, and scales the rotated dims by its attention factor.
    """

    def __init__(self, spec: RopeSpec, head_dim: int, max_position_embeddings: int):
        super().__init__()
        self.dims = int(head_dim * spec.partial_rotary_factor)
        self.base: Optional[float] = spec.theta
        self.scale = 1.0
        self.input_scale = 1.0
        self._freqs = self._long_freqs = None
        self.window = None  # longrope: positions below this use the short factors
        p = spec.params
        if spec.kind == "linear":
            self.scale = 1.0 / p["factor"]
        elif spec.kind == "llama3":
            self._freqs = llama3_freqs(self.dims, spec.theta, p)
            self.base = None
        elif spec.kind == "longrope":
            original = p["original_max_position_embeddings"]
            powers = spec.theta ** (mx.arange(0, self.dims, 2, dtype=mx.float32) / self.dims)
            self._freqs = mx.array(p["short_factor"], dtype=mx.float32) * powers
            self._long_freqs = mx.array(p["long_factor"], dtype=mx.float32) * powers
            self.window, self.base = original, None
            factor = p.get("factor") or max_position_embeddings / original
            self.input_scale = p.get("attention_factor") or (
                1.0 if factor <= 1.0 else math.sqrt(1 + math.log(factor) / math.log(original)))

    def __call__(self, x: mx.array, positions: Positions) -> mx.array:
        freqs = self._freqs
        if self.window is not None:
            if isinstance(positions, int):
                long = positions + x.shape[2] > self.window
                freqs = self._long_freqs if long else self._freqs
            else:       # chosen on the device: reading the maximum back would wait on it
                long = positions.max() + 1 > self.window
                freqs = mx.where(long, self._long_freqs, self._freqs)
        if self.input_scale != 1.0:
            x = mx.concatenate([x[..., :self.dims] * self.input_scale, x[..., self.dims:]], -1)
        kwargs = dict(traditional=False, base=self.base, scale=self.scale, freqs=freqs)
        if isinstance(positions, int):
            return mx.fast.rope(x, self.dims, offset=positions, **kwargs)
        # x: (1, H, L, D) -> (L, H, 1, D): one token per batch row, one offset per row.
        y = mx.fast.rope(x.transpose(2, 1, 0, 3), self.dims, offset=positions, **kwargs)
        return y.transpose(2, 1, 0, 3)


def llama3_freqs(dims: int, base: float, cfg: dict) -> mx.array:
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
