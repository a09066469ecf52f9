"""The converter: Hugging Face checkpoints to a quantized MLX TreeGraft bundle.

Lives in the repository's top-level `convert/` folder and installs as `treegraft_mlx.convert`.
"""

from .bundle import RECIPES, ConvertError, QuantSpec, convert_family

__all__ = ["RECIPES", "ConvertError", "QuantSpec", "convert_family"]
