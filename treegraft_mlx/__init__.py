"""treegraft-mlx: TreeGraft tree-based speculative decoding on MLX."""

from .engine import GenerationResult, generate, stream_generate
from .family import Family, TreeConfig, load
from .fixtures import fixture_path
from .loading import LoadError, load_model

__version__ = "0.1.0"
__all__ = ["Family", "GenerationResult", "LoadError", "TreeConfig", "fixture_path", "generate",
           "load", "load_model", "stream_generate"]
