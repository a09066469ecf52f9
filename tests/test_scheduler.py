"""Scheduler: features, the compiled MLP, decisions within b0, the value system and training."""

import json
import os

import mlx.core as mx
import numpy as np
import pytest

from schedulers import threshold_mlp
from scripted import deterministic
from treegraft_mlx import calibrate as C
from treegraft_mlx import fixture_path, generate, load
from treegraft_mlx import timing as T
from treegraft_mlx.bench import first_per_category, read_prompts
from treegraft_mlx.timing import LatencyCurve
from treegraft_mlx.scheduler import (FEATURE_NAMES, LayerState, LearnedSchedule, SchedulerMLP,
                                     features, load_artifact, mlp_forward)
from treegraft_mlx.sampling import SamplerSettings
from treegraft_mlx.session import Session
from treegraft_mlx.tree import NEG_INF, DraftTree

from pathlib import Path

CALIBRATION = Path(__file__).parents[1] / "benchmarks/prompts/calibration.jsonl"


def small_tree() -> DraftTree:
    """root -> a(-1), b(-2); a -> c(-inf chain token), b -> d(-3)."""
    t = DraftTree.rooted_at(5)
    a, b = t.add(0, 10, -1.0), t.add(0, 11, -2.0)
    t.add(a, 12, NEG_INF)
    t.add(b, 13, -3.0)
    return t


def test_features_of_a_constructed_tree():
    t = small_tree()
    state = LayerState(layer=3, depth=5, context=99, called=[1], tree=t, frontier=[3, 4],
                       top_k=2, lookback=5)
    x = features(state, t_tgt_ms=40.0, t_mid_ms=8.0)
    f = dict(zip(FEATURE_NAMES, x.tolist()))
    assert len(x) == 17
    assert f["log1p_context"] == pytest.approx(np.log(100))
    assert f["log_t_tgt_over_t_mid"] == pytest.approx(np.log(5))
    assert f["layer_over_depth"] == pytest.approx(0.6)
    assert f["called_over_depth"] == pytest.approx(0.2)
    assert [f[f"called_layer_{j}"] for j in range(1, 6)] == [1, 0, 0, 0, 0]
    assert f["frontier_mean_depth"] == 2
    assert f["frontier_leaf_ratio"] == 1.0          # both leaves are on the frontier
    # Reselection (top 2 by score within the lookback): root (0) and a (-1), depths 0 and 1.
    assert f["collapse_debt"] == pytest.approx(2 - 0.5)
    assert f["reselect_other_depth_share"] == 1.0
    assert f["reselect_frontier_overlap"] == 0.0
    assert f["reselect_mean_score"] == pytest.approx(-0.5)


def constant_mlp(value: float) -> SchedulerMLP:
    mlp = SchedulerMLP.init(0)
    mlp.params["l3.weight"] = mx.zeros_like(mlp.params["l3.weight"])
    mlp.params["l3.bias"] = mx.array([value])
    return mlp


def test_compiled_mlp_equals_numpy_and_plain_forward():
    mlp = SchedulerMLP.init(3)
    rng = np.random.default_rng(0)
    mlp.params.update(in_mean=mx.array(rng.normal(size=17).astype(np.float32)),
                      in_std=mx.array(rng.uniform(0.5, 2, size=17).astype(np.float32)),
                      out_mean=mx.array([0.3]), out_std=mx.array([2.0]))
    x = rng.normal(size=(32, 17)).astype(np.float32)
    p = {k: np.array(v) for k, v in mlp.params.items()}
    z = (x - p["in_mean"]) / p["in_std"]
    h = np.maximum(z @ p["l1.weight"].T + p["l1.bias"], 0)
    h = np.maximum(h @ p["l2.weight"].T + p["l2.bias"], 0)
    want = (h @ p["l3.weight"].T + p["l3.bias"])[:, 0] * 2.0 + 0.3
    np.testing.assert_allclose(np.array(mlp.value(mx.array(x))), want, rtol=1e-5, atol=1e-5)
    np.testing.assert_allclose(np.array(mlp_forward(mlp.params, mx.array(x))), want, rtol=1e-5,
                               atol=1e-5)


def test_learned_schedule_follows_sign_and_stops_at_b0():
    t = small_tree()

    def first(mlp, called, b0=5, drafters=2):
        ahead = [LayerState(layer, 5, 50, called, t, [1, 2], 2, 5) for layer in range(2, 6)]
        return LearnedSchedule(mlp, 40.0, 8.0, b0).first_call(iter(ahead), drafters)

    assert first(constant_mlp(1.0), [1]) == 0
    assert first(constant_mlp(-1.0), [1]) is None
    assert first(constant_mlp(1.0), [1], b0=1) is None
    assert first(constant_mlp(1.0), [], drafters=1) is None      # no strong drafter: never
    # A positive value only where layer/depth > 0.7 (layers 4 and 5): the first of them.
    assert first(threshold_mlp("layer_over_depth", 0.7), []) == 2


def test_rows_up_to_the_previous_call_are_scored_first():
    """Grouping rows into evaluations changes the cost, never the decision: after a run whose
    first call was at position p, the next run scores rows 0..p first and builds no
    look-ahead past p when one of them calls; otherwise the rest is scored next."""
    t = small_tree()
    pulled = []

    def ahead(called=()):
        for i, layer in enumerate(range(2, 6)):
            pulled.append(i)
            yield LayerState(layer, 5, 50, list(called), t, [1, 2], 2, 5)

    def run(schedule, **kw):
        pulled.clear()
        before = schedule.evaluations
        return schedule.first_call(ahead(**kw), 2), len(pulled), schedule.evaluations - before

    s = LearnedSchedule(threshold_mlp("layer_over_depth", 0.7), 40.0, 8.0, 1)
    assert run(s) == (2, 4, 1)                  # no hint yet: every row, one evaluation
    assert run(s) == (2, 3, 1)                  # rows 0..2 only
    assert run(s, called=[1]) == (None, 1, 0)   # budget spent: nothing scored, hint kept
    assert run(s) == (2, 3, 1)
    s.mlp = threshold_mlp("layer_over_depth", 0.9)
    assert run(s) == (3, 4, 2)                  # the hint missed: the rest scored next
    s.mlp = threshold_mlp("layer_over_depth", 1.5)
    assert run(s) == (None, 4, 1) and s.last_call is None


def test_artifact_round_trip_and_clear_errors(tmp_path):
    mlp = SchedulerMLP.init(1)
    mlp.save(tmp_path / "a", {"b0": 3})
    back, meta = load_artifact(tmp_path / "a")
    x = mx.array(np.random.default_rng(1).normal(size=(4, 17)).astype(np.float32))
    assert mx.allclose(back.value(x), mlp.value(x)).item()
    assert meta["b0"] == 3 and meta["features"] == list(FEATURE_NAMES)
    (tmp_path / "a" / "scheduler.safetensors").unlink()
    with pytest.raises(FileNotFoundError, match="scheduler.safetensors"):
        load_artifact(tmp_path / "a")
    mlp.save(tmp_path / "b", {"b0": 3})
    meta_file = tmp_path / "b" / "scheduler.json"
    meta_file.write_text(json.dumps({**json.loads(meta_file.read_text()), "format_version": 99}))
    with pytest.raises(ValueError, match="format_version"):
        load_artifact(tmp_path / "b")


def test_training_recovers_a_learnable_rule():
    """Labels positive on early layers with a short frontier: the distilled MLP must get the
    held-out signs right (a broken trainer or normalisation would not)."""
    rng = np.random.default_rng(0)
    dataset = {}
    for p in range(12):
        rows = []
        for _ in range(60):
            x = rng.normal(size=17).astype(np.float32)
            x[1], x[2] = 40.0, 8.0                      # constant timing features
            x[4] = rng.integers(1, 6) / 5               # layer / depth
            label = (1.0 if x[4] < 0.5 else -1.0) * (0.5 + abs(x[11]))
            rows.append({"x": x.tolist(), "label": label})
        dataset[f"p{p}"] = rows
    mlp, metrics = C.train_mlp(dataset)
    assert metrics["heldout_prompts"] == 3
    assert metrics["heldout"]["sign_accuracy"] > 0.9
    assert metrics["heldout"]["gain_policy"] > 0.75 * metrics["heldout"]["gain_oracle"]


@pytest.fixture(scope="module")
def family():
    return load(fixture_path())


def test_labelling_explores_counterfactuals_without_changing_the_output(family):
    """Both branches of every decision are played and undone; the committed tokens are still
    exactly the target's greedy output, and each label is the value difference."""
    prompt = first_per_category(read_prompts(CALIBRATION), 1)[0]["prompt"]
    ids = family.tokenizer.encode(prompt)
    session = Session(family)
    curve = LatencyCurve({1: 10.0, 64: 40.0})
    rows = C.label_prompt(session, ids, T.Timing(30.0, 5.0), curve,
                          C.CalibrationRun(max_tokens=24, b0=5), np.random.default_rng(0))
    got = session.history.tokens[len(ids):]
    want = generate(family, prompt, "ar", max_tokens=len(got)).token_ids
    assert got[:len(want)] == want and len(want) >= 24
    assert rows and {r["layer"] for r in rows} == set(range(1, session.tree.depth + 1))
    for r in rows:
        b = r["branches"]
        assert r["label"] == pytest.approx(b["tokens_call"] / b["ms_call"]
                                           - b["tokens_skip"] / b["ms_skip"])
        assert len(r["x"]) == 17 and b["ms_call"] > 0 and b["tokens_skip"] >= 1


def test_sampled_labels_weigh_every_path_by_its_probability(family):
    """With sampling, both branches are valued by the expected committed tokens (not one draw),
    so labels are fractional; the step itself samples."""
    prompt = first_per_category(read_prompts(CALIBRATION), 1)[0]["prompt"]
    session = Session(family)
    rows = C.label_prompt(session, family.tokenizer.encode(prompt), T.Timing(30.0, 5.0),
                          LatencyCurve({1: 10.0, 64: 40.0}),
                          C.CalibrationRun(12, 5, settings=SamplerSettings(temp=0.7, top_p=0.95)),
                          np.random.default_rng(0))
    tokens = [r["branches"][k] for r in rows for k in ("tokens_call", "tokens_skip")]
    assert rows and all(1.0 <= t <= 6.0 for t in tokens)
    assert any(abs(t - round(t)) > 1e-3 for t in tokens)
    for r in rows:
        b = r["branches"]
        assert r["label"] == pytest.approx(b["tokens_call"] / b["ms_call"]
                                           - b["tokens_skip"] / b["ms_skip"])


def test_dataset_resumes_after_an_interruption(family, tmp_path, monkeypatch):
    prompts = read_prompts(CALIBRATION)[:3]
    calls = []

    def fake_label(session, ids, timing, curve, run, rng):
        calls.append(len(ids))
        return [{"x": [0.0] * 17, "label": 1.0, "layer": 1, "branches": {}}]

    monkeypatch.setattr(C, "label_prompt", fake_label)
    monkeypatch.setattr(C, "verification_latency", lambda target, sizes: {1: 10.0, 64: 40.0})
    C.build_dataset(family, prompts[:2], tmp_path, T.Timing(30.0, 5.0))
    with open(tmp_path / C.DATASET, "a") as f:
        f.write('{"prompt_id": "torn')                 # a write cut by a crash
    done = C.build_dataset(family, prompts, tmp_path, T.Timing(30.0, 5.0))
    assert len(calls) == 3 and sorted(done) == sorted(p["id"] for p in prompts)
    with pytest.raises(ValueError, match="was labelled with"):
        C.build_dataset(family, prompts, tmp_path, T.Timing(30.0, 5.0),
                        C.CalibrationRun(settings=SamplerSettings(temp=0.7)))


def test_costs_are_measured_once_per_key_and_a_damaged_cache_is_remeasured(family, tmp_path):
    measured = []

    def fake_measure():
        measured.append(1)
        return T.Timing(33.0, 4.0)

    cache = tmp_path / "timings.json"
    key = T.timing_key(family, family.tree)
    assert T.cached(T.Timing, key, fake_measure, cache) == T.Timing(33.0, 4.0)
    assert T.cached(T.Timing, key, fake_measure, cache) == T.Timing(33.0, 4.0)
    assert len(measured) == 1
    costs = T.StepCosts((1, 2, 3), (20.0, 24.0, 23.0), 15.0, 1.0, 0.5)
    steps_key = T.step_costs_key(family, family.tree)
    assert steps_key != key
    assert T.cached(T.StepCosts, steps_key, lambda: costs, cache) == costs
    assert T.cached(T.StepCosts, steps_key, lambda: 1 / 0, cache) == costs   # both kept
    assert T.cached(T.Timing, key, fake_measure, cache) == T.Timing(33.0, 4.0)
    cache.write_text("{not json")
    assert T.cached(T.Timing, key, fake_measure, cache) == T.Timing(33.0, 4.0)
    assert len(measured) == 2


def test_costs_are_keyed_by_the_model_on_disk_not_its_path(tmp_path):
    """Weights rewritten in place (a retrained family) are measured afresh; the same files
    reached by another path are not."""
    model = tmp_path / "target"
    model.mkdir()
    (model / "config.json").write_text('{"hidden_size": 8}')
    weights = model / "model.safetensors"
    weights.write_bytes(b"old weights")
    first = T.model_key(model)
    assert T.model_key(tmp_path / "." / "target") == first
    os.utime(weights, ns=(1, 10**18))
    assert T.model_key(model) != first
    changed = T.model_key(model)
    (model / "config.json").write_text('{"hidden_size": 16}')
    assert T.model_key(model) != changed
    assert T.model_key(None) == "None"


def test_step_costs_pad_and_price_each_size():
    costs = T.StepCosts((1, 2, 3, 4, 6), (20.0, 24.0, 23.0, 30.0, 29.0), ar_ms=15.0,
                        overhead_ms=1.0, draft_ms=0.5)
    assert [costs.rows_for(n) for n in (1, 2, 3, 4, 5, 6, 7)] == [1, 3, 3, 6, 6, 6, 7]
    assert costs.step_ms().tolist() == [15.0, 24.0, 24.0, 30.0, 30.0, 30.0]
    # Past the measured context every extra row costs more (padding rows too).
    far = T.StepCosts((1, 2, 3), (20.0, 24.0, 23.0), 15.0, 1.0, 0.5, row_context_ms=0.01)
    assert far.step_ms(T.LATENCY_CONTEXT + 100).tolist() == pytest.approx([15.0, 26.0, 26.0])


def test_costs_are_measured_when_a_family_loads(tmp_path, monkeypatch):
    from treegraft_mlx import probe as E

    measured = []
    monkeypatch.setenv("TREEGRAFT_CACHE", str(tmp_path))
    monkeypatch.setattr(E, "measure_timing",
                        lambda fam, tree: measured.append("timing") or T.Timing(33.0, 4.0))
    monkeypatch.setattr(E, "measure_step_costs", lambda fam, tree: measured.append("steps")
                        or T.StepCosts((1, 2), (20.0, 24.0), 15.0, 1.0, 0.5))
    load(fixture_path(), warmup=False)
    assert measured == []
    family = load(fixture_path())
    assert sorted(measured) == ["steps", "timing"]
    assert E.scheduler_timing(family, family.tree) == T.Timing(33.0, 4.0)
    load(fixture_path())
    assert len(measured) == 2                               # cached per model pair and device


def test_value_offset_candidates_and_end_to_end_choice():
    """Offsets: 0, dataset call-rate quantiles, and 'never'; a shifted MLP calls iff the value
    exceeds the offset; the tuner measures every candidate and keeps the fastest."""
    mlp = threshold_mlp("frontier_mean_depth", 1.5)
    x = np.zeros((100, 17), np.float32)
    x[:, FEATURE_NAMES.index("frontier_mean_depth")] = np.linspace(0.0, 4.0, 100)
    offsets = C.candidate_offsets(mlp, x)
    assert 0.0 in offsets and offsets == sorted(offsets)
    values = np.array(mlp.value(mx.array(x)))
    for o in offsets:
        np.testing.assert_allclose(np.array(C.shifted(mlp, o).value(mx.array(x))), values - o,
                                   atol=1e-5)
    assert not (np.array(C.shifted(mlp, offsets[-1]).value(mx.array(x))) > 0).any()

    prompts = read_prompts(CALIBRATION)[:1]
    family = deterministic(load(fixture_path()))   # sizing and stretches never follow load
    best, table = C.tune_offset(family, prompts, mlp, T.Timing(30.0, 5.0), [0.0, offsets[-1]],
                                C.CalibrationRun(max_tokens=12, b0=5), repeats=2)
    by_offset = {row["offset"]: row for row in table}
    assert by_offset[offsets[-1]]["drafter_calls"] == 0 < by_offset[0.0]["drafter_calls"]
    assert best == max(table, key=lambda r: r["tokens_per_sec"])["offset"]


def budget_rows(label_after_call: float) -> list[dict]:
    """One step of rows at layers 1..5: layer 1 before any call (label 0.5), a call at layer 1,
    then layers 2..5 after one call, each labelled `label_after_call`."""
    rows = []
    for layer in range(1, 6):
        c = 0 if layer == 1 else 1
        x = np.zeros(17, np.float32)
        x[FEATURE_NAMES.index("layer_over_depth")] = layer / 5
        x[FEATURE_NAMES.index("called_over_depth")] = c / 5
        rows.append({"x": x.tolist(), "layer": layer,
                     "label": 0.5 if layer == 1 else label_after_call,
                     "branches": {"tokens_call": 2, "ms_call": 45.0,
                                  "tokens_skip": 2, "ms_skip": 40.0}})
    return rows


def test_budget_stops_calls_where_deciding_costs_more_than_it_gains():
    """b0 is the first calls-this-step count whose policy gain (label mass of its calls) is at
    most the cost of its decision runs: one run per step after the c-th call, each costing
    tokens/ms - tokens/(ms + decision_ms) of the skip branch."""
    run_cost = 2 / 40.0 - 2 / 41.0                      # decision_ms = 1
    small = {"p0": budget_rows(0.0002), "p1": budget_rows(0.0002)}
    table = C.budget_table(small, constant_mlp(1.0), 1.0, 5)
    assert [r["states"] for r in table[:2]] == [2, 8] and [r["runs"] for r in table[:2]] == [2, 2]
    assert table[0]["gain"] == pytest.approx(1.0) and table[1]["gain"] == pytest.approx(0.0016)
    assert table[1]["cost"] == pytest.approx(2 * run_cost)
    assert C.choose_b0(table, 5) == 1                   # 0.0016 gained < 0.0024 spent
    large = {"p0": budget_rows(0.01)}
    # Paying after one call; no decision was ever seen after two: none is made there.
    assert C.choose_b0(C.budget_table(large, constant_mlp(1.0), 1.0, 5), 5) == 2
    assert C.choose_b0(C.budget_table(large, constant_mlp(1.0), 1.0, 2), 2) == 2
    # Only the policy's calls count: a scheduler that never calls after a call gains nothing.
    never_after = threshold_mlp("called_over_depth", 0.1)
    never_after.params["l3.weight"] = -never_after.params["l3.weight"]   # value = 0.1 - x
    table = C.budget_table(large, never_after, 1.0, 5)
    assert table[0]["gain"] == pytest.approx(0.5) and table[1]["gain"] == 0.0
    assert C.choose_b0(table, 5) == 1
    assert C.choose_b0(C.budget_table(large, constant_mlp(-1.0), 1.0, 5), 5) == 0


def test_calibration_timing_is_fixed_per_work_directory(tmp_path):
    measured = []

    def measure():
        measured.append(1)
        return T.Timing(30.0 + len(measured), 5.0)

    first = C.dataset_timing(tmp_path, measure)
    assert C.dataset_timing(tmp_path, measure) == first == T.Timing(31.0, 5.0)
    assert len(measured) == 1
