"""Routed experts for Mixtral and Qwen3-MoE, and the weight layout they load from.

Every token picks its top-k experts by router probability; the experts run as one batched
gather-matmul per projection (`mlx_lm`'s `SwitchGLU`, quantizable), not a Python loop over
experts. Checkpoints store one tensor per expert (`experts.<e>.w1` in Mixtral, `experts.<e>.
gate_proj` in Qwen3-MoE); they are stacked into `switch_mlp.<proj>` of shape (experts, out, in),
the layout `mlx_lm` saves, so either kind of directory loads.
"""

from __future__ import annotations

import re
from typing import Any, Callable

import mlx.core as mx
import mlx.nn as nn
from mlx_lm.models.switch_layers import SwitchGLU

# per-expert projection name -> stacked name
EXPERT_NAMES = {"w1": "gate_proj", "w3": "up_proj", "w2": "down_proj",
                "gate_proj": "gate_proj", "up_proj": "up_proj", "down_proj": "down_proj"}
EXPERT_TENSOR = re.compile(r"^(.*)\.experts\.(\d+)\.(w1|w2|w3|gate_proj|up_proj|down_proj)\."
                           r"(weight|scales|biases)$")


class MoE(nn.Module):
    """Top-k routed SwiGLU experts. Mixtral renormalises the top-k probabilities always,
    Qwen3-MoE when `norm_topk_prob` is set."""

    def __init__(self, hidden: int, expert_hidden: int, experts: int, top_k: int,
                 normalize: bool):
        super().__init__()
        self.top_k, self.normalize = top_k, normalize
        self.gate = nn.Linear(hidden, experts, bias=False)
        self.switch_mlp = SwitchGLU(hidden, expert_hidden, experts)

    def __call__(self, x: mx.array) -> mx.array:
        probs = mx.softmax(self.gate(x).astype(mx.float32), axis=-1)
        chosen = mx.argpartition(-probs, kth=self.top_k - 1, axis=-1)[..., :self.top_k]
        weights = mx.take_along_axis(probs, chosen, axis=-1)
        if self.normalize:
            weights = weights / weights.sum(axis=-1, keepdims=True)
        y = self.switch_mlp(x, chosen)
        return (y * weights[..., None].astype(y.dtype)).sum(axis=-2)


def stack_experts(weights: dict, experts: int, stack: Callable[[list], Any] = mx.stack) -> dict:
    """Stacks per-expert tensors into `switch_mlp` tensors wherever all `experts` are present.

    Incomplete groups stay as they are, so a converter reading shard by shard can carry them
    to the shard that completes them. `stack` lets the converter stack header shapes instead.
    """
    groups: dict[tuple[str, str, str], dict[int, str]] = {}
    for name in weights:
        m = EXPERT_TENSOR.match(name)
        if m:
            prefix, e, proj, kind = m.groups()
            groups.setdefault((prefix, EXPERT_NAMES[proj], kind), {})[int(e)] = name
    out = dict(weights)
    for (prefix, proj, kind), members in groups.items():
        if len(members) == experts:
            out[f"{prefix}.switch_mlp.{proj}.{kind}"] = stack(
                [out.pop(members[e]) for e in range(experts)])
    return out
