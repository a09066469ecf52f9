"""Drafters of different cost that expand the one shared draft tree."""

from .base import ChainDrafter, Drafter, Drafters
from .model import ModelDrafter
from .mtp import MtpDrafter
from .ngram import NgramDrafter, NgramIndex

__all__ = ["ChainDrafter", "Drafter", "Drafters", "ModelDrafter", "MtpDrafter", "NgramDrafter", "NgramIndex"]
