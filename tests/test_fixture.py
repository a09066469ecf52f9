"""The bundled tg-tiny family: files, shared vocabulary, configs that match the weights."""

import json
import sysconfig
from pathlib import Path

import mlx.core as mx
import mlx_lm
import pytest
from mlx_lm.models.cache import make_prompt_cache
import numpy as np
from safetensors import safe_open

from treegraft_mlx import fixture_path, load_model
from treegraft_mlx.fixtures import family_manifest

ROLES = ["target", "drafters/tg-tiny-draft"]
HF_FILES = ["config.json", "model.safetensors", "generation_config.json", "tokenizer.json",
            "tokenizer_config.json"]


def test_family_files_present_and_small():
    root = fixture_path()
    manifest = family_manifest(root)
    assert manifest["target"] == "target" and "tg-tiny-draft" in manifest["drafters"]
    for role in ROLES:
        for name in HF_FILES:
            assert (root / role / name).is_file(), (role, name)
    total = sum(f.stat().st_size for f in root.rglob("*") if f.is_file())
    assert total <= 80 * 2**20


def test_vocabularies_identical_across_family():
    root = fixture_path()
    tok = [json.loads((root / r / "tokenizer.json").read_text()) for r in ROLES]
    assert tok[0]["model"]["vocab"] == tok[1]["model"]["vocab"]
    assert tok[0]["added_tokens"] == tok[1]["added_tokens"]
    cfg = [json.loads((root / r / "config.json").read_text()) for r in ROLES]
    assert cfg[0]["vocab_size"] == cfg[1]["vocab_size"] == len(tok[0]["model"]["vocab"])
    assert {t["content"] for t in tok[0]["added_tokens"]} == {"<|bos|>", "<|eos|>", "<|pad|>"}


def test_configs_consistent_with_weights():
    for role in ROLES:
        d = fixture_path() / role
        cfg = json.loads((d / "config.json").read_text())
        assert cfg["architectures"] == ["LlamaForCausalLM"] and cfg["model_type"] == "llama"
        with safe_open(str(d / "model.safetensors"), "numpy") as f:
            shapes = {k: f.get_slice(k).get_shape() for k in f.keys()}
        h, hd = cfg["hidden_size"], cfg["head_dim"]
        assert shapes["model.embed_tokens.weight"] == [cfg["vocab_size"], h]
        assert shapes["model.layers.0.self_attn.k_proj.weight"] == [cfg["num_key_value_heads"] * hd, h]
        assert shapes["model.layers.0.mlp.gate_proj.weight"] == [cfg["intermediate_size"], h]
        n_layers = len({k.split(".")[2] for k in shapes if k.startswith("model.layers.")})
        assert n_layers == cfg["num_hidden_layers"]
        assert ("lm_head.weight" in shapes) == (not cfg["tie_word_embeddings"])


def test_tokenizer_round_trip_on_heldout_code():
    split = json.loads((fixture_path() / "split.json").read_text())
    stdlib = Path(sysconfig.get_paths()["stdlib"])
    _, tok = load_model(fixture_path() / "target", lazy=True)
    checked = 0
    for module in split["heldout"][:10]:
        path = stdlib.joinpath(*module.split(".")).with_suffix(".py")
        text = path.read_text(encoding="utf-8")[:20000]
        assert tok.decode(tok.encode(text)) == text, module
        checked += 1
    assert checked == 10


def test_loads_with_mlx_lm_and_matches_runtime():
    ids = mx.array([[12, 345, 67, 890, 1011, 23, 4000, 5]])
    for role in ROLES:
        ref, _ = mlx_lm.load(str(fixture_path() / role))
        ref.set_dtype(mx.float32)
        ours, _ = load_model(fixture_path() / role)
        a, b = np.array(ours(ids)), np.array(ref(ids))
        assert np.abs(a - b).max() < 1e-3, role  # fp32 on both sides
        cache, ref_cache = ours.make_cache(), make_prompt_cache(ref)
        ours(ids, cache=cache)
        cache.commit()
        ref(ids, cache=ref_cache)
        nxt = mx.array([[77]])
        assert np.abs(np.array(ours(nxt, cache=cache)) - np.array(ref(nxt, cache=ref_cache))).max() < 1e-3


@pytest.mark.parametrize("bits", [4, 8])
def test_mlx_lm_quantized_fixture_matches_mlx_lm(tmp_path, bits):
    out = tmp_path / f"q{bits}"
    mlx_lm.convert(str(fixture_path() / "target"), mlx_path=str(out), quantize=True, q_bits=bits,
                   q_group_size=64)
    ours, _ = load_model(out)
    ref, _ = mlx_lm.load(str(out))
    ref.set_dtype(mx.float32)  # scales and biases in fp32, as our runtime computes on CPU
    ids = mx.array([[12, 345, 67, 890, 1011, 23, 4000, 5]])
    assert ours.quantization["bits"] == bits
    assert np.abs(np.array(ours(ids)) - np.array(ref(ids))).max() < 1e-3


@pytest.mark.parametrize("entry,temp", [("scheduler", 0.0), ("scheduler_sampled", 0.7)])
def test_bundled_schedulers_calibrated_off_the_benchmark_suite(entry, temp):
    """Each bundled scheduler names its calibration prompts: the current calibration file
    (same hash), none of them a suite prompt; and the decoding it was calibrated for."""
    import hashlib

    root = Path(__file__).parents[1]
    bundle = fixture_path()
    meta = json.loads((bundle / family_manifest(bundle)[entry] / "scheduler.json").read_text())
    prov = meta["calibration_prompts"]
    calibration = root / prov["file"]
    assert hashlib.sha256(calibration.read_bytes()).hexdigest() == prov["sha256"]
    cal = {json.loads(x)["id"]: json.loads(x)["prompt"] for x in calibration.read_text().splitlines()}
    suite = {json.loads(x)["prompt"] for x in
             (root / "benchmarks/prompts/public.jsonl").read_text().splitlines()}
    assert prov["prompt_ids"] and set(prov["prompt_ids"]) <= set(cal)
    assert not {cal[i] for i in prov["prompt_ids"]} & suite
    assert meta["sampling"]["temp"] == temp and 0 <= meta["b0"] <= meta["budget"]["most"]
