"""Load the system OpenBLAS before MLX does, so MLX's Linux CPU wheel runs its BLAS calls on it.

The wheel links a bundled reference BLAS: a 1024x1024 fp32 matmul runs at ~6 GFLOP/s on it and
~88 GFLOP/s on Debian's OpenBLAS. A library opened with RTLD_GLOBAL before `mlx.core` loads
libmlx.so sits in the dynamic linker's global scope, which is searched before libmlx's own
dependencies, so MLX's BLAS symbols bind to it: what LD_PRELOAD does, without asking users to set
it. Once `mlx.core` is loaded its symbols are bound and loading changes nothing; then
`device.warn_if_slow_blas` still warns. This module must not import mlx.
"""

from __future__ import annotations

import ctypes
import os
import platform
import sys
from typing import Optional

DISABLE_ENV = "TREEGRAFT_NO_BLAS_PRELOAD"


def candidates(machine: str, root: str = "/usr/lib") -> list[str]:
    """Debian's `libopenblas0-pthread` (what CI installs and what was measured) first, then the
    `libblas.so.3` alternative, which may name another OpenBLAS build or the reference BLAS."""
    lib = f"{root}/{machine}-linux-gnu"
    return [f"{lib}/openblas-pthread/libblas.so.3", f"{lib}/libblas.so.3"]


def find_openblas(machine: Optional[str] = None, root: str = "/usr/lib") -> Optional[str]:
    """The first candidate that exists and resolves to OpenBLAS (loading the system reference
    BLAS would gain nothing), or None."""
    for path in candidates(machine or platform.machine(), root):
        if os.path.isfile(path) and "openblas" in os.path.realpath(path):
            return path
    return None


def preload_openblas() -> Optional[str]:
    """Open the system OpenBLAS with RTLD_GLOBAL while that can still take effect; return the path
    loaded, or None. Linux only (`sys.platform == "linux"` also rules out Apple platforms, where
    MLX uses Accelerate); skipped once `mlx.core` is imported or when TREEGRAFT_NO_BLAS_PRELOAD=1.
    Never raises: a library that fails to load leaves MLX on its bundled BLAS."""
    if sys.platform != "linux" or "mlx.core" in sys.modules:
        return None
    if os.environ.get(DISABLE_ENV, "") not in ("", "0"):
        return None
    path = find_openblas()
    if path is None:
        return None
    try:
        ctypes.CDLL(path, mode=ctypes.RTLD_GLOBAL)
    except OSError:
        return None
    return path
