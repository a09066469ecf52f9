"""Counts the host's waits on the device: every MLX readback entry point, wrapped while counting.

On a Mac the GPU runs while Python works, and each readback with nothing else queued idles
it for the whole host gap; the number of waits per step is the figure that carries over from
this CPU to a Mac, where milliseconds do not (docs/design.md §20). So the count comes from
MLX's own entry points, not from the decoder's bookkeeping: `mx.eval`, `array.item`,
`array.tolist`, `int()`, `float()` and `bool()` of an array, and numpy's conversions of one
(`np.array`, `np.asarray`, which read through the buffer protocol and so cannot be wrapped on
the MLX side). Bytes are what each read returns (nothing for `mx.eval`, which only waits);
seconds are the time spent inside those calls. `queueing` is the time spent inside
`mx.async_eval`, which is no wait on a GPU, but MLX's CPU backend keeps only a few ops in
flight and blocks the caller until a larger graph is nearly computed: on this CPU, seconds
plus queueing is the device's share of a run, and the rest is the host's.

`Waits` patches those entry points only inside its `with` block, and restores them on exit:
it is for the trace, the bench and the tests, never left on in a library call.
"""

from __future__ import annotations

import time
from dataclasses import dataclass, field
from typing import Callable

import mlx.core as mx
import numpy as np

METHODS = ("item", "tolist", "__int__", "__float__", "__bool__", "__index__")
CONVERSIONS = ("array", "asarray")


@dataclass
class Waits:
    """Host waits, bytes read back, seconds spent waiting and queueing while active (a
    context manager; not reentrant)."""

    count: int = 0
    nbytes: int = 0
    seconds: float = 0.0
    queueing: float = 0.0
    _saved: dict = field(default_factory=dict)

    def _timed(self, total: str, original: Callable, *args, **kwargs):
        """original(*args, **kwargs), its seconds added to the attribute named `total`."""
        t0 = time.perf_counter()
        try:
            return original(*args, **kwargs)
        finally:
            setattr(self, total, getattr(self, total) + time.perf_counter() - t0)

    def _wait(self, original: Callable, nbytes: int, *args, **kwargs):
        self.count += 1
        self.nbytes += nbytes
        return self._timed("seconds", original, *args, **kwargs)

    def _method(self, original: Callable) -> Callable:
        def wrapped(x, *args, **kwargs):
            return self._wait(original, x.nbytes, x, *args, **kwargs)
        return wrapped

    def _conversion(self, original: Callable) -> Callable:
        def wrapped(x, *args, **kwargs):
            if isinstance(x, mx.array):
                return self._wait(original, x.nbytes, x, *args, **kwargs)
            return original(x, *args, **kwargs)
        return wrapped

    def _eval(self, original: Callable) -> Callable:
        def wrapped(*args, **kwargs):
            return self._wait(original, 0, *args, **kwargs)
        return wrapped

    def _async_eval(self, original: Callable) -> Callable:
        def wrapped(*args, **kwargs):
            return self._timed("queueing", original, *args, **kwargs)
        return wrapped

    def __enter__(self) -> "Waits":
        if self._saved:
            raise RuntimeError("Waits is already counting")
        self._saved = {("mx", "eval"): mx.eval, ("mx", "async_eval"): mx.async_eval}
        self._saved.update({("array", m): getattr(mx.array, m) for m in METHODS})
        self._saved.update({("np", c): getattr(np, c) for c in CONVERSIONS})
        mx.eval = self._eval(mx.eval)
        mx.async_eval = self._async_eval(mx.async_eval)
        for m in METHODS:
            setattr(mx.array, m, self._method(self._saved["array", m]))
        for c in CONVERSIONS:
            setattr(np, c, self._conversion(self._saved["np", c]))
        return self

    def __exit__(self, *exc) -> None:
        for (owner, name), original in self._saved.items():
            setattr({"mx": mx, "array": mx.array, "np": np}[owner], name, original)
        self._saved = {}

    def snapshot(self) -> tuple[int, int]:
        return self.count, self.nbytes
