"""Model architectures: one decoder skeleton with per-family switches (see decoder.py)."""

from .decoder import FAMILY_DEFAULTS, Model, ModelArgs

SUPPORTED_MODEL_TYPES = tuple(sorted(FAMILY_DEFAULTS))

__all__ = ["Model", "ModelArgs", "SUPPORTED_MODEL_TYPES"]
