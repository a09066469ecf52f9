"""treegraft-mlx: TreeGraft tree-based speculative decoding on MLX."""

from .fixtures import fixture_path
from .generate import generate_ar, stream_generate_ar
from .loading import LoadError, load_model

__version__ = "0.1.0"
__all__ = ["LoadError", "fixture_path", "generate_ar", "load_model", "stream_generate_ar"]
