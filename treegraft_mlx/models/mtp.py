"""The multi-token-prediction head Qwen 3.5 and Qwen3-Next checkpoints ship (`mtp.*`): one
full-attention decoder layer that drafts the token after next from the target's own hidden
state, as vLLM's and SGLang's Qwen3-Next / Qwen 3.5 MTP modules define it.

A row pairs the target's final hidden state at position p (after the target's final norm,
the vector its lm_head reads) with the embedding of the token at p + 1; both are normed
(zero-centred RMSNorms, like the rest of the model), concatenated [embedding, hidden],
projected from 2H to H (`fc`, no bias), run through the decoder layer at RoPE position p
with the head's own KV cache, and normed (`norm`). The target's lm_head turns the result
into the logits of token p + 2; the normed result itself stands in for the target's hidden
state of the next row when the head drafts deeper (docs/design.md §19).
"""

from __future__ import annotations

from typing import Optional

import mlx.core as mx
import mlx.nn as nn

from ..cache import KVCache
from .gemma import GemmaRMSNorm
from .rope import Positions


class MtpHead(nn.Module):
    """The head's parameters under the checkpoint's names (`mtp.fc`, `mtp.pre_fc_norm_*`,
    `mtp.layers.0`, `mtp.norm`). `block` is the target's full-attention decoder layer of
    index 0 (gated attention, and the MLP or MoE the target has there). One layer, as every
    released head has; vLLM would run a head of n layers one layer per draft depth, SGLang
    not at all, so a head of more is not built (HybridModel.adopt_mtp)."""

    def __init__(self, hidden: int, eps: float, block: nn.Module):
        super().__init__()
        self.fc = nn.Linear(2 * hidden, hidden, bias=False)
        self.pre_fc_norm_embedding = GemmaRMSNorm(hidden, eps=eps)
        self.pre_fc_norm_hidden = GemmaRMSNorm(hidden, eps=eps)
        self.layers = [block]
        self.norm = GemmaRMSNorm(hidden, eps=eps)

    def __call__(self, embedded: mx.array, hidden: mx.array, cache: Optional[KVCache],
                 positions: Positions) -> mx.array:
        """(1, L, H) outputs of rows pairing `embedded` (the next tokens' embeddings) with
        `hidden` (the target's normed final hidden states, or this head's own outputs), after
        the cache's rows; the block stays pending in the cache."""
        x = self.fc(mx.concatenate([self.pre_fc_norm_embedding(embedded),
                                    self.pre_fc_norm_hidden(hidden)], axis=-1))
        mask = "causal" if x.shape[1] > 1 else None
        return self.norm(self.layers[0](x, positions, mask, cache, 0, None))

    def make_cache(self, n_kv_heads: int, head_dim: int, max_len: int,
                   dtype: mx.Dtype) -> KVCache:
        return KVCache(len(self.layers), n_kv_heads, head_dim, max_len, dtype)
