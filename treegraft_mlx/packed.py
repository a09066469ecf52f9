"""One target forward for several requests: their blocks of rows concatenated, so the embedding,
the projections, the MLP or experts and the head each run once on all rows, while attention
(and a hybrid's recurrent state) runs per request against that request's own cache.

Why: on a Mac the first rows of a forward are the cheapest there are, and several requests'
trees, AR rows and prefill chunks share them (issue 54). Each request attends its own cache
(models/segments.py): its own KVCache, or its slot of the batch's pool (slots.py), where every
row is written in one scatter and the AR rows attend in one call. No padding of one request's
rows to another's size, and each request's block stays pending in its own cache exactly as a
forward of it alone leaves it, for its own `commit` / `keep`.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Optional, Sequence

import mlx.core as mx
import numpy as np

from .models.decoder import Model
from .parts import Ran, RequestBlock
from .models.gemma4_assistant import Gemma4Assistant


class PackError(ValueError):
    """A model or a block a packed forward cannot take (the request then runs alone)."""


@dataclass(frozen=True)
class Packed:
    """Per request, in the order given: its logits (1, wanted rows, V) and its last layer's
    hidden states (1, L, D), what `run_layers` of it alone returns."""

    logits: list
    hidden: list


def run_together(model: Model, blocks: Sequence[RequestBlock]) -> list[Ran]:
    """packed_forward, each block's share as a forward of it alone would give it (run_alone)."""
    out = packed_forward(model, blocks)
    return [Ran(logits[0], hidden[0], model.head) for logits, hidden in zip(out.logits, out.hidden)]


def refusal(model) -> Optional[str]:
    """Why `model` cannot run a packed forward, or None."""
    if isinstance(model, Gemma4Assistant):
        return "a Gemma 4 assistant drafts from its target's keys and values: not a target"
    if not isinstance(model, Model):
        return f"{type(model).__name__} is not one of treegraft's decoder models"
    if len(model.layers) != model.args.num_hidden_layers:
        return "a pipeline stage holds a slice of the layers: its requests run alone"
    return None


def packed_forward(model: Model, blocks: Sequence[RequestBlock]) -> Packed:
    """One forward of `model` over every block's rows (see the module docstring).

    Each block's cache must be its own: two blocks writing into one cache would overwrite
    each other's pending rows. Raises PackError for a model that cannot be packed."""
    why = refusal(model)
    if why:
        raise PackError(why)
    blocks = list(blocks)
    if not blocks or any(b.rows == 0 for b in blocks):
        raise PackError("a packed forward needs at least one request, each with rows")
    caches = [id(b.cache) for b in blocks if b.cache is not None]
    if len(set(caches)) != len(caches):
        raise PackError("two blocks of one packed forward share a cache")
    tokens = mx.concatenate([b.ids() for b in blocks])
    h = model.run_packed(model.embed(tokens[None]), blocks)
    starts = np.cumsum([0] + [b.rows for b in blocks])
    hidden = [h[:, a:e] for a, e in zip(starts[:-1], starts[1:])]
    return Packed(head_rows(model, h, blocks, starts), hidden)


def head_rows(model: Model, h: mx.array, blocks: list, starts: np.ndarray) -> list:
    """Every block's wanted rows through the head in one call, split back per block."""
    wanted = [b.wanted() for b in blocks]
    everything = all(b.logits_rows is None for b in blocks)
    rows = None if everything else mx.concatenate(
        [w + int(s) for w, s in zip(wanted, starts[:-1])])
    logits = model.head(h, rows)
    cuts = np.cumsum([w.shape[0] for w in wanted])[:-1].tolist()
    return mx.split(logits, cuts, axis=1) if cuts else [logits]
