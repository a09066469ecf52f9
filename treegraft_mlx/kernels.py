"""Attention over [committed context + a block of tree nodes]: the one entry point the models use.

A tree block's mask travels compactly (`tree.TreeMask`: one bit per block column per row; every
committed position is always visible). On a GPU, our fused kernels (Metal on Apple GPUs, the
CUDA twin on NVIDIA) read the bits directly where MLX's own attention would not fuse, and for
long contexts, where a split-context kernel spreads the committed keys over many SIMD groups
(`attention_path`). Everywhere else MLX's `scaled_dot_product_attention` runs with the mask
expanded once.

No kernel is trusted with a user's output unproven: the first time a process uses a fused
kernel for a (path, dtype, head dim, GQA), it runs it on a small random problem against MLX's
own attention on the same device, and on a mismatch warns once and uses MLX's path for that
case from then on. `TREEGRAFT_ATTENTION=fused|mlx` forces either path (`auto` is the default).
Kernel sources live in the repository's `metal/` folder and ship as package data.
"""

from __future__ import annotations

import os
import warnings
from dataclasses import dataclass
from functools import cache, lru_cache
from importlib import resources
from typing import Optional, Union

import mlx.core as mx
import numpy as np

from .tree import TreeMask, attention_mask


Mask = Optional[Union[str, mx.array, TreeMask]]

# Committed positions from which the split-context kernel runs: MLX's own vector attention
# switches to its two-pass kernel at 1024 keys on large Apple GPUs. Not measured on a Mac.
LONG_CONTEXT = 1024
CHUNK_KEYS = 256  # keys per SIMD group in the split kernel
MAX_CHUNKS = 32

# name -> (inputs, outputs); body `<name>.metal` / `<name>.cu`, header `tree_attention_common`
KERNELS = {
    "tree_attention": (["q", "k", "v", "bits", "meta", "scale"], ["out"]),
    "tree_attention_partial": (["q", "k", "v", "bits", "meta", "scale"],
                               ["part_acc", "part_max", "part_sum"]),
    "tree_attention_combine": (["part_acc", "part_max", "part_sum"], ["out"]),
    "tree_attention_varlen": (["q", "k", "v", "bits", "table", "scale"], ["out"]),
}
CHECK_TOLERANCE = {mx.float32: 2e-4, mx.float16: 2e-2, mx.bfloat16: 6e-2}  # x max(1, |ref|)


def backend() -> str:
    """'metal', 'cuda' or 'cpu': which tree-attention implementation this process uses."""
    if mx.default_device().type != mx.gpu:
        return "cpu"
    if mx.metal.is_available():
        return "metal"
    return "cuda" if mx.cuda.is_available() else "cpu"


def mode() -> str:
    """TREEGRAFT_ATTENTION: 'auto' (default), 'fused' or 'mlx'."""
    value = os.environ.get("TREEGRAFT_ATTENTION", "auto").strip().lower() or "auto"
    if value not in ("auto", "fused", "mlx"):
        raise ValueError(f"TREEGRAFT_ATTENTION must be auto, fused or mlx, not {value!r}")
    return value


def mlx_fuses(kind: str, rows: int, gqa: int, head_dim: int) -> bool:
    """Whether MLX's own scaled_dot_product_attention runs a fused kernel for a block with an
    array mask (mlx `scaled_dot_product_attention.cpp`: up to 8 query rows its vector kernel
    needs rows x GQA <= 32; above, the full kernel is used for these head dims. MLX's CUDA
    backend fuses single queries only)."""
    if kind != "metal":
        return rows <= 1 and head_dim in (64, 96, 128, 256)
    if rows <= 8:
        return head_dim in (64, 96, 128, 256) and rows * gqa <= 32
    return head_dim in (64, 72, 80, 96, 128)


def attention_path(kind: str, rows: int, gqa: int, head_dim: int, context: int,
                   forced: str = "auto") -> str:
    """'split', 'fused' or 'mlx': which implementation serves a tree block."""
    if kind == "cpu" or head_dim % 32 or forced == "mlx":
        return "mlx"
    if context >= LONG_CONTEXT:
        return "split"
    if forced == "auto" and mlx_fuses(kind, rows, gqa, head_dim):
        return "mlx"
    return "fused"


def kernel_source(name: str) -> str:
    return resources.files("treegraft_mlx.kernel_sources").joinpath(name).read_text()


@cache
def _kernel(kind: str, name: str):
    """The MLX kernel object for one body (compiled by MLX on first call)."""
    inputs, outputs = KERNELS[name]
    if kind == "metal":
        return mx.fast.metal_kernel(name=name, input_names=inputs, output_names=outputs,
                                    source=kernel_source(f"{name}.metal"),
                                    header=kernel_source("tree_attention_common.metal"),
                                    ensure_row_contiguous=False)
    return mx.fast.cuda_kernel(name=name, input_names=inputs, output_names=outputs,
                               source=kernel_source(f"{name}.cu"),
                               header=kernel_source("tree_attention_common.cuh"),
                               ensure_row_contiguous=False)


# Every mask of one forward stays cached across its layers: up to two per request (its full
# and its sliding-window view), for a batch of up to 16 requests; fewer rebuilds them per layer.
MASKS_PER_FORWARD = 32


@lru_cache(maxsize=MASKS_PER_FORWARD)
def dense_mask(mask: TreeMask) -> mx.array:
    """(rows, context + rows) boolean mask for the MLX-ops path, built once per forward (every
    layer reads the same mask object)."""
    return mx.array(mask.dense())


@lru_cache(maxsize=MASKS_PER_FORWARD)
def device_bits(mask: TreeMask) -> mx.array:
    return mx.array(mask.bits)


def fused_tree_attention(q: mx.array, k: mx.array, v: mx.array, scale: float, mask: TreeMask,
                         kind: str) -> mx.array:
    """The single-pass kernel: q (1, H, R, D) against k, v (1, H_kv, context + R, D)."""
    _, heads, rows, dim = q.shape
    out = _kernel(kind, "tree_attention")(
        inputs=[mx.contiguous(q), k, v, device_bits(mask), mx.array([mask.context], mx.int32),
                mx.array([scale], mx.float32)],
        template=[("T", q.dtype), ("D", dim), ("GQA", heads // k.shape[1]),
                  ("W", mask.bits.shape[1])],
        grid=(32 * rows, heads, 1), threadgroup=(32, 1, 1),
        output_shapes=[q.shape], output_dtypes=[q.dtype])
    return out[0]


def split_tree_attention(q: mx.array, k: mx.array, v: mx.array, scale: float, mask: TreeMask,
                         kind: str, chunk: Optional[int] = None) -> mx.array:
    """The split-context pair: chunks of `chunk` keys per SIMD group, then one merge."""
    _, heads, rows, dim = q.shape
    total = mask.context + rows
    if chunk is None:
        chunk = max(CHUNK_KEYS, -(-total // MAX_CHUNKS))
    chunks = -(-total // chunk)
    template = [("T", q.dtype), ("D", dim), ("GQA", heads // k.shape[1]),
                ("W", mask.bits.shape[1])]
    part_acc, part_max, part_sum = _kernel(kind, "tree_attention_partial")(
        inputs=[mx.contiguous(q), k, v, device_bits(mask),
                mx.array([mask.context, chunk], mx.int32), mx.array([scale], mx.float32)],
        template=template, grid=(32 * rows, heads, chunks), threadgroup=(32, 1, 1),
        output_shapes=[(heads, rows, chunks, dim), (heads, rows, chunks), (heads, rows, chunks)],
        output_dtypes=[mx.float32] * 3)
    out = _kernel(kind, "tree_attention_combine")(
        inputs=[part_acc, part_max, part_sum], template=[("T", q.dtype), ("D", dim)],
        grid=(32 * rows, heads, 1), threadgroup=(32, 1, 1),
        output_shapes=[q.shape], output_dtypes=[q.dtype])
    return out[0]


@dataclass(frozen=True)
class VarlenBlocks:
    """Several requests' blocks in one attention call: per row its request's slot in the KV
    pool, committed context and block rows (`table`, (R, 3) int32), and its ancestor bits over
    its own block (`bits`, (R, W) uint32, W the widest request's words)."""

    table: np.ndarray
    bits: np.ndarray

    @classmethod
    def of(cls, blocks: list[tuple[int, TreeMask]]) -> "VarlenBlocks":
        """From each request's (slot, TreeMask), in row order."""
        width = max(m.bits.shape[1] for _, m in blocks)
        table = np.concatenate([np.tile([slot, m.context, len(m.bits)], (len(m.bits), 1))
                                for slot, m in blocks]).astype(np.int32)
        bits = np.concatenate([np.pad(m.bits, ((0, 0), (0, width - m.bits.shape[1])))
                               for _, m in blocks]).astype(np.uint32)
        return cls(table, bits)


def varlen_tree_attention(q: mx.array, k: mx.array, v: mx.array, scale: float,
                          blocks: VarlenBlocks, kind: str) -> mx.array:
    """The varlen kernel: q (1, H, R, D), every request's rows, against a KV pool k, v
    (S, H_kv, L, D), each row in its own slot (tree_attention_varlen.metal)."""
    _, heads, rows, dim = q.shape
    out = _kernel(kind, "tree_attention_varlen")(
        inputs=[mx.contiguous(q), k, v, mx.array(blocks.bits), mx.array(blocks.table),
                mx.array([scale], mx.float32)],
        template=[("T", q.dtype), ("D", dim), ("GQA", heads // k.shape[1]),
                  ("W", blocks.bits.shape[1])],
        grid=(32 * rows, heads, 1), threadgroup=(32, 1, 1),
        output_shapes=[q.shape], output_dtypes=[q.dtype])
    return out[0]


def pooled_kernel(dtype: mx.Dtype, head_dim: int, gqa: int) -> Optional[str]:
    """The GPU kind ('metal' / 'cuda') whose varlen kernel attends a packed forward's
    requests over a slot pool, or None (a CPU, a head dim it does not take, attention forced
    to MLX's, or a kernel that failed its self-check): then attention runs per request."""
    kind, forced = backend(), mode()
    if kind == "cpu" or head_dim % 32 or forced == "mlx":
        return None
    trusted = forced == "fused" or kernel_trusted(kind, "varlen", dtype, head_dim, gqa)
    return kind if trusted else None


def run_path(path: str, q: mx.array, k: mx.array, v: mx.array, scale: float, mask: TreeMask,
             kind: str, chunk: Optional[int] = None) -> mx.array:
    if path == "varlen":     # one request in slot 0 of a pool of one
        return varlen_tree_attention(q, k, v, scale, VarlenBlocks.of([(0, mask)]), kind)
    if path == "split":
        return split_tree_attention(q, k, v, scale, mask, kind, chunk)
    return fused_tree_attention(q, k, v, scale, mask, kind)


@cache
def kernel_trusted(kind: str, path: str, dtype: mx.Dtype, head_dim: int, gqa: int) -> bool:
    """Whether the fused `path` kernel matched MLX's attention on this device for this case.

    Runs once per process and case: 2 KV heads, 5 block rows of a branching tree (mask words
    span two words for the split path's 40-row block), a context that spans several chunks."""
    rng = np.random.default_rng(0)
    rows = 40 if path == "split" else 5
    context = 3 * 16 + 5 if path == "split" else 37
    mask = attention_mask([-1] + [int(rng.integers(0, i)) for i in range(1, rows)], context)
    q = mx.array(rng.standard_normal((1, 2 * gqa, rows, head_dim)).astype(np.float32)).astype(dtype)
    k, v = (mx.array(rng.standard_normal((1, 2, context + rows, head_dim)).astype(np.float32))
            .astype(dtype) for _ in range(2))
    scale = head_dim ** -0.5
    got = run_path(path, q, k, v, scale, mask, kind, chunk=16).astype(mx.float32)
    want = mx.fast.scaled_dot_product_attention(q, k, v, scale=scale,
                                                mask=dense_mask(mask)).astype(mx.float32)
    error = mx.abs(got - want).max().item()
    bound = CHECK_TOLERANCE.get(dtype, 6e-2) * max(1.0, mx.abs(want).max().item())
    if not error <= bound:  # NaN fails too
        warnings.warn(f"treegraft: the {kind} {path} tree-attention kernel differs from MLX's "
                      f"attention for {dtype}, head dim {head_dim}, GQA {gqa} (max error "
                      f"{error:.3g}); using MLX's attention for this case",
                      RuntimeWarning, stacklevel=3)
        return False
    return True


@dataclass(frozen=True)
class Window:
    """A sliding-window layer's view of a block: keys from `first_key` on, and its mask."""
    first_key: int
    mask: Mask


def windowed(mask: Mask, positions: Union[int, mx.array], context: int, rows: int,
             window: int) -> Window:
    """Restricts `mask` to keys less than `window` positions behind each row.

    Committed key j sits at position j; a block key at its row's position (tree rows carry
    their depth). Row r sees key j only if pos(j) > pos(r) - window, as transformers' sliding
    masks; committed keys no row can see are cut off (`first_key`), so a long context costs a
    window, not the whole cache. Built once per forward, shared by the sliding layers.
    """
    if context + rows - 1 < window:  # no row sits a window past any key (depth < rows)
        return Window(0, mask)
    first_key = max(0, context - window + 1)
    row_pos = (mx.arange(context, context + rows) if isinstance(positions, int)
               else positions.astype(mx.int32))
    key_pos = mx.concatenate([mx.arange(first_key, context), row_pos])
    within = key_pos[None, :] > row_pos[:, None] - window
    if mask is None:
        return Window(first_key, within)
    if isinstance(mask, str):  # "causal"
        base = mx.arange(first_key, context + rows)[None, :] <= row_pos[:, None]
    elif isinstance(mask, TreeMask):
        base = dense_mask(mask)[:, first_key:]
    elif mask.dtype == mx.bool_:
        base = mask[:, first_key:]
    else:
        raise ValueError("sliding-window layers need a boolean or causal mask")
    return Window(first_key, base & within)


def attention_ops(q: mx.array, k: mx.array, v: mx.array, scale: float, mask: Mask,
                  softcap: float) -> mx.array:
    """Attention as plain ops, for what no fused kernel does: tanh soft-capped scores (Gemma 2).

    GQA by grouping query heads per KV head; softmax in float32."""
    _, heads, rows, dim = q.shape
    kv_heads, keys = k.shape[1], k.shape[2]
    qg = q.reshape(1, kv_heads, heads // kv_heads * rows, dim) * scale
    scores = (qg @ k.swapaxes(-1, -2)).astype(mx.float32)
    scores = mx.tanh(scores / softcap) * softcap
    if isinstance(mask, TreeMask):
        mask = dense_mask(mask)
    elif isinstance(mask, str):
        mask = mx.arange(keys)[None, :] <= mx.arange(keys - rows, keys)[:, None]
    if mask is not None:
        mask = mx.tile(mask, (heads // kv_heads, 1))
        scores = (mx.where(mask, scores, -mx.inf) if mask.dtype == mx.bool_
                  else scores + mask.astype(mx.float32))
    out = mx.softmax(scores, axis=-1).astype(v.dtype) @ v
    return out.reshape(1, heads, rows, dim)


def tree_attention(q: mx.array, k: mx.array, v: mx.array, *, scale: float,
                   mask: Mask = None, softcap: Optional[float] = None) -> mx.array:
    """Scaled dot-product attention with grouped-query heads.

    q: (1, H, L, D); k, v: (1, H_kv, S, D) with S = context + L. mask: None, "causal", an
    (L, S) boolean / additive array, or a TreeMask. softcap: tanh cap on the scores (Gemma 2).
    """
    if softcap:
        return attention_ops(q, k, v, scale, mask, softcap)
    if isinstance(mask, TreeMask):
        kind, forced = backend(), mode()
        if forced == "fused" and kind == "cpu":
            raise RuntimeError("TREEGRAFT_ATTENTION=fused needs a Metal or CUDA GPU; this "
                               "process runs MLX on the CPU")
        _, heads, rows, dim = q.shape
        gqa = heads // k.shape[1]
        path = attention_path(kind, rows, gqa, dim, mask.context, forced)
        if path != "mlx" and (forced == "fused" or kernel_trusted(kind, path, q.dtype, dim, gqa)):
            return run_path(path, q, k, v, scale, mask, kind)
        mask = dense_mask(mask)
    return mx.fast.scaled_dot_product_attention(q, k, v, scale=scale, mask=mask)
