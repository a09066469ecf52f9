"""Counts the host's waits on the device: every MLX readback entry point, wrapped while counting.

On a Mac the GPU runs while Python works, and each readback with nothing else queued idles
it for the whole host gap; the number of waits per step is the figure that carries over from
this CPU to a Mac, where milliseconds do not (docs/design.md §20). So the count comes from
MLX's own entry points, not from the decoder's bookkeeping: `mx.eval`, `array.item`,
`array.tolist`, `int()`, `float()` and `bool()` of an array, and numpy's conversions of one
(`np.array`, `np.asarray`, which read through the buffer protocol and so cannot be wrapped on
the MLX side). Bytes are what each read returns (nothing for `mx.eval`, which only waits).

`Waits` patches those entry points only inside its `with` block, and restores them on exit:
it is for the trace, the bench and the tests, never left on in a library call.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Callable

import mlx.core as mx
import numpy as np

METHODS = ("item", "tolist", "__int__", "__float__", "__bool__", "__index__")
CONVERSIONS = ("array", "asarray")


@dataclass
class Waits:
    """Host waits and bytes read back while active (a context manager; not reentrant)."""

    count: int = 0
    nbytes: int = 0
    _saved: dict = field(default_factory=dict)

    def _note(self, x) -> None:
        self.count += 1
        self.nbytes += x.nbytes if isinstance(x, mx.array) else 0

    def _method(self, original: Callable) -> Callable:
        def wrapped(x, *args, **kwargs):
            self._note(x)
            return original(x, *args, **kwargs)
        return wrapped

    def _conversion(self, original: Callable) -> Callable:
        def wrapped(x, *args, **kwargs):
            if isinstance(x, mx.array):
                self._note(x)
            return original(x, *args, **kwargs)
        return wrapped

    def _eval(self, original: Callable) -> Callable:
        def wrapped(*args, **kwargs):
            self.count += 1
            return original(*args, **kwargs)
        return wrapped

    def __enter__(self) -> "Waits":
        if self._saved:
            raise RuntimeError("Waits is already counting")
        self._saved = {("mx", "eval"): mx.eval}
        self._saved.update({("array", m): getattr(mx.array, m) for m in METHODS})
        self._saved.update({("np", c): getattr(np, c) for c in CONVERSIONS})
        mx.eval = self._eval(mx.eval)
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
