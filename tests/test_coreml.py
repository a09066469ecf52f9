"""Core ML export of the scheduler MLP, checked without macOS by reading the package back."""

import json
import os
import subprocess
import sys
from pathlib import Path

import mlx.core as mx
import numpy as np
import pytest

from treegraft_mlx.coreml import (export_coreml, numpy_predict, read_coreml_consts,
                                  read_coreml_metadata)
from treegraft_mlx.scheduler import FEATURE_NAMES, SchedulerMLP

META = {"b0": 4, "t_tgt_ms": 21.5, "t_mid_ms": 6.25,
        "sampling": {"temp": 0.7, "top_p": 0.95, "top_k": 0, "min_p": 0.0}}


def random_mlp(seed: int = 3) -> SchedulerMLP:
    """He-initialised MLP with non-trivial biases and normalisation, so no term is a no-op."""
    mlp = SchedulerMLP.init(seed)
    rng = np.random.default_rng(seed)
    shapes = {"in_mean": (17,), "l1.bias": (64,), "l2.bias": (32,), "l3.bias": (1,),
              "out_mean": (1,)}
    for k, shape in shapes.items():
        mlp.params[k] = mx.array(rng.normal(size=shape).astype(np.float32))
    mlp.params["in_std"] = mx.array(rng.uniform(0.2, 3.0, size=17).astype(np.float32))
    mlp.params["out_std"] = mx.array(np.array([2.5], np.float32))
    return mlp


def rows(mlp: SchedulerMLP, n: int = 64) -> np.ndarray:
    """Features around the input normalisation, so ReLUs are partly active."""
    z = np.random.default_rng(7).normal(size=(n, 17)).astype(np.float32)
    return z * np.asarray(mlp.params["in_std"]) + np.asarray(mlp.params["in_mean"])


@pytest.fixture
def artifact(tmp_path) -> tuple[Path, SchedulerMLP]:
    mlp = random_mlp()
    mlp.save(tmp_path / "artifact", META)
    return tmp_path / "artifact", mlp


def test_export_evaluates_like_the_mlp(artifact, tmp_path):
    src, mlp = artifact
    out = export_coreml(src, tmp_path / "apps" / "Scheduler.mlpackage")
    assert out == tmp_path / "apps" / "Scheduler.mlpackage"
    assert (out / "Manifest.json").is_file()
    x = rows(mlp)
    expected = np.asarray(mlp.value(mx.array(x)))
    got = numpy_predict(out, x)
    assert got.shape == (64,)
    assert (expected > 0).any() and (expected < 0).any()     # the decision is not constant
    np.testing.assert_allclose(got, expected, rtol=1e-5, atol=1e-5)
    assert sorted(os.listdir(out.parent)) == ["Scheduler.mlpackage"]   # no temp dir left


def test_package_holds_the_artifact_parameters(artifact, tmp_path):
    src, mlp = artifact
    consts = read_coreml_consts(export_coreml(src, tmp_path / "s.mlpackage"))
    p = {k: np.asarray(v) for k, v in mlp.params.items()}
    for name in ("in_mean", "l1.weight", "l1.bias", "l2.weight", "l2.bias", "l3.weight",
                 "l3.bias", "out_std", "out_mean"):
        np.testing.assert_array_equal(consts[name.replace(".", "_")], p[name])
    np.testing.assert_allclose(consts["in_inv_std"], 1 / p["in_std"], rtol=1e-7)


def test_wrong_weight_is_detected(artifact, tmp_path):
    """The comparison above can fail: one perturbed weight shows up in the predictions."""
    src, mlp = artifact
    bad = SchedulerMLP(dict(mlp.params))
    w = np.array(mlp.params["l2.weight"])
    w[3, 5] += 0.5
    bad.params["l2.weight"] = mx.array(w)
    bad.save(tmp_path / "bad", META)
    x = rows(mlp)
    got = numpy_predict(export_coreml(tmp_path / "bad", tmp_path / "bad.mlpackage"), x)
    assert not np.allclose(got, np.asarray(mlp.value(mx.array(x))), rtol=1e-5, atol=1e-5)
    np.testing.assert_allclose(got, np.asarray(bad.value(mx.array(x))), rtol=1e-5, atol=1e-5)


def test_metadata_round_trips(artifact, tmp_path):
    src, _ = artifact
    meta = read_coreml_metadata(export_coreml(src, tmp_path / "s.mlpackage"))
    assert tuple(meta["features"].split(",")) == FEATURE_NAMES
    assert meta["format_version"] == "1"
    assert (meta["b0"], meta["t_tgt_ms"], meta["t_mid_ms"]) == ("4", "21.5", "6.25")
    assert json.loads(meta["sampling"]) == META["sampling"]


def test_reexport_replaces_existing_package(artifact, tmp_path):
    src, mlp = artifact
    out = export_coreml(src, tmp_path / "s.mlpackage")
    other = random_mlp(seed=11)
    other.save(tmp_path / "other", META)
    export_coreml(tmp_path / "other", out)
    x = rows(other)
    np.testing.assert_allclose(numpy_predict(out, x), np.asarray(other.value(mx.array(x))),
                               rtol=1e-5, atol=1e-5)
    assert sorted(p.name for p in tmp_path.iterdir()) == ["artifact", "other", "s.mlpackage"]


def _truncate_weights(d: Path) -> None:
    f = d / "scheduler.safetensors"
    f.write_bytes(f.read_bytes()[:-100])


def _wrong_width(d: Path) -> None:
    SchedulerMLP.init(0, n_in=16).save(d, META)


@pytest.mark.parametrize("damage, error, match", [
    (lambda d: (d / "scheduler.safetensors").unlink(), FileNotFoundError, "is missing"),
    (_truncate_weights, ValueError, "cannot read scheduler artifact"),
    (lambda d: (d / "scheduler.json").write_text("{"), ValueError, "cannot read"),
    (_wrong_width, ValueError, r"in_mean has shape \(16,\)"),
], ids=["missing-weights", "truncated-weights", "broken-json", "wrong-width"])
def test_bad_artifact_fails_clearly_and_writes_nothing(artifact, tmp_path, damage, error, match):
    src, _ = artifact
    damage(src)
    with pytest.raises(error, match=match):
        export_coreml(src, tmp_path / "out" / "s.mlpackage")
    assert not (tmp_path / "out").exists() or not any((tmp_path / "out").iterdir())


def test_failed_save_leaves_previous_package(artifact, tmp_path, monkeypatch):
    import coremltools as ct

    src, mlp = artifact
    out = export_coreml(src, tmp_path / "s.mlpackage")

    def broken_save(self, path):
        Path(path).mkdir()
        (Path(path) / "Manifest.json").write_text("{")
        raise OSError("disk full")

    monkeypatch.setattr(ct.models.MLModel, "save", broken_save)
    with pytest.raises(OSError, match="disk full"):
        export_coreml(src, out)
    assert sorted(p.name for p in tmp_path.iterdir()) == ["artifact", "s.mlpackage"]
    x = rows(mlp)
    np.testing.assert_allclose(numpy_predict(out, x), np.asarray(mlp.value(mx.array(x))),
                               rtol=1e-5, atol=1e-5)


def test_export_needs_no_torch(artifact, tmp_path):
    """coremltools imports torch when it is installed; the export must work where it is not."""
    src, _ = artifact
    code = ("import sys; sys.modules['torch'] = None\n"
            "from treegraft_mlx.coreml import export_coreml, numpy_predict\n"
            "import numpy as np\n"
            f"p = export_coreml({str(src)!r}, {str(tmp_path / 'nt.mlpackage')!r})\n"
            "print(numpy_predict(p, np.zeros((1, 17), np.float32)).shape)\n")
    res = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                         timeout=600, cwd=Path(__file__).parent.parent)   # a hang guard only
    assert res.returncode == 0, res.stderr[-2000:]
    assert res.stdout.strip().endswith("(1,)")
