"""Tree bookkeeping as plain arrays: a tree is a parent index per node, parents before children.

Node 0 is the root (parent -1). Pure functions only: masks, positions and paths that the
verifier and the drafters need, testable without any model.
"""

from __future__ import annotations

import mlx.core as mx
import numpy as np


def depths(parent: np.ndarray) -> np.ndarray:
    """Depth of every node (root = 0); requires parents to come before their children."""
    parent = np.asarray(parent)
    d = np.zeros(len(parent), dtype=np.int64)
    for i in range(1, len(parent)):
        if not 0 <= parent[i] < i:
            raise ValueError(f"node {i} has parent {parent[i]}: parents must precede children")
        d[i] = d[parent[i]] + 1
    return d


def ancestor_mask(parent: np.ndarray) -> np.ndarray:
    """(N, N) boolean: row i is True at i's ancestors and at i itself."""
    parent = np.asarray(parent)
    n = len(parent)
    m = np.zeros((n, n), dtype=bool)
    for i in range(n):
        if i:
            m[i] = m[parent[i]]
        m[i, i] = True
    return m


def attention_mask(parent: np.ndarray, context: int) -> mx.array:
    """(N, context + N) boolean mask: every committed token, plus the node's own ancestry."""
    tree = ancestor_mask(parent)
    return mx.array(np.concatenate([np.ones((len(parent), context), dtype=bool), tree], axis=1))


def positions(parent: np.ndarray, context: int) -> mx.array:
    """Position of each node: the committed length plus its depth."""
    return mx.array((context + depths(parent)).astype(np.int32))


def path_to(parent: np.ndarray, node: int) -> list[int]:
    """Node indices from the root down to `node`, inclusive."""
    path = []
    while node != -1:
        path.append(int(node))
        node = int(parent[node])
    return path[::-1]
