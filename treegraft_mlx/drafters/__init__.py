"""Drafters of different cost that expand the one shared draft tree."""

from .base import Drafter
from .model import ModelDrafter
from .ngram import NgramDrafter, NgramIndex

__all__ = ["Drafter", "ModelDrafter", "NgramDrafter", "NgramIndex"]
