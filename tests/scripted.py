"""Deterministic timing for tests: the step costs and the clock that sizing decisions read."""

from __future__ import annotations

import numpy as np


# What the bundled family's steps cost on this CI's machine, as `treegraft calibrate-budget`
# measured them (benchmarks/RESULTS.md): tests size trees from these, never from a probe run under load.
SCRIPTED_LATENCY = {1: 26.1, 8: 35.5, 16: 44.3, 32: 65.9}


def scripted_step_costs(family=None, tree=None):
    """StepCosts with the measured curve interpolated over every size a step may verify."""
    from treegraft_mlx.timing import StepCosts

    sizes = tuple(range(1, 33))
    known = sorted(SCRIPTED_LATENCY)
    ms = np.interp(sizes, known, [SCRIPTED_LATENCY[k] for k in known])
    return StepCosts(sizes, tuple(ms), ar_ms=22.2, overhead_ms=1.3, draft_ms=0.5)


class ScriptedClock:
    """A clock that advances `tick_s` per reading: the durations decoding learns from depend
    only on the code path taken, so sizing and drafting decisions repeat exactly."""

    def __init__(self, tick_s: float = 1e-4):
        self.now, self.tick_s = 0.0, tick_s

    def __call__(self) -> float:
        self.now += self.tick_s
        return self.now


def deterministic(family):
    """The family with the scripted clock (returned for chaining)."""
    family.clock = ScriptedClock()
    return family

