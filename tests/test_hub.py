"""Models from the Hub: downloads through `huggingface_hub` against a loopback Hub stand-in
(HF_ENDPOINT), the cache and offline mode, clear errors, the drafter chosen for a target, and
a plain checkpoint quantized once.

The download tests run `treegraft` in a subprocess: huggingface_hub reads HF_ENDPOINT, HF_HOME
and HF_HUB_OFFLINE when it is imported, as it does for a user.
"""

import json
import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

from checkpoints import make_checkpoint
from hubstub import HubStub, commit_of
from treegraft_mlx import fixture_path
from treegraft_mlx.pairing import choose_drafter, choose_models, known_drafter

FIXTURE = fixture_path()
TARGET, DRAFTER = FIXTURE / "target", FIXTURE / "drafters" / "tg-tiny-draft"
NOT_NEEDED = ("pytorch_model.bin", "model.onnx", "logo.png")   # never downloaded


def treegraft(args: list[str], home: Path, endpoint: str = "", offline: bool = False):
    env = {k: v for k, v in os.environ.items() if not k.startswith("HF_")}
    env.update(HF_HOME=str(home), HF_HUB_DISABLE_PROGRESS_BARS="1",
               HF_HUB_DISABLE_TELEMETRY="1", HF_HUB_ETAG_TIMEOUT="5",
               HF_HUB_OFFLINE="1" if offline else "0")
    if endpoint:
        env["HF_ENDPOINT"] = endpoint
    return subprocess.run([sys.executable, "-c", "from treegraft_mlx.cli import main; main()",
                           *args], env=env, capture_output=True, text=True, timeout=300)


@pytest.fixture(scope="module")
def drafter_repo(tmp_path_factory) -> Path:
    """The drafter's files plus some a model does not need, as Hub repos often have."""
    repo = tmp_path_factory.mktemp("repo") / "tiny-drafter"
    shutil.copytree(DRAFTER, repo)
    for name in NOT_NEEDED:
        (repo / name).write_bytes(b"not needed")
    return repo


@pytest.fixture
def hub(drafter_repo):
    repos = {"acme/tiny-coder": TARGET, "acme/tiny-drafter": drafter_repo, "acme/gated": DRAFTER}
    with HubStub(repos, gated=("acme/gated",)) as stub:
        yield stub


def same_files(snapshot: Path, source: Path) -> bool:
    return all((snapshot / f.name).read_bytes() == f.read_bytes() for f in source.iterdir()
               if f.name not in NOT_NEEDED)


def test_first_run_downloads_and_the_second_downloads_nothing(hub, tmp_path):
    first = treegraft(["pull", "acme/tiny-drafter"], tmp_path, hub.url)
    assert first.returncode == 0, first.stderr
    snapshot = Path(first.stdout.strip().splitlines()[-1])
    assert snapshot.is_relative_to(tmp_path) and commit_of("acme/tiny-drafter") in str(snapshot)
    assert same_files(snapshot, DRAFTER)
    fetched = hub.downloads()
    assert sorted(Path(p).name for p in fetched) == sorted(f.name for f in DRAFTER.iterdir())
    assert not any((snapshot / name).exists() for name in NOT_NEEDED)
    second = treegraft(["pull", "acme/tiny-drafter"], tmp_path, hub.url)
    assert second.returncode == 0, second.stderr
    assert hub.downloads() == fetched                    # a revision check at most
    assert Path(second.stdout.strip().splitlines()[-1]) == snapshot


def test_an_interrupted_download_resumes_where_it_stopped(hub, tmp_path):
    # huggingface_hub writes what it received in 10 MiB chunks, then asks for the rest with a
    # Range request (in the same run, or the next one from the .incomplete blob it kept)
    weights = TARGET / "model.safetensors"
    size = weights.stat().st_size
    hub.cut_after["model.safetensors"] = size * 2 // 3   # the connection drops two thirds in
    out = None
    for _ in range(2):
        out = treegraft(["pull", "acme/tiny-coder"], tmp_path, hub.url)
        if out.returncode == 0:
            break
        assert "run again to resume" in out.stderr
    assert out.returncode == 0, out.stderr
    ranges = [r for m, p, r in hub.requests if m == "GET" and p.endswith("model.safetensors")]
    assert len(ranges) == 2 and ranges[0] == ""
    resumed_at = int(ranges[1].removeprefix("bytes=").rstrip("-"))
    assert 0 < resumed_at <= size * 2 // 3               # only the missing part fetched again
    assert same_files(Path(out.stdout.strip().splitlines()[-1]), TARGET)


def test_offline_with_an_empty_cache_is_a_clear_error(tmp_path):
    out = treegraft(["generate", "--model", "acme/tiny-coder", "--prompt", "x"], tmp_path,
                    offline=True)
    assert out.returncode != 0
    assert "'acme/tiny-coder' is not in the local cache" in out.stderr
    assert "HF_HUB_OFFLINE is set" in out.stderr and "Traceback" not in out.stderr


def test_a_missing_or_gated_repo_or_revision_is_a_clear_error(hub, tmp_path):
    missing = treegraft(["pull", "acme/nope"], tmp_path, hub.url)
    assert missing.returncode != 0 and "Traceback" not in missing.stderr
    assert "'acme/nope' was not found on the Hub" in missing.stderr
    gated = treegraft(["pull", "acme/gated"], tmp_path, hub.url)
    assert "'acme/gated' is gated on the Hub" in gated.stderr and "HF_TOKEN" in gated.stderr
    bad = treegraft(["pull", "acme/tiny-drafter", "--revision", "v9"], tmp_path, hub.url)
    assert "'acme/tiny-drafter' has no revision 'v9'" in bad.stderr


def test_a_pinned_revision_is_the_commit_fetched(hub, tmp_path):
    commit = commit_of("acme/tiny-drafter")
    out = treegraft(["pull", "acme/tiny-drafter", "--revision", commit], tmp_path, hub.url)
    assert out.returncode == 0, out.stderr
    assert Path(out.stdout.strip().splitlines()[-1]).name == commit


def test_generate_downloads_the_target_picks_the_cached_drafter_and_ls_lists_both(hub, tmp_path):
    assert treegraft(["pull", "acme/tiny-drafter"], tmp_path, hub.url).returncode == 0
    out = treegraft(["generate", "--model", "acme/tiny-coder", "--prompt", "def f(x):",
                     "--max-tokens", "4", "--no-autotune", "--json"], tmp_path, hub.url)
    assert out.returncode == 0, out.stderr
    assert "drafter: acme/tiny-drafter (the smallest cached model of the target's family" \
        in out.stderr
    assert json.loads(out.stdout)["generation_tokens"] == 4
    listing = treegraft(["ls"], tmp_path, offline=True)
    rows = {line.split()[0]: line for line in listing.stdout.splitlines()[1:]}
    assert set(rows) == {"acme/tiny-coder", "acme/tiny-drafter"}
    assert rows["acme/tiny-coder"].rstrip().endswith("acme/tiny-drafter")
    assert rows["acme/tiny-drafter"].rstrip().endswith("none (n-gram only)")


def fake_cache(root: Path, repo: str, source: Path) -> Path:
    """A repo as huggingface_hub lays it out in its cache (snapshot files, no blobs needed)."""
    snapshot = root / f"models--{repo.replace('/', '--')}" / "snapshots" / commit_of(repo)
    shutil.copytree(source, snapshot)
    return snapshot


def swap_two_ids(model_dir: Path) -> None:
    """Same vocabulary, two tokens' ids exchanged: a tokenizer that does not agree."""
    file = model_dir / "tokenizer.json"
    tok = json.loads(file.read_text())
    vocab = tok["model"]["vocab"]
    a, b = sorted(vocab, key=vocab.get)[100:102]
    vocab[a], vocab[b] = vocab[b], vocab[a]
    file.write_text(json.dumps(tok))


def test_the_drafter_choice_checks_tokenizers(tmp_path, monkeypatch):
    from huggingface_hub import constants

    monkeypatch.setattr(constants, "HF_HUB_CACHE", str(tmp_path / "hub"))
    target = make_checkpoint(tmp_path / "src" / "big", layers=4, hidden=128, inter=256)
    medium = make_checkpoint(tmp_path / "src" / "medium", layers=2)
    small = make_checkpoint(tmp_path / "src" / "small", layers=1)
    tiny = dict(layers=1, hidden=32, heads=2, kv_heads=1, inter=64)
    smaller = make_checkpoint(tmp_path / "src" / "smaller", **tiny)
    swap_two_ids(smaller)
    qwen = make_checkpoint(tmp_path / "src" / "other", "qwen3", **tiny)
    for repo, src in (("acme/big", target), ("acme/medium", medium), ("acme/small", small),
                      ("acme/smaller", smaller), ("acme/other-family", qwen)):
        fake_cache(tmp_path / "hub", repo, src)
    choice = choose_drafter(target, "acme/big", download=False)
    # the two smallest have another tokenizer or are of another family (with the same
    # tokenizer); of the rest the smallest wins
    assert choice.name == "acme/small" and "smallest cached model" in choice.line
    models = choose_models(target, ("none",), log=lambda line: None)
    assert models.drafters == () and "n-gram drafter alone" in models.note
    alone = choose_drafter(small, "acme/small", download=False)
    assert alone.name is None and "skipped acme/smaller (another tokenizer)" in alone.line


def test_known_pairs_name_a_drafter_of_the_same_kind():
    assert known_drafter("mlx-community/Qwen3-8B-4bit") == "mlx-community/Qwen3-0.6B-4bit"
    assert known_drafter("Qwen/Qwen3-32B") == "Qwen/Qwen3-0.6B"
    assert known_drafter("mlx-community/Meta-Llama-3.1-8B-Instruct-4bit") == \
        "mlx-community/Llama-3.2-1B-Instruct-4bit"
    assert known_drafter("Qwen/Qwen3-0.6B") is None      # the drafter itself has none
    assert known_drafter("acme/unknown") is None


def test_a_plain_checkpoint_is_quantized_once_and_reused(tmp_path, monkeypatch):
    monkeypatch.setenv("TREEGRAFT_CACHE", str(tmp_path / "cache"))
    plain = make_checkpoint(tmp_path / "plain", hidden=128, inter=256)
    lines: list[str] = []
    first = choose_models(plain, ("none",), q_bits=4, log=lines.append).target
    assert json.loads((first / "config.json").read_text())["quantization"]["bits"] == 4
    assert any(line.startswith("quantizing") for line in lines)
    lines.clear()
    again = choose_models(plain, ("none",), q_bits=4, log=lines.append).target
    assert again == first and not any(line.startswith("quantizing") for line in lines)
    # an already quantized model is used as it is
    assert choose_models(first, ("none",), q_bits=8, log=lines.append).target == first
    assert lines[-1].endswith("already quantized, used as it is")


def test_a_known_pair_is_downloaded_for_a_target_that_has_none_cached(tmp_path):
    repos = {"Qwen/Qwen3-8B": TARGET, "Qwen/Qwen3-0.6B": DRAFTER}
    with HubStub(repos) as hub:
        out = treegraft(["generate", "--model", "Qwen/Qwen3-8B", "--prompt", "def f(x):",
                         "--max-tokens", "4", "--no-autotune", "--json"], tmp_path, hub.url)
        assert out.returncode == 0, out.stderr
        assert "drafter: Qwen/Qwen3-0.6B (the known pair for Qwen/Qwen3-8B, downloaded)" \
            in out.stderr
        assert any("/Qwen/Qwen3-0.6B/" in p for p in hub.downloads())
