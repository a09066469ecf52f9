"""Hand-built scheduler MLPs whose decisions are known: value = feature - threshold."""

import mlx.core as mx
import numpy as np

from treegraft_mlx.scheduler import FEATURE_NAMES, SchedulerMLP


def threshold_mlp(feature: str, threshold: float) -> SchedulerMLP:
    """relu(x - t) - relu(t - x) = x - t through the 17-64-32-1 ReLU network."""
    k = FEATURE_NAMES.index(feature)
    w1, b1 = np.zeros((64, 17), np.float32), np.zeros(64, np.float32)
    w1[0, k], w1[1, k], b1[:2] = 1.0, -1.0, (-threshold, threshold)
    w2 = np.zeros((32, 64), np.float32)
    w2[0, 0] = w2[1, 1] = 1.0
    w3 = np.zeros((1, 32), np.float32)
    w3[0, :2] = (1.0, -1.0)
    mlp = SchedulerMLP.init(0)
    mlp.params.update({"l1.weight": mx.array(w1), "l1.bias": mx.array(b1),
                       "l2.weight": mx.array(w2), "l2.bias": mx.zeros((32,)),
                       "l3.weight": mx.array(w3), "l3.bias": mx.zeros((1,))})
    return mlp
