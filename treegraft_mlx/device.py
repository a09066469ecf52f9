"""What the machine offers: compute dtype, memory available, BLAS in use, Metal wired limit."""

from __future__ import annotations

import contextlib
import os
import sys
import warnings
from typing import Iterator, Optional

import mlx.core as mx

OPENBLAS_HINT = (
    "MLX's Linux CPU wheel bundles a reference BLAS (measured 15-25x slower than OpenBLAS for "
    "fp32 matmul). Install Debian's OpenBLAS (apt-get install -y libopenblas0-pthread) and "
    "import treegraft_mlx before mlx so that it can load it (TREEGRAFT_NO_BLAS_PRELOAD unset), "
    "or preload it: export LD_PRELOAD=/usr/lib/x86_64-linux-gnu/openblas-pthread/libblas.so.3"
)


def on_gpu() -> bool:
    return mx.default_device().type == mx.gpu


def compute_dtype(checkpoint_dtype: mx.Dtype, override: Optional[mx.Dtype] = None) -> mx.Dtype:
    """fp32 on CPU, where half-precision matmuls are several times slower (measured here:
    37 vs 107 tok/s, bf16 vs fp32, same model); the checkpoint's dtype on a GPU."""
    if override is not None:
        return override
    return checkpoint_dtype if on_gpu() else mx.float32


def available_memory() -> int:
    """Bytes a model may use: the recommended working set on Metal, free RAM elsewhere."""
    if mx.metal.is_available():
        return int(mx.device_info()["max_recommended_working_set_size"])
    try:
        with open("/proc/meminfo") as f:
            for line in f:
                if line.startswith("MemAvailable:"):
                    return int(line.split()[1]) * 1024
    except OSError:
        pass
    return os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")


def blas_library() -> Optional[str]:
    """The `libblas` shared library mapped into this process (what MLX's CPU wheel links), or
    None where it cannot be seen. numpy's own bundled OpenBLAS does not count."""
    try:
        with open("/proc/self/maps") as f:
            paths = {line.split()[-1] for line in f if ".so" in line}
    except OSError:
        return None
    for path in sorted(paths):
        if "/libblas.so" in path or "openblas-pthread" in path:
            return path
    return None


def warn_if_slow_blas() -> None:
    """Tell Linux users running on the CPU when the fast BLAS is not loaded."""
    if sys.platform == "linux" and not on_gpu():
        lib = blas_library()
        if lib is None or "openblas" not in lib:  # MLX's wheel bundles a reference BLAS
            warnings.warn(OPENBLAS_HINT, RuntimeWarning, stacklevel=2)


@contextlib.contextmanager
def wired_limit() -> Iterator[None]:
    """On Metal, wire the recommended working set for the duration (as mlx_lm does)."""
    if not mx.metal.is_available():
        yield
        return
    old = mx.set_wired_limit(mx.device_info()["max_recommended_working_set_size"])
    try:
        yield
    finally:
        mx.synchronize()
        mx.set_wired_limit(old)
