import os
import sys
import tempfile
from pathlib import Path

import pytest

# No test reaches the network or reads the user's Hugging Face cache: huggingface_hub reads
# these when it is imported (test_hub.py runs its own Hub stand-in, in subprocesses).
os.environ["HF_HUB_OFFLINE"] = "1"
os.environ["HF_HOME"] = tempfile.mkdtemp(prefix="treegraft-test-hf-")

import treegraft_mlx  # noqa: F401  first: it loads the system OpenBLAS before mlx (blas.py)
from treegraft_mlx import probe as _probe  # noqa: E402

REAL_MEASURE_TIMING = _probe.measure_timing    # before _scripted_costs replaces it

sys.path.insert(0, str(Path(__file__).parent))

from checkpoints import make_checkpoint  # noqa: E402
from scripted import scripted_step_costs  # noqa: E402

ARCHS = {
    "llama": {},
    "llama-untied-sharded": {"model_type": "llama", "tied": False, "shards": 3},
    "llama3-rope": {"model_type": "llama", "rope_scaling": {
        "rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0, "high_freq_factor": 4.0,
        "original_max_position_embeddings": 32}},
    "mistral": {"model_type": "mistral"},
    "qwen2": {"model_type": "qwen2", "tied": False},
    "qwen3": {"model_type": "qwen3"},
}


@pytest.fixture(scope="session")
def checkpoints(tmp_path_factory) -> dict[str, Path]:
    """One small random checkpoint per supported architecture variant."""
    root = tmp_path_factory.mktemp("ckpt")
    out = {}
    for name, kw in ARCHS.items():
        kw = dict(kw)
        out[name] = make_checkpoint(root / name, kw.pop("model_type", "llama"), **kw)
    return out


@pytest.fixture(autouse=True, scope="session")
def _private_timing_cache(tmp_path_factory):
    """The scheduler's measured T_tgt/T_mid go to a per-run cache, not the user's home."""
    import os

    os.environ["TREEGRAFT_CACHE"] = str(tmp_path_factory.mktemp("timing-cache"))



@pytest.fixture
def measured_timing(monkeypatch, tmp_path):
    """The real T_tgt / T_mid probe (probe.measure_timing), into an empty timing cache, for
    the tests whose subject is what it measures (the step costs stay scripted)."""
    monkeypatch.setenv("TREEGRAFT_CACHE", str(tmp_path / "timing-cache"))
    monkeypatch.setattr(_probe, "measure_timing", REAL_MEASURE_TIMING)


@pytest.fixture(autouse=True, scope="session")
def _scripted_costs():
    """Every family loaded in-process gets the scripted step costs and T_tgt / T_mid (the
    CLI tests' subprocesses still run the real probe, and test_scheduler checks it is called)."""
    from treegraft_mlx import probe
    from treegraft_mlx.timing import Timing

    with pytest.MonkeyPatch.context() as mp:
        mp.setattr(probe, "measure_step_costs", scripted_step_costs)
        mp.setattr(probe, "measure_timing", lambda family, tree: Timing(36.4, 7.9))
        yield
