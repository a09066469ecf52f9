"""Tree attention: the CPU path and the compact mask against a naive reference; the Metal and CUDA
kernels executed as written under CPU emulation (tests/gpu_emulation.py) against the same
reference; the dispatch between our kernels and MLX's; the first-use self-check and its
fallback."""

import shutil
import subprocess
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass

import mlx.core as mx
import numpy as np
import pytest

from treegraft_mlx import kernels
from treegraft_mlx.kernels import KERNELS, attention_path, kernel_source, mlx_fuses, tree_attention
from treegraft_mlx.tree import TreeMask, ancestor_mask, attention_mask

from gpu_emulation import SHIM, EmulatedKernel, EmulationError

needs_compiler = pytest.mark.skipif(shutil.which("g++") is None, reason="g++ not installed")
MX_DTYPES = {"float32": mx.float32, "float16": mx.float16, "bfloat16": mx.bfloat16}
TOLERANCE = {"float32": 1e-4, "float16": 2e-3, "bfloat16": 1.6e-2}  # x max(1, |reference|)


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


# --- the kernels, executed under emulation ------------------------------------------------


def emulated_kernel(kind: str, name: str, mutate=None) -> EmulatedKernel:
    """Our kernel `name` for `kind` ('metal' / 'cuda') as MLX would build it, run on the CPU."""
    body, header = ((f"{name}.metal", "tree_attention_common.metal") if kind == "metal"
                    else (f"{name}.cu", "tree_attention_common.cuh"))
    source, header = kernel_source(body), kernel_source(header)
    if mutate is not None:
        source, header = mutate(source), mutate(header)
    inputs, outputs = KERNELS[name]
    return EmulatedKernel(kind, name, inputs, outputs, source, header, ensure_row_contiguous=False)


@dataclass(frozen=True)
class Case:
    dtype: str
    dim: int
    gqa: int
    kv_heads: int
    nodes: int  # tree nodes in the block, after `prefix` causal rows
    context: int
    layout: str  # contiguous | capacity (cache with room to spare) | transposed (1, S, H_kv, D)
    path: str = "fused"  # or "split"
    chunk: int = 0  # split: keys per chunk
    prefix: int = 0

    @property
    def rows(self) -> int:
        return self.prefix + self.nodes

    def __str__(self):
        return (f"{self.path}-{self.dtype}-d{self.dim}-gqa{self.gqa}x{self.kv_heads}-"
                f"r{self.rows}-c{self.context}-{self.layout}")


# GQA 1/2/4/7/8, head dims 64/96/128/256, contexts 0-2048, 1-70 rows (mask words 1-3), strided
# cache views, three dtypes; the split pair with chunk boundaries inside the block.
CASES = [
    Case("float32", 64, 1, 2, 1, 0, "contiguous"),
    Case("float16", 96, 2, 2, 7, 33, "capacity"),
    Case("bfloat16", 128, 4, 1, 31, 100, "transposed", prefix=2),
    Case("float32", 256, 7, 1, 5, 257, "capacity"),
    Case("float16", 64, 8, 1, 70, 2048, "capacity"),
    Case("bfloat16", 96, 1, 2, 64, 1, "transposed"),
    Case("float32", 128, 7, 2, 32, 500, "capacity"),
    Case("float16", 256, 2, 1, 3, 1024, "contiguous", prefix=1),
    Case("float32", 128, 4, 1, 9, 2048, "capacity", path="split", chunk=256),
    Case("bfloat16", 64, 7, 1, 70, 300, "transposed", path="split", chunk=64),
    Case("float16", 256, 1, 1, 1, 0, "contiguous", path="split", chunk=32),
    Case("float32", 96, 8, 1, 17, 40, "capacity", path="split", chunk=16),
    Case("float16", 64, 2, 2, 40, 1500, "transposed", path="split", chunk=0),  # default chunking
]


def case_inputs(case: Case, seed: int = 0):
    """q, k, v as mx arrays (k, v strided views per layout; the cache's spare room is NaN, so a
    kernel that reads past the context poisons its output), the mask and the float64 reference
    computed from the values rounded to the dtype."""
    rng = np.random.default_rng(seed)
    heads, total = case.gqa * case.kv_heads, case.context + case.rows
    dtype = MX_DTYPES[case.dtype]
    q = mx.array(rng.standard_normal((1, heads, case.rows, case.dim)).astype(np.float32)).astype(dtype)
    cache = []
    for _ in range(2):
        spare = 0 if case.layout == "contiguous" else 5
        shape = ((1, total + spare, case.kv_heads, case.dim) if case.layout == "transposed"
                 else (1, case.kv_heads, total + spare, case.dim))
        data = rng.standard_normal(shape).astype(np.float32)
        if case.layout == "transposed":
            data[:, total:] = np.nan
            view = mx.array(data).astype(dtype).transpose(0, 2, 1, 3)[:, :, :total]
        else:
            data[:, :, total:] = np.nan
            view = mx.array(data).astype(dtype)[:, :, :total]
        cache.append(view)
    k, v = cache
    mask = attention_mask(random_parent(rng, case.nodes), case.context, case.prefix)
    as64 = lambda x: np.array(x.astype(mx.float32)).astype(np.float64)  # noqa: E731
    want = reference(as64(q), as64(k), as64(v), case.dim ** -0.5, mask.dense())
    return q, k, v, mask, want


def run_case(case: Case, kind: str):
    q, k, v, mask, want = case_inputs(case)
    got = kernels.run_path(case.path, q, k, v, case.dim ** -0.5, mask, kind,
                           chunk=case.chunk or None)
    return np.array(got.astype(mx.float32)), want


def assert_close(got, want, dtype):
    assert np.isfinite(got).all(), "the kernel wrote NaN (or left an output unwritten)"
    err = np.abs(got - want).max()
    assert err <= TOLERANCE[dtype] * max(1.0, np.abs(want).max()), f"max error {err:.3g}"


class Recorder:
    """Stands in for a kernel to learn which instantiations a case needs (built in parallel)."""

    def __init__(self, kind, name):
        self.kernel = emulated_kernel(kind, name)
        self.calls = []

    def __call__(self, *, inputs, template, output_shapes, output_dtypes, **_):
        self.calls.append((template, [str(t.dtype).removeprefix("mlx.core.") for t in inputs],
                           [t.ndim for t in inputs],
                           [str(d).removeprefix("mlx.core.") for d in output_dtypes]))
        return [mx.zeros(s, d) for s, d in zip(output_shapes, output_dtypes)]


@pytest.fixture(scope="module")
def emulated_kernels():
    """Patches kernels._kernel to the emulated kernels, after compiling every instantiation the
    cases need (two at a time)."""
    patch = pytest.MonkeyPatch()
    recorders = {}
    patch.setattr(kernels, "_kernel",
                  lambda kind, name: recorders.setdefault((kind, name), Recorder(kind, name)))
    for case in CASES:
        for kind in ("metal", "cuda"):
            run_case(case, kind)
    builds = [(r.kernel, call) for r in recorders.values() for call in r.calls]
    with ThreadPoolExecutor(2) as pool:
        list(pool.map(lambda b: b[0].build(*b[1]), builds))
    patch.setattr(kernels, "_kernel", lambda kind, name: recorders[(kind, name)].kernel)
    yield
    patch.undo()


@needs_compiler
@pytest.mark.parametrize("kind", ["metal", "cuda"])
@pytest.mark.parametrize("case", CASES, ids=str)
def test_kernel_executed_matches_reference(emulated_kernels, case, kind):
    got, want = run_case(case, kind)
    assert_close(got, want, case.dtype)


@pytest.mark.skipif(kernels.backend() == "cpu", reason="needs a Metal or CUDA GPU")
@pytest.mark.parametrize("case", CASES, ids=str)
def test_kernel_on_this_gpu_matches_reference(case):
    """The same cases through MLX's own kernel compiler on a real GPU, where there is one."""
    got, want = run_case(case, kernels.backend())
    assert_close(got, want, case.dtype)


@needs_compiler
@pytest.mark.parametrize("kind", ["metal", "cuda"])
def test_broken_kernel_fails(monkeypatch, kind):
    """One wrong index (lane-major instead of element-major q layout, in bounds, type-correct)
    is caught: what type-checking under a shim could never see."""
    case = Case("float32", 64, 2, 1, 6, 20, "capacity")
    wrong = lambda src: src.replace("qp[lane * E + e]", "qp[lane + 32 * e]")  # noqa: E731
    assert "qp[lane * E + e]" in kernel_source("tree_attention_common.metal")
    assert "qp[lane * E + e]" in kernel_source("tree_attention_common.cuh")
    monkeypatch.setattr(kernels, "_kernel", lambda k, name: emulated_kernel(k, name, wrong))
    got, want = run_case(case, kind)
    with pytest.raises(AssertionError):
        assert_close(got, want, case.dtype)


# --- the emulator itself ----------------------------------------------------------------

PROBE = {
    "metal": """
uint lane = thread_index_in_simdgroup;
uint group = simdgroup_index_in_threadgroup;
threadgroup float partial[8];
float x = inp[thread_position_in_grid.x];
float total_in_simd = simd_sum(x);
float largest = simd_max(x);
float swapped = simd_shuffle_xor(x, 1u);
float next = simd_shuffle_down(x, 1u);
if (lane == 0) partial[group] = total_in_simd;
threadgroup_barrier(mem_flags::mem_threadgroup);
float total = 0.0f;
for (uint i = 0; i < simdgroups_per_threadgroup; i++) total += partial[i];
uint i = thread_position_in_grid.x;
sums[i] = total;
maxes[i] = largest;
swaps[i] = swapped;
downs[i] = next;
""",
    "cuda": """
int lane = threadIdx.x % 32;
int group = threadIdx.x / 32;
__shared__ float partial[8];
int i = blockIdx.x * blockDim.x + threadIdx.x;
float x = inp[i];
float total_in_simd = x;
for (int offset = 16; offset > 0; offset >>= 1)
  total_in_simd += __shfl_xor_sync(0xffffffffu, total_in_simd, offset);
float largest = x;
for (int offset = 16; offset > 0; offset >>= 1)
  largest = fmaxf(largest, __shfl_xor_sync(0xffffffffu, largest, offset));
float swapped = __shfl_xor_sync(0xffffffffu, x, 1);
float next = __shfl_down_sync(0xffffffffu, x, 1);
if (lane == 0) partial[group] = total_in_simd;
__syncthreads();
float total = 0.0f;
for (int g = 0; g < blockDim.x / 32; g++) total += partial[g];
sums[i] = total;
maxes[i] = largest;
swaps[i] = swapped;
downs[i] = next;
""",
}


@needs_compiler
@pytest.mark.parametrize("kind", ["metal", "cuda"])
def test_emulator_collectives_barriers_and_threadgroup_memory(kind):
    x = np.random.default_rng(1).permutation(512).astype(np.float32)
    kernel = EmulatedKernel(kind, "probe", ["inp"], ["sums", "maxes", "swaps", "downs"], PROBE[kind])
    outs = kernel(inputs=[x], grid=(512, 1, 1), threadgroup=(128, 1, 1),
                  output_shapes=[(512,)] * 4, output_dtypes=["float32"] * 4)
    sums, maxes, swaps, downs = (o.values() for o in outs)
    warps = x.reshape(16, 32)
    assert np.array_equal(sums, np.repeat(x.reshape(4, 128).sum(1), 128))
    assert np.array_equal(maxes, np.repeat(warps.max(1), 32))
    assert np.array_equal(swaps, x.reshape(-1, 2)[:, ::-1].reshape(-1))
    shifted = np.concatenate([warps[:, 1:], warps[:, -1:]], axis=1)  # the last lane keeps its own
    assert np.array_equal(downs, shifted.reshape(-1))


@needs_compiler
def test_emulator_reports_divergence_and_out_of_bounds():
    diverge = EmulatedKernel("metal", "diverge", ["inp"], ["out"], """
float x = inp[thread_position_in_grid.x];
if (thread_index_in_simdgroup < 16) x = simd_sum(x);
out[thread_position_in_grid.x] = x;
""")
    with pytest.raises(EmulationError, match="16 of 32 lanes wait"):
        diverge(inputs=[np.ones(32, np.float32)], grid=(32, 1, 1), threadgroup=(32, 1, 1),
                output_shapes=[(32,)], output_dtypes=["float32"])
    overrun = EmulatedKernel("metal", "overrun", ["inp"], ["out"], """
out[thread_position_in_grid.x] = inp[thread_position_in_grid.x + 64];
""")
    with pytest.raises(EmulationError, match="SIGSEGV"):
        overrun(inputs=[np.ones(32, np.float32)], grid=(32, 1, 1), threadgroup=(32, 1, 1),
                output_shapes=[(32,)], output_dtypes=["float32"])


@pytest.mark.skipif(shutil.which("nvcc") is None, reason="nvcc not installed")
def test_cuda_sources_compile_with_nvcc(tmp_path):
    """The CUDA bodies inside the signature mx.fast.cuda_kernel generates, compiled by nvcc."""
    units = [(emulated_kernel("cuda", "tree_attention"),
              ([("T", "float16"), ("D", 128), ("GQA", 4), ("W", 2)],
               ["float16", "float16", "float16", "uint32", "int32", "float32"], [4, 4, 4, 2, 1, 1],
               ["float16"])),
             (emulated_kernel("cuda", "tree_attention_partial"),
              ([("T", "bfloat16"), ("D", 64), ("GQA", 7), ("W", 3)],
               ["bfloat16", "bfloat16", "bfloat16", "uint32", "int32", "float32"],
               [4, 4, 4, 2, 1, 1], ["float32"] * 3)),
             (emulated_kernel("cuda", "tree_attention_combine"),
              ([("T", "float32"), ("D", 256)], ["float32"] * 3, [4, 3, 3], ["float32"]))]
    for i, (kernel, args) in enumerate(units):
        src = tmp_path / f"k{i}.cu"
        src.write_text(f'#include "{SHIM / "cuda_prelude.cuh"}"\n' + kernel.kernel_definition(*args)[0])
        r = subprocess.run(["nvcc", "-c", "-arch=sm_80", "-o", str(tmp_path / f"k{i}.o"), str(src)],
                           capture_output=True, text=True, timeout=300)
        assert r.returncode == 0, r.stderr


# --- dispatch, self-check, fallback -------------------------------------------------------


def test_attention_path_follows_where_mlx_fuses():
    # Metal, up to 8 rows: MLX's vector kernel needs rows x GQA <= 32
    assert attention_path("metal", 4, 7, 128, 100) == "mlx"
    assert attention_path("metal", 5, 7, 128, 100) == "fused"
    assert attention_path("metal", 8, 4, 128, 100) == "mlx"
    # above 8 rows MLX's full kernel serves these head dims, not 256
    assert attention_path("metal", 17, 4, 128, 100) == "mlx"
    assert attention_path("metal", 17, 4, 256, 100) == "fused"
    # long contexts: the split kernel; head dims our kernels cannot take: MLX
    assert attention_path("metal", 4, 1, 64, kernels.LONG_CONTEXT) == "split"
    assert attention_path("metal", 5, 7, 80, 100) == "mlx"
    assert attention_path("cuda", 2, 1, 64, 100) == "fused"
    assert attention_path("cpu", 5, 7, 128, 5000) == "mlx"
    # forced
    assert attention_path("metal", 4, 1, 64, 100, forced="fused") == "fused"
    assert attention_path("metal", 5, 7, 128, 5000, forced="mlx") == "mlx"
    assert mlx_fuses("metal", 1, 8, 64) and not mlx_fuses("cuda", 3, 1, 64)


@pytest.fixture
def fake_gpu(monkeypatch):
    """This process 'runs on Metal', with the kernels emulated (counting launches)."""
    launches = []

    def make(mutate=None):
        def factory(kind, name):
            kernel = emulated_kernel(kind, name, mutate)

            def launch(**kw):
                launches.append(name)
                return kernel(**kw)
            return launch
        monkeypatch.setattr(kernels, "_kernel", factory)
        kernels.kernel_trusted.cache_clear()

    monkeypatch.setattr(kernels, "backend", lambda: "metal")
    monkeypatch.delenv("TREEGRAFT_ATTENTION", raising=False)
    yield make, launches
    kernels.kernel_trusted.cache_clear()


def small_problem():
    """5 rows x GQA 7 (above MLX's rows x GQA <= 32): the fused kernel's case."""
    rng = np.random.default_rng(4)
    q = mx.array(rng.standard_normal((1, 7, 5, 64)).astype(np.float32))
    k, v = (mx.array(rng.standard_normal((1, 1, 25, 64)).astype(np.float32)) for _ in range(2))
    mask = attention_mask(random_parent(rng, 5), 20)
    want = mx.fast.scaled_dot_product_attention(q, k, v, scale=0.125, mask=mx.array(mask.dense()))
    return q, k, v, mask, np.array(want)


@needs_compiler
def test_trusted_kernel_serves_tree_blocks(fake_gpu):
    make, launches = fake_gpu
    make()
    q, k, v, mask, want = small_problem()
    got = tree_attention(q, k, v, scale=0.125, mask=mask)
    assert np.abs(np.array(got) - want).max() < 1e-4
    assert launches == ["tree_attention", "tree_attention"]  # the self-check, then the block


@needs_compiler
def test_broken_kernel_falls_back_to_mlx_with_one_warning(fake_gpu):
    make, launches = fake_gpu
    make(lambda src: src.replace("qp[lane * E + e]", "qp[lane + 32 * e]"))
    q, k, v, mask, want = small_problem()
    with pytest.warns(RuntimeWarning, match="metal fused tree-attention kernel differs"):
        got = tree_attention(q, k, v, scale=0.125, mask=mask)
    assert np.abs(np.array(got) - want).max() < 1e-4  # MLX's path served the block
    import warnings
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        tree_attention(q, k, v, scale=0.125, mask=mask)  # no second warning, no second check
    assert launches == ["tree_attention"]


@needs_compiler
def test_environment_forces_either_path(fake_gpu, monkeypatch):
    make, launches = fake_gpu
    make(lambda src: src.replace("qp[lane * E + e]", "qp[lane + 32 * e]"))
    q, k, v, mask, want = small_problem()
    monkeypatch.setenv("TREEGRAFT_ATTENTION", "mlx")
    assert np.abs(np.array(tree_attention(q, k, v, scale=0.125, mask=mask)) - want).max() < 1e-4
    assert launches == []
    monkeypatch.setenv("TREEGRAFT_ATTENTION", "fused")  # no self-check: the broken kernel runs
    got = tree_attention(q, k, v, scale=0.125, mask=mask)
    assert launches == ["tree_attention"] and np.abs(np.array(got) - want).max() > 1e-2
    monkeypatch.setenv("TREEGRAFT_ATTENTION", "fastest")
    with pytest.raises(ValueError, match="auto, fused or mlx"):
        tree_attention(q, k, v, scale=0.125, mask=mask)


def test_forcing_fused_on_the_cpu_is_a_clear_error(monkeypatch):
    monkeypatch.setenv("TREEGRAFT_ATTENTION", "fused")
    q = mx.zeros((1, 2, 3, 64))
    k = mx.zeros((1, 2, 3, 64))
    with pytest.raises(RuntimeError, match="needs a Metal or CUDA GPU"):
        tree_attention(q, k, k, scale=0.125, mask=attention_mask(np.array([-1, 0, 1]), 0))


# --- the varlen kernel: several requests' blocks, each in its own slot of a KV pool ----------

@dataclass(frozen=True)
class VarlenCase:
    dtype: str
    dim: int
    gqa: int
    kv_heads: int
    requests: tuple  # (slot, context, nodes) per request, in row order
    slots: int
    length: int      # keys a slot holds: past each request's context + block, a stale tail

    def __str__(self):
        return (f"varlen-{self.dtype}-d{self.dim}-gqa{self.gqa}x{self.kv_heads}-"
                + "-".join(f"s{s}c{c}n{n}" for s, c, n in self.requests))


VARLEN_CASES = [
    VarlenCase("float32", 64, 2, 2, ((2, 37, 5), (0, 0, 1), (3, 300, 33)), 4, 400),
    VarlenCase("bfloat16", 128, 4, 1, ((1, 1024, 9), (0, 5, 70)), 3, 1100),
]


def varlen_inputs(case: VarlenCase, seed: int = 0):
    """q, a pool k, v (strided: its slots are views of a larger buffer) whose tail past each
    request's context + block holds stale keys (huge values) and then NaN, the blocks' table
    and the float64 reference of each request attended alone against its own slot."""
    rng = np.random.default_rng(seed)
    dtype, heads = MX_DTYPES[case.dtype], case.gqa * case.kv_heads
    rows = sum(n for _, _, n in case.requests)
    q = mx.array(rng.standard_normal((1, heads, rows, case.dim)).astype(np.float32)).astype(dtype)
    pool = []
    for _ in range(2):
        data = rng.standard_normal((case.slots, case.kv_heads, case.length + 3, case.dim))
        data = data.astype(np.float32)
        data[..., case.length:, :] = np.nan
        for slot, context, nodes in case.requests:   # stale: an earlier, longer block's keys
            data[slot, :, context + nodes:context + nodes + 40] = 1e4
        pool.append(mx.array(data).astype(dtype)[:, :, :case.length])
    k, v = pool
    masks = [(slot, attention_mask(random_parent(rng, n), context))
             for slot, context, n in case.requests]
    as64 = lambda x: np.array(x.astype(mx.float32)).astype(np.float64)  # noqa: E731
    want, start = [], 0
    for (slot, mask), (_, context, n) in zip(masks, case.requests):
        qs = as64(q)[:, :, start:start + n]
        ks, vs = (as64(x[slot:slot + 1, :, :context + n]) for x in (k, v))
        want.append(reference(qs, ks, vs, case.dim ** -0.5, mask.dense()))
        start += n
    return q, k, v, kernels.VarlenBlocks.of(masks), np.concatenate(want, axis=2)


@needs_compiler
@pytest.mark.parametrize("kind", ["metal", "cuda"])
@pytest.mark.parametrize("case", VARLEN_CASES, ids=str)
def test_varlen_kernel_executed_matches_each_request_alone(monkeypatch, case, kind):
    kernel = emulated_kernel(kind, "tree_attention_varlen")
    monkeypatch.setattr(kernels, "_kernel", lambda kind, name: kernel)
    q, k, v, blocks, want = varlen_inputs(case)
    got = kernels.varlen_tree_attention(q, k, v, case.dim ** -0.5, blocks, kind)
    assert_close(np.array(got.astype(mx.float32)), want, case.dtype)


@needs_compiler
def test_a_varlen_kernel_that_reads_the_stale_tail_fails(monkeypatch):
    """A kernel that takes the slot's length after the block's write for the context (so the
    block's keys count as committed and its bits reach into the stale tail) must fail."""
    kernel = emulated_kernel("metal", "tree_attention_varlen", mutate=lambda s: s.replace(
        "int context = table[row * 3 + 1];",
        "int context = table[row * 3 + 1] + table[row * 3 + 2];"))
    monkeypatch.setattr(kernels, "_kernel", lambda kind, name: kernel)
    case = VARLEN_CASES[0]
    q, k, v, blocks, want = varlen_inputs(case)
    got = np.array(kernels.varlen_tree_attention(q, k, v, case.dim ** -0.5, blocks, "metal")
                   .astype(mx.float32))
    with pytest.raises(AssertionError):
        assert_close(got, want, case.dtype)


@needs_compiler
def test_a_packed_forward_over_a_pool_attends_in_one_varlen_call(monkeypatch):
    """On a GPU (here its kernel emulated), a packed forward whose requests' caches are slots
    of one pool, each block a tree or an AR row, attends every request in one varlen call a
    layer, and its logits and written keys equal each request's forward alone."""
    from treegraft_mlx import fixture_path, load_model
    from treegraft_mlx.packed import RequestBlock, packed_forward
    from treegraft_mlx.tree import positions

    model = load_model(fixture_path() / "target", dtype=mx.float32)[0]
    rng = np.random.default_rng(0)
    tree = [-1, 0, 0, 1, 1, 3, 2]
    contexts = [rng.integers(3, 300, n).tolist() for n in (13, 29, 7)]
    blocks = [dict(tokens=rng.integers(3, 300, len(tree)).tolist(),
                   positions=positions(tree, 13), mask=attention_mask(tree, 13)),
              dict(tokens=[5]), dict(tokens=[9])]
    pool = model.slot_pool()
    slots = [pool.take(64) for _ in contexts]
    want = []
    for ctx, block, slot in zip(contexts, blocks, slots):
        solo = model.make_cache(64)
        for cache in (solo, slot):
            model(mx.array([ctx]), cache=cache)
            cache.commit()
        h = model.run_layers(model.embed(mx.array(block["tokens"])[None]), solo,
                             block.get("positions"), block.get("mask"))
        want.append((np.array(model.head(h)), [np.array(a[..., :solo.offset + solo.pending, :])
                                                for a in solo.keys]))
    kernel = emulated_kernel("metal", "tree_attention_varlen")
    calls = []
    monkeypatch.setattr(kernels, "backend", lambda: "metal")
    monkeypatch.setattr(kernels, "kernel_trusted", lambda *a: True)
    monkeypatch.setattr(kernels, "_kernel", lambda kind, name: calls.append(name) or kernel)
    got = packed_forward(model, [RequestBlock(cache=s, **b) for s, b in zip(slots, blocks)])
    mx.eval(got.logits, pool.state())
    assert calls == ["tree_attention_varlen"] * len(model.layers)
    for i, ((logits, keys), slot) in enumerate(zip(want, slots)):
        assert_close(np.array(got.logits[i]), logits, "float32")
        end = slot.offset + slot.pending
        for layer, k in enumerate(keys):
            assert_close(np.array(pool.keys[layer][slot.slot:slot.slot + 1, :, :end]), k,
                         "float32")
