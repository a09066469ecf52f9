"""Attention over [committed context + a block of tree nodes]: the one entry point the models use.

This is the CPU path, on MLX ops (`mx.fast.scaled_dot_product_attention` with a mask). Custom
Metal and CUDA kernels that read the tree mask compactly plug in here (see metal/README.md).
"""

from __future__ import annotations

from typing import Optional, Union

import mlx.core as mx


def tree_attention(q: mx.array, k: mx.array, v: mx.array, *, scale: float,
                   mask: Optional[Union[str, mx.array]] = None) -> mx.array:
    """Scaled dot-product attention with grouped-query heads.

    q: (1, H, L, D); k, v: (1, H_kv, S, D) with S = context + L. mask: None, "causal", or an
    (L, S) boolean (True = may attend) or additive float array.
    """
    return mx.fast.scaled_dot_product_attention(q, k, v, scale=scale, mask=mask)
