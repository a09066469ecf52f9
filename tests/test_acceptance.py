"""Acceptance estimates: features from drafter-side evidence, the logistic fit, reliability."""

import numpy as np
import pytest

from treegraft_mlx.acceptance import (FEATURES, AcceptanceModel, calibrate_regime, fit,
                                      logistic, node_features, reliability, save)
from treegraft_mlx.tree import DraftTree


def evidence_tree() -> DraftTree:
    t = DraftTree.rooted_at(5)
    a = t.add(0, 7, -0.1, 4, 10, ngram_lp=-0.2)          # n-gram, long match
    t.add(0, 7, -0.1, 2, 3, ngram_lp=-1.0)               # a second vote for the same token
    t.add(0, 8, -2.0, 1, 2, ngram_lp=-3.0)               # n-gram, short match
    t.add(a, 9, 0.0)                                     # a strong-drafter graft
    t.draft_lp = [float("nan"), -0.05, -4.0, -0.3]
    t.draft_rank = [-1, 0, 3, 0]
    return t


def test_features_read_the_drafters_evidence():
    x = node_features(evidence_tree(), n_max=5, depth=5)
    f = dict(zip(FEATURES, x[1]))
    assert f["ngram"] == 1 and f["ngram_match"] == pytest.approx(0.8)
    assert f["ngram_target_lp"] == pytest.approx(-0.02) and f["ngram_log_votes"] == pytest.approx(np.log(3))
    assert f["draft"] == 1 and f["draft_p"] == pytest.approx(np.exp(-0.05)) and f["draft_top1"] == 1
    assert f["both"] == 1 and f["depth"] == pytest.approx(0.2)
    g = dict(zip(FEATURES, x[3]))                        # graft only: no n-gram evidence
    assert g["ngram"] == g["ngram_match"] == g["ngram_target_lp"] == g["both"] == 0
    assert g["draft"] == 1 and g["depth"] == pytest.approx(0.4)


def test_estimates_per_regime_and_default_is_sensible():
    t = evidence_tree()
    model = AcceptanceModel.default()
    greedy, sampled = model.estimate(t, False, 5, 5), model.estimate(t, True, 5, 5)
    assert greedy[0] == sampled[0] == 1.0
    assert np.all((greedy > 0) & (greedy <= 1)) and np.all(sampled[1:] <= greedy[1:])
    assert greedy[1] > greedy[2]                          # the long match the drafter liked wins


def test_fit_recovers_weights_and_reliability_is_calibrated():
    rng = np.random.default_rng(0)
    x = np.c_[np.ones(20000), rng.normal(size=(20000, 2))]
    w = np.array([-0.5, 1.5, -1.0])
    y = (rng.random(20000) < logistic(x @ w)).astype(float)
    got = fit(x, y)
    assert got == pytest.approx(w, abs=0.1)
    table = reliability(logistic(x @ got), y)
    for row in table:
        if row["nodes"] > 500:
            assert abs(row["predicted"] - row["observed"]) < 0.05
    # Soft labels (exact conditional probabilities) give the same weights with less noise.
    assert fit(x, logistic(x @ w)) == pytest.approx(w, abs=0.03)  # the small ridge shrinks


def test_calibration_round_trip_through_the_bundle_file(tmp_path):
    rng = np.random.default_rng(1)
    x = node_features(evidence_tree(), 5, 5)
    xs = np.repeat(x[1:], 50, axis=0) + rng.normal(scale=0.01, size=(150, len(FEATURES)))
    y = np.repeat([0.9, 0.1, 0.6], 50)
    groups = np.arange(150) % 6
    report = calibrate_regime(xs, y, groups)
    assert report["heldout_rows"] > 0 and len(report["weights"]) == len(FEATURES)
    assert report["heldout"]["log_loss"] < report["heldout"]["log_loss_constant"]
    save(tmp_path / "acceptance.json", {"greedy": report}, {"note": "test"})
    model = AcceptanceModel.load(tmp_path / "acceptance.json")
    assert model.calibrated
    a = model.estimate(evidence_tree(), False, 5, 5)
    assert a[1:] == pytest.approx([0.9, 0.1, 0.6], abs=0.05)
    # The sampled regime was not calibrated: it keeps the default.
    assert np.array_equal(model.weights["sampled"], AcceptanceModel.default().weights["sampled"])
