"""Attention over [committed context + a block of tree nodes]: the one entry point the models use.

A tree block's mask travels compactly (`tree.TreeMask`: one bit per block column per row; every
committed position is always visible). On an Apple GPU a fused Metal kernel reads the bits
directly, on an NVIDIA GPU its CUDA twin does; everywhere else (and for plain causal or
unmasked attention) MLX's `scaled_dot_product_attention` runs with the mask expanded once.
Kernel sources live in the repository's `metal/` folder and ship as package data.
"""

from __future__ import annotations

from functools import cache, lru_cache
from importlib import resources
from typing import Optional, Union

import mlx.core as mx

from .tree import TreeMask


Mask = Optional[Union[str, mx.array, TreeMask]]


def backend() -> str:
    """'metal', 'cuda' or 'cpu': which tree-attention implementation this process uses."""
    if mx.default_device().type != mx.gpu:
        return "cpu"
    if mx.metal.is_available():
        return "metal"
    return "cuda" if mx.cuda.is_available() else "cpu"


def kernel_source(name: str) -> str:
    return resources.files("treegraft_mlx.kernel_sources").joinpath(name).read_text()


@cache
def _kernel(kind: str):
    if kind == "metal":
        return mx.fast.metal_kernel(name="tree_attention",
                                    input_names=["q", "k", "v", "bits", "meta", "scale"],
                                    output_names=["out"], source=kernel_source("tree_attention.metal"),
                                    ensure_row_contiguous=False)
    return mx.fast.cuda_kernel(name="tree_attention",
                               input_names=["q", "k", "v", "bits", "meta", "scale"],
                               output_names=["out"], source=kernel_source("tree_attention.cu"),
                               ensure_row_contiguous=False)


@lru_cache(maxsize=4)
def dense_mask(mask: TreeMask) -> mx.array:
    """(rows, context + rows) boolean mask for the MLX-ops path, built once per forward (every
    layer reads the same mask object)."""
    return mx.array(mask.dense())


@lru_cache(maxsize=4)
def device_bits(mask: TreeMask) -> mx.array:
    return mx.array(mask.bits)


def fused_tree_attention(q: mx.array, k: mx.array, v: mx.array, scale: float, mask: TreeMask,
                         kind: str) -> mx.array:
    """The Metal or CUDA kernel: q (1, H, R, D) against k, v (1, H_kv, context + R, D)."""
    _, heads, rows, dim = q.shape
    out = _kernel(kind)(
        inputs=[mx.contiguous(q), k, v, device_bits(mask), mx.array([mask.context], mx.int32),
                mx.array([scale], mx.float32)],
        template=[("T", q.dtype), ("D", dim), ("GQA", heads // k.shape[1]),
                  ("W", mask.bits.shape[1])],
        grid=(32 * rows, heads, 1), threadgroup=(32, 1, 1),
        output_shapes=[q.shape], output_dtypes=[q.dtype])
    return out[0]


def tree_attention(q: mx.array, k: mx.array, v: mx.array, *, scale: float,
                   mask: Mask = None) -> mx.array:
    """Scaled dot-product attention with grouped-query heads.

    q: (1, H, L, D); k, v: (1, H_kv, S, D) with S = context + L. mask: None, "causal", an
    (L, S) boolean / additive array, or a TreeMask.
    """
    if isinstance(mask, TreeMask):
        kind = backend()
        if kind != "cpu" and q.shape[-1] % 32 == 0:
            return fused_tree_attention(q, k, v, scale, mask, kind)
        mask = dense_mask(mask)
    return mx.fast.scaled_dot_product_attention(q, k, v, scale=scale, mask=mask)
