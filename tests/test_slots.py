"""A slot of a pool behaves as a KVCache of its own; slots are taken and given back."""

import mlx.core as mx
import numpy as np
import pytest

from treegraft_mlx.cache import KVCache
from treegraft_mlx.slots import SlotPool

LAYERS, HEADS, DIM = 2, 2, 4


def block(rng, rows: int) -> mx.array:
    return mx.array(rng.standard_normal((1, HEADS, rows, DIM)).astype(np.float32))


def held(cache) -> list[np.ndarray]:
    """Every layer's committed keys and values."""
    if isinstance(cache, KVCache):
        return [np.array(a[..., :cache.offset, :]) for a in cache.keys + cache.values]
    s = cache.slot
    return [np.array(a[s:s + 1, :, :cache.offset]) for a in cache.pool.keys + cache.pool.values]


def test_slots_keep_what_their_own_caches_would(rng=np.random.default_rng(0)):
    """Three requests' slots, interleaved writes (growing past a chunk), commits, kept tree
    paths and resets: each slot holds what a KVCache of its own holds, and what one write
    returns is the same context + block."""
    pool = SlotPool(LAYERS, HEADS, DIM, chunk=8)
    slots = [pool.take(64) for _ in range(3)]
    own = [KVCache(LAYERS, HEADS, DIM, 64, chunk=8) for _ in range(3)]
    for step in range(12):
        for i in rng.permutation(3):
            rows = int(rng.integers(1, 6))
            for layer in range(LAYERS):
                k, v = block(rng, rows), block(rng, rows)
                got, want = slots[i].write(layer, k, v), own[i].write(layer, k, v)
                for a, b in zip(got, want):
                    np.testing.assert_array_equal(np.array(a), np.array(b))
            what = rng.integers(3)
            if what == 0:
                kept = sorted(rng.choice(rows, int(rng.integers(1, rows + 1)), replace=False))
                for c in (slots[i], own[i]):
                    c.keep(kept)
            elif what == 1:
                for c in (slots[i], own[i]):
                    c.commit()
            else:
                back = int(rng.integers(own[i].offset + 1))
                for c in (slots[i], own[i]):
                    c.reset(back)
            assert slots[i].offset == own[i].offset
        for s, o in zip(slots, own):
            for a, b in zip(held(s), held(o)):
                np.testing.assert_array_equal(a, b)


def test_slots_are_taken_lowest_first_and_given_back():
    pool = SlotPool(LAYERS, HEADS, DIM)
    a, b, c = (pool.take(16) for _ in range(3))
    assert [a.slot, b.slot, c.slot] == [0, 1, 2]
    pool.give(b)
    assert pool.take(16).slot == 1          # the hole first
    with pytest.raises(ValueError, match="not taken"):
        pool.give(b)                        # given back already (slot 1 is another's now)
    other = SlotPool(LAYERS, HEADS, DIM)
    with pytest.raises(ValueError, match="not taken"):
        other.give(a)


def test_a_pool_drops_its_buffers_when_every_slot_is_free():
    pool = SlotPool(LAYERS, HEADS, DIM)
    caches = [pool.take(16) for _ in range(2)]
    rng = np.random.default_rng(1)
    for c in caches:
        c.write(0, block(rng, 3), block(rng, 3))
    assert pool.slots == 2 and pool.state()
    pool.give(caches[0])
    assert pool.slots == 2
    pool.give(caches[1])
    assert pool.slots == 0 and pool.state() == []


def test_a_slot_refuses_rows_past_its_context():
    pool = SlotPool(LAYERS, HEADS, DIM)
    cache = pool.take(4)
    rng = np.random.default_rng(2)
    cache.write(0, block(rng, 3), block(rng, 3))
    cache.commit()
    with pytest.raises(ValueError, match="exceeds the limit of 4"):
        cache.write(0, block(rng, 2), block(rng, 2))
