"""Drafters of different cost that expand the one shared draft tree."""

from .assistant import AssistantDrafter, check_pair, is_assistant
from .base import ChainDrafter, Draw, Drafter, Drafters, QueuedChain
from .model import ModelDrafter
from .mtp import MtpDrafter
from .ngram import NgramDrafter, NgramIndex

__all__ = ["AssistantDrafter", "check_pair", "is_assistant", "ChainDrafter", "Draw", "Drafter", "Drafters", "QueuedChain", "ModelDrafter", "MtpDrafter", "NgramDrafter", "NgramIndex"]
