"""Requests decoded together (batch.py): each request's output is exactly what it decodes to
alone, however the requests overlap, stop or fail; every step runs one forward for all."""

from __future__ import annotations

import dataclasses
from pathlib import Path

import numpy as np
import pytest

from scripted import deterministic
from treegraft_mlx import fixture_path, generate, load
from treegraft_mlx import batch as batch_module
from treegraft_mlx.batch import Batch, decode_together, lane
from treegraft_mlx.bench import first_per_category, read_prompts
from treegraft_mlx.pricing import Candidate, plan_jointly, rows_ms
from treegraft_mlx.tree import DraftTree, depths, path_probability, plan_verification
from scripted import scripted_step_costs

SUITE = Path(__file__).parents[1] / "benchmarks/prompts/public.jsonl"

REPETITIVE = "a = 1\nb = 2\n" * 6


@pytest.fixture(scope="module")
def family():
    return deterministic(load(fixture_path()))


def prompts(n: int) -> list[str]:
    return [p["prompt"] for p in first_per_category(read_prompts(SUITE), 2)][:n]


def joined(responses) -> tuple[list[int], str, str]:
    return ([t for r in responses for t in r.tokens], "".join(r.text for r in responses),
            responses[-1].finish_reason)


def alone(family, request: dict) -> tuple[list[int], str, str]:
    out = generate(family, request["prompt"], request.get("strategy", "treegraft"),
                   max_tokens=request["max_tokens"], stop=request.get("stop", ()))
    return out.token_ids, out.text, out.finish_reason


MIXES = {
    1: ([dict(strategy="treegraft", max_tokens=48)], [0]),
    2: ([dict(strategy="ar", max_tokens=40), dict(strategy="ngram", max_tokens=17)], [0, 3]),
    3: ([dict(strategy="treegraft", max_tokens=64, stop=["\n\n"]),
         dict(strategy="draft", max_tokens=5), dict(strategy="chain:3", max_tokens=30)],
        [0, 1, 6]),
    4: ([dict(strategy="treegraft", max_tokens=60), dict(strategy="ngram", max_tokens=33),
         dict(strategy="ar", max_tokens=1), dict(strategy="treegraft-fixed:2,4", max_tokens=50,
                                                 stop=["b ="])], [0, 2, 2, 9]),
}


@pytest.mark.parametrize("n", sorted(MIXES))
def test_staggered_greedy_requests_equal_each_request_alone(family, n):
    """1 to 4 requests joining at different steps, with different strategies, max_tokens and
    stop strings, some ending early: each request's tokens, text and finish reason are what
    it decodes to alone."""
    requests, starts = MIXES[n]
    texts = prompts(n - 1) + [REPETITIVE]
    requests = [dict(r, prompt=p) for r, p in zip(requests, texts)]
    got = decode_together(family, requests, starts)
    for request, responses in zip(requests, got):
        assert joined(responses) == alone(family, request), request


@pytest.mark.parametrize("n", [3, 4])
def test_staggered_requests_over_a_slot_pool_equal_each_request_alone(family, monkeypatch, n):
    """The same, the lanes' caches slots of one pool (the GPU's default, slots.py): rows
    written in one scatter, AR rows attending in one call; with three `ar` requests beside
    the mixes, so that every step's AR rows share that call."""
    from treegraft_mlx.slots import SlotPool
    writes, real = [], SlotPool.write_rows
    monkeypatch.setattr(SlotPool, "write_rows",
                        lambda self, *a: writes.append(len(self.taken)) or real(self, *a))
    requests, starts = MIXES[n] if n == 4 else ([dict(strategy="ar", max_tokens=m)
                                                 for m in (30, 12, 25)], [0, 0, 4])
    texts = prompts(n - 1) + [REPETITIVE]
    requests = [dict(r, prompt=p) for r, p in zip(requests, texts)]
    got = decode_together(family, requests, starts, pooled=True)
    assert writes and max(writes) >= 3       # three lanes, at least, in one pooled forward
    for request, responses in zip(requests, got):
        assert joined(responses) == alone(family, request), request


def test_a_batch_runs_one_forward_for_all_its_requests(family, monkeypatch):
    """While several requests run, each step runs one forward with every lane's rows; a lane
    left alone decodes as alone (its own forwards, pipelined)."""
    packed = []

    def recording(target, blocks):
        packed.append(len(blocks))
        return real(target, blocks)

    real = batch_module.run_together
    monkeypatch.setattr(batch_module, "run_together", recording)
    batch = Batch(family)
    for i, (p, n) in enumerate(zip(prompts(3), (8, 24, 40))):
        batch.add(lane(family, p, "ngram", max_tokens=n, tag=i))
    lanes, alone_steps = [], 0
    while batch.lanes:
        lanes.append(len(batch.lanes))
        before = len(packed)
        batch.step()
        if lanes[-1] > 1:
            assert packed[before:] == [lanes[-1]]
        else:
            alone_steps += 1
            assert len(packed) == before
    assert 3 in lanes and 2 in lanes and alone_steps > 0
    # The step a lane is left alone, it still runs the row it asked for while together.
    assert batch.rows >= batch.lanes_run and 0 <= batch.lanes_run - sum(packed) <= 1


@pytest.mark.parametrize("strategy", ["ar", "treegraft"])
def test_a_request_alone_streams_each_token_in_the_step_that_read_it(family, strategy):
    """A step returns every token its lanes have read: a lane goes on to its next want at the
    start of the next step, so a request alone in a batch (which runs and reads its own
    forwards) never holds a token back a forward, its first token included."""
    from treegraft_mlx.generate import encode_prompt

    prompt = prompts(1)[0]
    batch, read = Batch(family), len(encode_prompt(family.tokenizer, prompt))
    batch.add(lane(family, prompt, strategy, max_tokens=40))
    one, streamed, steps = batch.lanes[0], [], 0
    while batch.lanes:
        for _, r in batch.step():
            streamed += r.tokens
        steps += 1
        if batch.lanes:     # (its last block may stop inside what it read: max_tokens)
            assert len(one.decoder.session.history.tokens) == read + len(streamed), steps
    assert len(streamed) == 40 and steps <= 41


def test_a_cancelled_request_leaves_and_the_others_finish_as_alone(family):
    requests = [dict(prompt=p, strategy="treegraft", max_tokens=40) for p in prompts(2)]
    batch = Batch(family)
    lanes = [lane(family, **r, tag=i) for i, r in enumerate(requests)]
    for one in lanes:
        batch.add(one)
    got = {0: [], 1: []}
    step = 0
    while batch.lanes:
        if step == 3:
            lanes[0].cancelled = True
        for one, r in batch.step():
            got[one.tag].append(r)
        step += 1
    assert lanes[0] not in batch.lanes and len(got[0]) <= 3
    assert joined(got[1]) == alone(family, requests[1])


def test_a_failing_request_reports_its_error_and_the_others_finish(family):
    requests = [dict(prompt=p, strategy="ngram", max_tokens=30) for p in prompts(2)]
    batch = Batch(family)
    broken = lane(family, **requests[0], tag=0)
    wants, sent = broken.wants, []

    def failing():              # the lane's decoding, raising at its 7th step
        value = yield broken.want
        while True:
            sent.append(value)
            if len(sent) == 7:
                raise RuntimeError("planted failure")
            value = yield wants.send(value)

    broken.wants = failing()
    broken.want = next(broken.wants)
    batch.add(broken)
    batch.add(lane(family, **requests[1], tag=1))
    errors, got = [], []
    while batch.lanes:
        for one, r in batch.step():
            if isinstance(r, Exception):
                errors.append((one.tag, str(r)))
            elif one.tag == 1:
                got.append(r)
    assert errors == [(0, "planted failure")]
    assert joined(got) == alone(family, requests[1])


def test_a_target_that_cannot_pack_is_refused_with_the_reason(family):
    class Stage:
        pass

    bad = dataclasses.replace(family, target=Stage())
    with pytest.raises(ValueError, match="cannot decode requests together"):
        Batch(bad)


# --- one plan for the batch's forward (pricing.plan_jointly) -------------------------------

def random_tree(rng, n: int) -> tuple[list[int], np.ndarray]:
    """Parents (each before its children) and acceptance estimates of a random tree."""
    parent = [-1] + [int(rng.integers(0, v)) for v in range(1, n)]
    return parent, rng.uniform(0.05, 1.0, n)


def candidate(parent, accept, costs, chain=0, context=300, rate=0.05):
    prob = path_probability(parent, accept)
    return Candidate(prob, depths(parent), 1 + chain, context, rate, costs)


def test_a_joint_plan_of_one_request_is_its_own_plan():
    """One request and nothing else: exactly plan_verification, chains included."""
    rng, costs = np.random.default_rng(1), scripted_step_costs()
    for trial in range(200):
        parent, accept = random_tree(rng, int(rng.integers(1, 40)))
        chain, rate = int(rng.integers(0, 4)), float(rng.uniform(0.0, 0.2))
        tree = DraftTree(token=list(range(len(parent))), parent=parent,
                         depth=depths(parent).tolist())
        alone = plan_verification(tree, accept, costs.step_ms(300)[chain:], rate)
        joint, = plan_jointly([candidate(parent, accept, costs, chain, rate=rate)])
        assert joint.keep.tolist() == alone.keep.tolist(), trial
        assert joint.expected == pytest.approx(alone.expected)
        assert joint.step_ms == pytest.approx(alone.step_ms)


def test_a_joint_plan_keeps_every_root_closed_paths_and_prices_drafts_out_as_it_grows():
    rng, costs = np.random.default_rng(2), scripted_step_costs()
    parent, accept = random_tree(rng, 24)
    drafts = []
    for lanes in (1, 2, 4, 8):
        plans = plan_jointly([candidate(parent, accept, costs)] * lanes, other_rows=1)
        for plan in plans:
            kept = set(plan.keep.tolist())
            assert 0 in kept and all(parent[v] in kept for v in kept if v), plan.keep
        assert len({p.step_ms for p in plans}) == 1     # one forward, priced once
        drafts.append(sum(len(p.keep) - 1 for p in plans) / lanes)
    # The batch's rate is the sum of its requests': each one's drafts are worth less.
    assert drafts == sorted(drafts, reverse=True) and drafts[0] > drafts[-1]
    # Identical requests share the drafts evenly (ties go to the earlier request first).
    plans = plan_jointly([candidate(parent, accept, costs)] * 3)
    assert max(len(p.keep) for p in plans) - min(len(p.keep) for p in plans) <= 1


def test_a_joint_plan_ranks_drafts_across_requests():
    """A request whose drafts are near-certain gets the rows before one whose drafts are
    long shots; rows past the measured table are priced on its last slope."""
    costs = scripted_step_costs()
    parent = [-1, 0, 1, 2, 3]
    sure = candidate(parent, np.full(5, 0.98), costs, rate=0.02)
    doubtful = candidate(parent, np.full(5, 0.15), costs, rate=0.02)
    a, b = plan_jointly([doubtful, sure])
    assert len(b.keep) == 5 and len(a.keep) < len(b.keep)
    table = costs.step_ms(300)
    more = rows_ms(table, len(table) + 3)
    assert more[:len(table)].tolist() == table.tolist()
    assert np.allclose(np.diff(more[len(table) - 1:]), table[-1] - table[-2])


@pytest.mark.parametrize("strategy", ["treegraft", "ngram"])
def test_a_request_joined_at_any_step_reads_its_forward_in_flight_first(family, strategy):
    """A tree strategy alone queues its next AR forward ahead (pipelined); a second request
    joining at any of its first steps must not make it run that row again."""
    text, other = prompts(2)
    want = alone(family, dict(prompt=text, strategy=strategy, max_tokens=40))
    for join in range(1, 9):
        got = decode_together(family, [dict(prompt=text, strategy=strategy, max_tokens=40),
                                       dict(prompt=other, strategy="ar", max_tokens=6)],
                              [0, join])
        assert joined(got[0]) == want, join


@pytest.mark.parametrize("temp", [0.0, 1.0], ids=["greedy", "sampled"])
def test_ar_requests_together_queue_their_next_row_before_each_read(family, monkeypatch, temp):
    """AR requests together are pipelined as one alone is: at every readback after its first
    forward, a lane's next row (its lazy token's) is already in the batch's queued forward, so
    on a GPU the device works while the host accepts and streams; and a step waits once."""
    from treegraft_mlx.sampling import SamplerSettings
    from treegraft_mlx.waits import Waits

    batch, ahead = Batch(family), []
    real = batch_module.read_back

    def reading(*parts):
        for one in batch.lanes:
            session = one.decoder.session
            if isinstance(one.want, batch_module.Read) and session.history is not None:
                ahead.append(session.cache.offset - len(session.history.tokens))
        return real(*parts)

    monkeypatch.setattr(batch_module, "read_back", reading)
    settings = SamplerSettings(temp=temp)
    requests = [dict(prompt=p, strategy="ar", max_tokens=n, seed=5, settings=settings)
                for p, n in zip(prompts(3), (12, 20, 20))]
    for i, r in enumerate(requests):
        batch.add(lane(family, **r, tag=i))
    waits, got = [], [[] for _ in requests]
    while len(batch.lanes) > 1:
        with Waits() as counted:
            for one, r in batch.step():
                got[one.tag] += r.tokens
        waits.append(counted.count)
    assert ahead and set(ahead) == {1}
    assert max(waits[1:]) == 1 and waits.count(1) >= 18     # the first: the prefills
    while batch.lanes:
        for one, r in batch.step():
            got[one.tag] += r.tokens
    for r, tokens in zip(requests, got):
        assert tokens == generate(family, r["prompt"], "ar", max_tokens=r["max_tokens"],
                                  seed=5, settings=settings).token_ids


def test_a_chain_in_a_batch_is_priced_against_the_requests_it_delays(family, monkeypatch):
    """A priced request in company chooses its chain length for the batch (CallPolicy.shared,
    given the other lanes' tokens a step and the step's time), not for itself, and its steps
    in the batch teach the call policy no times: those are the batch's."""
    from treegraft_mlx.pricing import CallPolicy

    seen, chose = [], []
    real_shared, real_choose = CallPolicy.shared, CallPolicy.choose
    monkeypatch.setattr(CallPolicy, "shared",
                        lambda self, b, c: seen.append(c) or real_shared(self, b, c))
    monkeypatch.setattr(CallPolicy, "choose",
                        lambda self, b: chose.append(b) or real_choose(self, b))
    texts = prompts(3)
    generate(family, texts[0], "treegraft", max_tokens=64)       # timed alone first
    policies = list(family.learned.call_policies.values())
    assert policies and chose
    batch = Batch(family)
    for i, p in enumerate(texts):
        batch.add(lane(family, p, "treegraft", max_tokens=40, tag=i))
    batch.step()                                   # untimed yet: each plans as alone
    steps = 0
    while len(batch.lanes) == 3:
        tries, asked = [p.tries.copy() for p in policies], len(chose)
        batch.step()
        if len(batch.lanes) == 3:
            steps += 1
            assert len(chose) == asked
            assert all(np.array_equal(t, p.tries) for t, p in zip(tries, policies))
    assert steps > 5 and seen
    assert all(c.tokens >= 2 * 0.5 and c.ms > 0 for c in seen)
