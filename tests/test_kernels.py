"""Tree attention: the CPU path against a naive reference, the compact mask, and the GPU
kernel sources compiled (not run) on this machine."""

import shutil
import subprocess
from pathlib import Path

import mlx.core as mx
import numpy as np
import pytest

from treegraft_mlx.kernels import kernel_source, tree_attention
from treegraft_mlx.tree import TreeMask
from treegraft_mlx.tree import ancestor_mask, attention_mask

SHIM = Path(__file__).parent / "shim"
INPUTS = ["q", "k", "v", "bits", "meta", "scale"]


def random_parent(rng, n):
    return np.array([-1] + [int(rng.integers(0, i)) for i in range(1, n)])


def reference(q, k, v, scale, allowed):
    """Naive attention in float64 numpy; allowed: (L, S) boolean."""
    heads, kv_heads = q.shape[1], k.shape[1]
    out = np.zeros(q.shape)
    for h in range(heads):
        kh = h // (heads // kv_heads)
        s = q[0, h] @ k[0, kh].T * scale
        s = np.where(allowed, s, -np.inf)
        p = np.exp(s - s.max(-1, keepdims=True))
        p /= p.sum(-1, keepdims=True)
        out[0, h] = p @ v[0, kh]
    return out


@pytest.mark.parametrize("seed", range(6))
def test_cpu_path_matches_reference(seed):
    rng = np.random.default_rng(seed)
    heads, kv_heads = [(4, 4), (8, 2), (6, 1)][seed % 3]
    dim = [32, 64, 128][seed % 3]
    n, context, prefix = int(rng.integers(1, 70)), int(rng.integers(0, 50)), int(rng.integers(0, 5))
    parent = random_parent(rng, n)
    rows = prefix + n
    q = rng.standard_normal((1, heads, rows, dim)).astype(np.float32)
    k = rng.standard_normal((1, kv_heads, context + rows, dim)).astype(np.float32)
    v = rng.standard_normal((1, kv_heads, context + rows, dim)).astype(np.float32)
    mask = attention_mask(parent, context, prefix)
    got = tree_attention(mx.array(q), mx.array(k), mx.array(v), scale=dim ** -0.5, mask=mask)
    allowed = np.ones((rows, context + rows), dtype=bool)
    allowed[:, context:] = False
    for i in range(rows):
        if i < prefix:
            allowed[i, context:context + i + 1] = True
        else:
            allowed[i, context:context + prefix] = True
            allowed[i, context + prefix:] = ancestor_mask(parent)[i - prefix]
    want = reference(q, k, v, dim ** -0.5, allowed)
    assert np.abs(np.array(got) - want).max() < 1e-4


def test_compact_mask_round_trip_and_dense_form():
    rng = np.random.default_rng(3)
    for n in (1, 31, 32, 33, 100, 128):
        block = ancestor_mask(random_parent(rng, n))
        m = TreeMask.from_bool(block, context=7)
        assert m.bits.dtype == np.uint32 and m.bits.shape == (n, -(-n // 32))
        assert np.array_equal(m.block(), block)
        dense = m.dense()
        assert dense.shape == (n, 7 + n) and dense[:, :7].all()
        assert np.array_equal(dense[:, 7:], block)
    # bit j of row i is word j // 32, bit j % 32 (what the kernels read)
    m = TreeMask.from_bool(np.eye(40, dtype=bool), 0)
    assert (m.bits[35, 1] >> 3) & 1 == 1 and m.bits[35, 0] == 0


METAL_PARAMS = [("const device T*", "q"), ("const device T*", "k"), ("const device T*", "v"),
                ("const device uint*", "bits"), ("const device int*", "meta"),
                ("const device float*", "scale"), ("const constant int*", "q_shape"),
                ("const constant int64_t*", "k_strides"), ("const constant int64_t*", "v_strides"),
                ("device T*", "out"), ("uint3", "threadgroup_position_in_grid"),
                ("uint", "thread_index_in_simdgroup")]


def metal_translation_unit(dtype: str, dim: int) -> str:
    """The kernel body inside a signature shaped like the one mx.fast.metal_kernel generates."""
    params = ", ".join(f"{t} {n}" for t, n in METAL_PARAMS)
    types = ", ".join(t.replace("T*", f"{dtype}*") for t, _ in METAL_PARAMS)
    return (f'#include "{SHIM / "metal_shim.h"}"\n'
            f"template <typename T, int D, int GQA, int W>\n"
            f"[[kernel]] void tree_attention({params}) {{\n{kernel_source('tree_attention.metal')}\n}}\n"
            f"template void tree_attention<{dtype}, {dim}, 4, 2>({types});\n")


@pytest.mark.skipif(shutil.which("g++") is None, reason="g++ not installed")
@pytest.mark.parametrize("dtype,dim", [("float", 64), ("half", 128), ("bfloat16_t", 64)])
def test_metal_source_compiles_under_shim(tmp_path, dtype, dim):
    src = tmp_path / "tree_attention_shim.cpp"
    src.write_text(metal_translation_unit(dtype, dim))
    r = subprocess.run(["g++", "-std=c++17", "-fsyntax-only", "-Wall", "-Werror",
                        "-Wno-attributes", str(src)],
                       capture_output=True, text=True)
    assert r.returncode == 0, r.stderr


def test_shim_catches_errors(tmp_path):
    """The shim check can fail: a body with a type error does not compile."""
    if shutil.which("g++") is None:
        pytest.skip("g++ not installed")
    bad = metal_translation_unit("float", 64).replace("d = simd_sum(d);", "d = simd_sum(d, kp);")
    src = tmp_path / "bad.cpp"
    src.write_text(bad)
    r = subprocess.run(["g++", "-std=c++17", "-fsyntax-only", str(src)], capture_output=True)
    assert r.returncode != 0


@pytest.mark.skipif(shutil.which("nvcc") is None, reason="nvcc not installed")
def test_cuda_source_compiles_with_nvcc(tmp_path):
    params = ", ".join(["const T* q", "const T* k", "const T* v", "const uint32_t* bits",
                        "const int* meta", "const float* scale", "const int32_t* q_shape",
                        "const int64_t* k_strides", "const int64_t* v_strides", "T* out"])
    src = tmp_path / "tree_attention.cu"
    src.write_text(
        f'#include "{SHIM / "cuda_prelude.cuh"}"\n'
        f"template <typename T, int D, int GQA, int W>\n"
        f"__global__ void tree_attention({params}) {{\n{kernel_source('tree_attention.cu')}\n}}\n"
        + "".join(f"template __global__ void tree_attention<{t}, {d}, 4, 2>("
                  f"const {t}*, const {t}*, const {t}*, const uint32_t*, const int*, const float*, "
                  f"const int32_t*, const int64_t*, const int64_t*, {t}*);\n"
                  for t, d in [("float", 64), ("__half", 128), ("__nv_bfloat16", 64)]))
    r = subprocess.run(["nvcc", "-c", "-arch=sm_80", "-o", str(tmp_path / "k.o"), str(src)],
                       capture_output=True, text=True, timeout=300)
    assert r.returncode == 0, r.stderr
