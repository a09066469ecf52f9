"""Attention over [committed context + a block of tree nodes]: the one entry point the models use.

A tree block's mask travels compactly (`TreeMask`: one bit per block column per row; every
committed position is always visible). On an Apple GPU a fused Metal kernel reads the bits
directly, on an NVIDIA GPU its CUDA twin does; everywhere else (and for plain causal or
unmasked attention) MLX's `scaled_dot_product_attention` runs with the mask expanded once.
Kernel sources live in the repository's `metal/` folder and ship as package data.
"""

from __future__ import annotations

from dataclasses import dataclass
from functools import cache, cached_property
from importlib import resources
from typing import Optional, Union

import mlx.core as mx
import numpy as np


@dataclass(frozen=True, eq=False)
class TreeMask:
    """Row i of a block sees [0, context) and the block columns whose bit is set in bits[i]."""

    context: int
    bits: np.ndarray  # (rows, words) uint32, little-endian bit order within each word

    @classmethod
    def from_bool(cls, block: np.ndarray, context: int) -> "TreeMask":
        """From a (rows, rows) boolean block mask."""
        rows = block.shape[0]
        words = max(1, -(-rows // 32))
        padded = np.zeros((rows, words * 32), dtype=bool)
        padded[:, :rows] = block
        packed = np.packbits(padded, axis=1, bitorder="little")
        return cls(context, np.ascontiguousarray(packed).view(np.uint32).reshape(rows, words))

    @property
    def rows(self) -> int:
        return self.bits.shape[0]

    def block(self) -> np.ndarray:
        """The (rows, rows) boolean block mask these bits encode."""
        unpacked = np.unpackbits(self.bits.view(np.uint8), axis=1, bitorder="little")
        return unpacked[:, :self.rows].astype(bool)

    @cached_property
    def dense(self) -> mx.array:
        """(rows, context + rows) boolean mask for the MLX-ops path (built once per forward)."""
        m = np.ones((self.rows, self.context + self.rows), dtype=bool)
        m[:, self.context:] = self.block()
        return mx.array(m)

    @cached_property
    def device_bits(self) -> mx.array:
        return mx.array(self.bits)


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


def fused_tree_attention(q: mx.array, k: mx.array, v: mx.array, scale: float, mask: TreeMask,
                         kind: str) -> mx.array:
    """The Metal or CUDA kernel: q (1, H, R, D) against k, v (1, H_kv, context + R, D)."""
    _, heads, rows, dim = q.shape
    out = _kernel(kind)(
        inputs=[mx.contiguous(q), k, v, mask.device_bits, mx.array([mask.context], mx.int32),
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
        mask = mask.dense
    return mx.fast.scaled_dot_product_attention(q, k, v, scale=scale, mask=mask)
