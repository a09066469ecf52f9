"""Decides, before each tree layer, which drafter expands it.

A schedule returns the index of the drafter (0 = the cheapest) for a layer. Fixed schedules
cover the endpoints and ablations; the learned scheduler plugs in through the same method.
"""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class FixedSchedule:
    """The strong drafter (last drafter) expands exactly `combine_layers` (1-based)."""

    combine_layers: frozenset[int]

    def choose(self, layer: int, num_drafters: int) -> int:
        return num_drafters - 1 if layer in self.combine_layers else 0


def parse_layers(spec: str) -> frozenset[int]:
    """'1,3' -> {1, 3}; '' -> no combine layer."""
    try:
        layers = frozenset(int(x) for x in spec.split(",") if x.strip())
    except ValueError:
        raise ValueError(f"combine layers must be comma-separated integers, got {spec!r}") from None
    if any(layer < 1 for layer in layers):
        raise ValueError(f"combine layers are 1-based, got {sorted(layers)}")
    return layers
