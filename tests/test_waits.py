"""Host waits per step: every strategy, greedy and sampled, waits on the device at most once
per target forward (the first step after a prefill aside) and, where the verdict is computed
on the device (a GPU's placement, forced here), reads at most 4 KB back.

Counted by wrapping MLX's readback entry points (waits.Waits), not from the decoder's own
bookkeeping, between consecutive blocks of the stream: each block after the prefill's token
is one target forward. On MLX's CPU backend the step reads its verified rows back whole and
accepts in numpy (verify.queue_verdict), still in one wait.
"""

from __future__ import annotations

import time

import mlx.core as mx
import numpy as np
import pytest

from scripted import deterministic
from treegraft_mlx import fixture_path, generate, load, probe
from treegraft_mlx import history as history_module
from treegraft_mlx import verify as verify_module
from treegraft_mlx.engine import stream_generate
from treegraft_mlx.pricing import CallPolicy
from treegraft_mlx.sampling import SamplerSettings
from treegraft_mlx.timing import StepCosts
from treegraft_mlx.waits import Waits

STRATEGIES = ("ar", "ngram", "draft", "treegraft", "chain:2")
REGIMES = (SamplerSettings(), SamplerSettings(temp=0.8, top_p=0.9))
MAX_BYTES = 4096
# A flat verification curve (a Mac GPU's bf16 one): the sizer verifies trees, not AR steps.
FLAT = StepCosts(tuple(range(1, 33)), (22.5,) * 16 + (30.0,) * 16, ar_ms=22.2, overhead_ms=0.3,
                 draft_ms=0.3)
# Repeats early in a long prompt: the n-gram drafter reads the prompt's rows' scores.
BODY = ("def add(a, b):\n    return a + b\n\n\ndef sub(a, b):\n    return a - b\n\n\n"
        "class Point:\n    def __init__(self, x, y):\n        self.x = x\n        self.y = y\n\n")
PROMPT = BODY * 4 + "def mul(a, b):\n"


@pytest.fixture(scope="module")
def family():
    """The fixture family with no end-of-sequence token: every run decodes its max_tokens."""
    family = deterministic(load(fixture_path()))
    family.tokenizer._eos_token_ids.clear()
    return family


@pytest.fixture(autouse=True)
def flat_costs(monkeypatch):
    monkeypatch.setattr(probe, "step_costs", lambda family, tree, refresh=False: FLAT)


@pytest.fixture(params=("cpu", "gpu"))
def placement(request, monkeypatch) -> str:
    """Where verdicts and scores are computed: as on this CPU, or on the device as a GPU
    places them (run here on MLX's CPU kernels)."""
    if request.param == "gpu":
        monkeypatch.setattr(verify_module, "on_gpu", lambda: True)
        monkeypatch.setattr(history_module, "on_gpu", lambda: True)
    return request.param


def per_step(family, strategy: str, settings: SamplerSettings, max_tokens: int = 24
             ) -> np.ndarray:
    """(steps, 2): waits and bytes read back during each target forward after the prefill."""
    marks = []
    with Waits() as waits:
        for _ in stream_generate(family, PROMPT, strategy, max_tokens=max_tokens,
                                 settings=settings, seed=3):
            marks.append(waits.snapshot())
    return np.diff(np.array(marks), axis=0)


@pytest.mark.parametrize("settings", REGIMES, ids=("greedy", "sampled"))
@pytest.mark.parametrize("strategy", STRATEGIES)
def test_one_wait_per_target_forward(family, strategy, settings, placement):
    steps = per_step(family, strategy, settings)
    assert len(steps) >= 5, strategy
    later = steps[1:]                        # the first step after the prefill may catch up
    assert later[:, 0].max() <= 1 and later[:, 0].min() == 1, (strategy, later[:, 0].tolist())
    if placement == "gpu":
        assert later[:, 1].max() <= MAX_BYTES, (strategy, later[:, 1].tolist())


@pytest.mark.parametrize("settings", REGIMES, ids=("greedy", "sampled"))
def test_chains_on_every_step_wait_once(family, settings, placement, monkeypatch):
    """A call on every step: the chain is drafted, verified and read back in one wait."""
    monkeypatch.setattr(CallPolicy, "peek", lambda self, bucket: 3)
    for strategy in ("draft", "treegraft"):
        steps = per_step(family, strategy, settings)
        assert steps[1:, 0].max() == 1, strategy
        assert placement == "cpu" or steps[1:, 1].max() <= MAX_BYTES, strategy


def test_a_second_readback_in_the_step_is_counted(family, monkeypatch):
    """The count can fail: a walk that reads the device once more is seen at every tree step."""
    walk = verify_module.walk

    def reads_again(tree, verdict, settings):
        mx.eval(mx.zeros(1))
        return walk(tree, verdict, settings)

    monkeypatch.setattr(verify_module, "walk", reads_again)
    monkeypatch.setattr(CallPolicy, "peek", lambda self, bucket: 3)
    steps = per_step(family, "draft", REGIMES[0])
    assert steps[1:, 0].max() == 2


def test_every_readback_entry_point_is_counted():
    one, row = mx.array(3.0), mx.arange(4, dtype=mx.float32)
    with Waits() as waits:
        mx.eval(row)
        one.item(), row.tolist(), int(one), float(one), bool(one)
        np.array(row), np.asarray(row)
        np.array([1, 2])                     # numpy data: no wait
    assert waits.count == 8
    assert waits.nbytes == 4 + 16 + 4 + 4 + 4 + 16 + 16
    assert mx.eval.__name__ == "eval" and np.array.__name__ == "array"   # restored


def test_seconds_are_the_time_inside_waits_only():
    """A lazy product computed inside the wait counts; host time between waits does not, and
    queueing one (mx.async_eval) is timed apart, no wait."""
    a = mx.random.normal((512, 512), key=mx.random.key(0))
    with Waits() as waits:
        mx.async_eval(a @ a)
        product = a @ a @ a
        time.sleep(0.2)                     # host work: no wait
        np.array(product)
    assert waits.count == 1 and 0 < waits.seconds < 0.2 and 0 < waits.queueing < 0.2
    assert mx.async_eval.__name__ == "async_eval"     # restored


def test_greedy_output_is_ar_s_in_both_placements(family, placement):
    """The verdict's two placements give the same greedy output, `ar`'s, scores included
    (the n-gram drafter reads them back: a wrong score changes its trees, not the output,
    so the history itself is compared too)."""
    from treegraft_mlx.session import Session

    want = generate(family, PROMPT, "ar", max_tokens=24).token_ids
    scored = {}
    for strategy in ("ngram", "draft", "treegraft"):
        session = Session(family)
        got = generate(family, PROMPT, strategy, max_tokens=24, session=session)
        assert got.token_ids == want, strategy
        history = session.history
        scored[strategy] = history.lp[len(family.tokenizer.encode(PROMPT)):history.committed]
    reference = family.target(mx.array([family.tokenizer.encode(PROMPT) + want]))[0]
    n = len(family.tokenizer.encode(PROMPT))
    x = np.array(reference[n:n + len(want) - 1], dtype=np.float64)
    lp = x - np.log(np.exp(x - x.max(1, keepdims=True)).sum(1, keepdims=True)) - x.max(1, keepdims=True)
    expected = lp[np.arange(len(want) - 1), want[1:]]
    for strategy in ("ngram", "treegraft"):
        got = scored[strategy][:len(expected)]
        assert np.isfinite(got).all() and np.allclose(got, expected, atol=1e-3), strategy


def test_a_scored_ar_read_builds_nothing_behind_the_next_forward(family, placement,
                                                                 monkeypatch):
    """An AR step's token and score are packed when the forward is queued, not when read:
    built at read time, the pack is a new op behind the next forward (queued before the
    read), and reading it waits for that forward too (measured here: 3-4 ms a stretch step of
    tg-tiny's ~22). The read converts the queued pack alone; the token and score it gives are
    those read separately. With prefetches waiting, the read packs them (the decoder then
    queues nothing behind the forward: Decoder._ar_step)."""
    from treegraft_mlx import readback
    from treegraft_mlx.session import Session
    from treegraft_mlx.step import ArForward

    settings = SamplerSettings(temp=0.8)
    session = Session(family)
    root = session.prefill(family.tokenizer.encode(PROMPT), settings, np.random.default_rng(0))
    history = session.history
    forward = ArForward(family.target, session.cache, settings, mx.random.key(3), session.saw,
                        True)
    queued = forward(mx.array(root))
    after = forward(queued.token)
    built: list[int] = []
    real_pack = readback.pack
    monkeypatch.setattr(readback, "pack", lambda *p: built.append(len(p)) or real_pack(*p))
    assert not history.pending()
    want_token = int(queued.token.item())
    want_score = queued.score.finish(np.array(queued.score.part.reshape(-1)), [want_token])
    with Waits() as waits:
        token = queued.read(history)
    assert built == [] and waits.snapshot()[0] == 1
    assert token == want_token and history.lp[history.committed] == pytest.approx(want_score[0])
    history.extend([token])
    history.prefetch([0, 1, 2])
    assert history.pending()
    after.read(history)
    assert built == [3]                            # token, score and the one prefetch
