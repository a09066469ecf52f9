"""Drafters of different cost that expand the one shared draft tree."""

from .base import Drafter, Drafters
from .model import ModelDrafter
from .ngram import NgramDrafter, NgramIndex

__all__ = ["Drafter", "Drafters", "ModelDrafter", "NgramDrafter", "NgramIndex"]
