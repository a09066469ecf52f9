"""The packed forward (treegraft_mlx/packed.py): several requests' rows in one target forward
equal a forward of each request alone, logits, hidden states and the keys, values and
recurrent states written into each request's own cache, before and after each request's
keep / commit; for every architecture, on the tiny checkpoints transformers wrote
(tests/hf_reference/). The requests have ragged contexts (past the sliding windows and Phi-3's
longrope window for some, not for others) and mix a tree, a single AR row, a causal prefill
chunk of a newly admitted request (empty cache) and a second tree."""

import shutil
from pathlib import Path

import mlx.core as mx
import numpy as np
import pytest

from checkpoints import write_tokenizer
from treegraft_mlx import load_model
from treegraft_mlx.cache import KVCache
from treegraft_mlx.layered_cache import LayeredCache
from treegraft_mlx.models.hybrid import HybridCache
from treegraft_mlx.packed import PackError, RequestBlock, packed_forward
from treegraft_mlx.pipeline import Stage
from treegraft_mlx.slots import SlotCache
from treegraft_mlx.tree import attention_mask, positions

REFERENCES = Path(__file__).parent / "hf_reference"
ARCHITECTURES = ["llama3-rope", "qwen2-theta", "qwen3-linear", "phi3-longrope", "mistral-window",
                 "mixtral", "qwen3_moe", "gemma2", "gemma3", "gemma4/dense", "gemma4/k_eq_v",
                 "gemma4/moe", "gemma4/shared_ple", "qwen3_5", "qwen3_5_moe", "qwen3_next"]
TOL = 1e-5      # float32 on both sides, relative to max(1, the largest value)
TREE = [-1, 0, 0, 1, 1, 3, 2]           # a branching tree, depth 3
OTHER_TREE = [-1, 0, 1, 1, 3]
KEPT = [0, 1, 3, 5]                      # TREE's accepted path (a path from its first row)


def loaded(name: str, dest: Path):
    """A reference checkpoint (with a tokenizer) as load_model reads it, in float32."""
    shutil.copytree(REFERENCES / name, dest)
    write_tokenizer(dest)
    return load_model(dest, dtype=mx.float32)[0]


@pytest.fixture(scope="module", params=ARCHITECTURES)
def model(request, tmp_path_factory):
    return loaded(request.param, tmp_path_factory.mktemp(request.param.replace("/", "_")) / "c")


def tokens(rng, n: int) -> list[int]:
    return rng.integers(3, 300, n).tolist()


def requests(model, rng) -> list[tuple[list[int], dict]]:
    """(committed context, the block to forward) per request: a tree after 13 tokens, one AR
    row after 29 (past the windows), a prefill chunk of 6 into an empty cache, another tree
    after 21, another AR row after 9."""
    return [(tokens(rng, 13), dict(tokens=tokens(rng, len(TREE)),
                                   positions=positions(TREE, 13), mask=attention_mask(TREE, 13))),
            (tokens(rng, 29), dict(tokens=tokens(rng, 1))),
            ([], dict(tokens=tokens(rng, 6))),
            (tokens(rng, 21), dict(tokens=tokens(rng, len(OTHER_TREE)),
                                   positions=positions(OTHER_TREE, 21),
                                   mask=attention_mask(OTHER_TREE, 21))),
            (tokens(rng, 9), dict(tokens=tokens(rng, 1)))]


def prefilled(model, context: list[int], cache=None):
    cache = model.make_cache(96) if cache is None else cache
    if context:
        model(mx.array([context]), cache=cache)
        cache.commit()
    return cache


def alone(model, block: dict, cache) -> tuple[mx.array, mx.array]:
    """A forward of one request by itself: (logits, hidden), as verify.py runs it."""
    h = model.run_layers(model.embed(mx.array(block["tokens"])[None]), cache,
                         block.get("positions"), block.get("mask"))
    return model.head(h, block.get("logits_rows")), h


def cache_arrays(cache) -> list[np.ndarray]:
    """What a cache holds for its committed and pending rows: every layer's keys and values
    (and a hybrid's recurrent windows, states and pending rows' inputs and states)."""
    if isinstance(cache, LayeredCache):
        return [a for c in cache.caches for a in cache_arrays(c)]
    if isinstance(cache, HybridCache):
        recurrent = [np.array(a) for r in cache.layers.values()
                     for a in [r.window, r.state] + ([r.inputs] if r.inputs is not None else [])
                     + r.states]
        return cache_arrays(cache.kv) + recurrent
    end = cache.offset + cache.pending
    if isinstance(cache, SlotCache):
        return [np.array(a[cache.slot:cache.slot + 1, :, :end]) for a in cache.pool.state()]
    assert isinstance(cache, KVCache)
    return [np.array(a[..., :end, :]) for a in cache.keys + cache.values if a is not None]


def error(got, want) -> float:
    got, want = np.asarray(got), np.asarray(want)
    assert got.shape == want.shape
    return float(np.abs(got - want).max() / max(1.0, np.abs(want).max()))


def assert_caches_equal(packed, separate) -> None:
    a, b = cache_arrays(packed), cache_arrays(separate)
    assert len(a) == len(b) and len(a) > 0
    assert packed.offset == separate.offset and packed.pending == separate.pending
    for x, y in zip(a, b):
        assert error(x, y) < TOL


def slots_of(model, n: int) -> list:
    """n caches, slots of one pool taken out of order with a free slot among them (slot 1):
    the batched AR rows' slots are then neither their row order nor contiguous."""
    pool = model.slot_pool()
    caches = [pool.take(96) for _ in range(n + 1)]
    pool.give(caches.pop(1))
    return caches[::-1]


def test_packed_forward_equals_each_request_alone(model):
    assert_packed_equals_alone(model, lambda contexts: [prefilled(model, c) for c in contexts])


def test_packed_forward_over_a_slot_pool_equals_each_request_alone(model):
    """The same requests, their caches slots of one pool (slots.py): one write a layer, the
    AR rows in one call. A model whose cache is not one KVCache has no pool."""
    if model.slot_pool() is None:
        assert isinstance(model.make_cache(8), (LayeredCache, HybridCache))
        return
    assert_packed_equals_alone(model, lambda contexts: [
        prefilled(model, c, cache) for c, cache in zip(contexts, slots_of(model, len(contexts)))])


def assert_packed_equals_alone(model, caches) -> None:
    """A packed forward of `requests` (caches from `caches(contexts)`), its blocks kept or
    committed, then a step of one AR row each, equal each request's forwards alone."""
    rng = np.random.default_rng(0)
    reqs = requests(model, rng)
    reqs[0][1]["logits_rows"] = [0, 3, 5]           # chosen rows of one request
    reqs[3][1].update(tokens=mx.array(reqs[3][1]["tokens"]), logits_rows=mx.array([0, 4]))
    solo = [prefilled(model, ctx) for ctx, _ in reqs]
    packed = caches([ctx for ctx, _ in reqs])
    want = [alone(model, block, cache) for (_, block), cache in zip(reqs, solo)]
    got = packed_forward(model, [RequestBlock(cache=c, **block)
                                 for (_, block), c in zip(reqs, packed)])
    for i, ((logits, hidden), cache, other) in enumerate(zip(want, packed, solo)):
        assert got.logits[i].shape == logits.shape, i
        assert error(got.logits[i], logits) < TOL, i
        assert error(got.hidden[i], hidden) < TOL, i
        assert_caches_equal(cache, other)
    # each request decides its own block: a tree's path, the AR row, the whole chunk, a
    # tree's root alone
    for c in (packed, solo):
        c[0].keep(KEPT)
        c[1].commit()
        c[2].commit()
        c[3].keep([0])
        c[4].commit()
    for cache, other in zip(packed, solo):
        assert_caches_equal(cache, other)
    # and the next packed step (one AR row each) still equals each alone
    nxt = [dict(tokens=tokens(rng, 1)) for _ in reqs]
    got = packed_forward(model, [RequestBlock(cache=c, **b) for b, c in zip(nxt, packed)])
    for i, (b, other) in enumerate(zip(nxt, solo)):
        assert error(got.logits[i], alone(model, b, other)[0]) < TOL, i
        assert_caches_equal(packed[i], other)


def test_one_request_packed_is_the_plain_forward(model):
    rng = np.random.default_rng(1)
    ctx, block = requests(model, rng)[0]
    solo, packed = prefilled(model, ctx), prefilled(model, ctx)
    logits, _ = alone(model, block, solo)
    got = packed_forward(model, [RequestBlock(cache=packed, **block)])
    assert error(got.logits[0], logits) < TOL
    assert_caches_equal(packed, solo)


def test_a_request_attending_another_requests_cache_is_caught(tmp_path):
    """The check can fail: the tree's rows run against another request's cache (29 other
    tokens) give logits far from its own forward's."""
    model = loaded("llama3-rope", tmp_path / "c")
    reqs = requests(model, np.random.default_rng(2))
    (ctx, tree), (other_ctx, ar) = reqs[0], reqs[1]
    want, _ = alone(model, tree, prefilled(model, ctx))
    wrong = prefilled(model, other_ctx)             # the AR request's context
    block = dict(tree, mask=attention_mask(TREE, 29))   # its own positions
    got = packed_forward(model, [RequestBlock(cache=wrong, **block),
                                 RequestBlock(cache=prefilled(model, ctx), **ar)])
    assert error(got.logits[0], want) > 100 * TOL


def test_what_cannot_be_packed_is_refused(tmp_path):
    """Two blocks writing one cache, a pipeline stage (a slice of the layers), anything that
    is not one of the decoder models (a Gemma 4 assistant drafts from its target's K/V)."""
    model = loaded("llama3-rope", tmp_path / "c")
    cache = model.make_cache(32)
    with pytest.raises(PackError, match="each with rows"):
        packed_forward(model, [RequestBlock([5], cache), RequestBlock([], model.make_cache(8))])
    with pytest.raises(PackError, match="share a cache"):
        packed_forward(model, [RequestBlock([5], cache), RequestBlock([6], cache)])
    Stage(0, 1, True, False).apply(model)
    with pytest.raises(PackError, match="pipeline stage"):
        packed_forward(model, [RequestBlock([5], model.make_cache(32))])
    with pytest.raises(PackError, match="not one of"):
        packed_forward(object(), [RequestBlock([5], None)])
    assistant = loaded("gemma4/assistant", tmp_path / "assistant")
    with pytest.raises(PackError, match="not a target"):
        packed_forward(assistant, [RequestBlock([5], None)])
