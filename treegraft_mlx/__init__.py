"""treegraft-mlx: TreeGraft tree-based speculative decoding on MLX."""

# First, before anything below imports mlx.core: the system OpenBLAS only takes over MLX's BLAS
# calls if it is loaded before libmlx.so is (see blas.py).
from . import blas

blas.preload_openblas()

from .engine import GenerationResult, generate, load, stream_generate  # noqa: E402
from .family import Family, TreeConfig  # noqa: E402
from .fixtures import fixture_path  # noqa: E402
from .loading import LoadError, load_model  # noqa: E402

__version__ = "0.1.0"
__all__ = ["Family", "GenerationResult", "LoadError", "TreeConfig", "fixture_path", "generate",
           "load", "load_model", "stream_generate"]
