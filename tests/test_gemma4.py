"""Gemma 4 text targets: logits against transformers' own (tiny checkpoints it wrote,
tests/hf_reference/gemma4/), prefill and cached decode, both config forms of the global
attention settings, the multimodal wrapper, the KV cache's size, and tree decoding against
plain decoding past the sliding window."""

import dataclasses
import json
import shutil
from pathlib import Path

import mlx.core as mx
import mlx_lm
import numpy as np
import pytest

from checkpoints import write_tokenizer
from test_hybrid import stop_inside_a_block
from treegraft_mlx import LoadError, generate, load, load_model
from treegraft_mlx.loading import estimate_bytes
from treegraft_mlx.session import Session

REFERENCES = Path(__file__).parent / "hf_reference" / "gemma4"
TARGETS = ["dense", "k_eq_v", "moe", "shared_ple", "multimodal"]
TOL = 1e-4      # relative to the largest logit; fp32 on both sides
PROMPT = "def add(a, b):\n    return a + b\nclass Foo:\n    pass\nfor i in range(10):\n"


def copied(name: str, dest: Path) -> Path:
    shutil.copytree(REFERENCES / name, dest)
    write_tokenizer(dest)
    return dest


def relative_error(got, want) -> float:
    return float(np.abs(np.asarray(got) - want).max() / np.abs(want).max())


@pytest.fixture(scope="module", params=TARGETS)
def checkpoint(request, tmp_path_factory) -> Path:
    return copied(request.param, tmp_path_factory.mktemp(request.param) / request.param)


def test_prefill_logits_match_transformers(checkpoint):
    model, _ = load_model(checkpoint)
    ref = np.load(checkpoint / "logits.npz")
    for key in ("short", "long"):          # long: five windows of the sliding layers
        got = model(mx.array([ref[f"ids_{key}"].tolist()]))[0]
        assert relative_error(got, ref[key]) < TOL, key


def test_cached_decode_matches_transformers(checkpoint):
    """A prefill of 30 tokens, then one token per forward through the cache (the shared
    layers reading their producers' cached keys), then a block of 4."""
    model, _ = load_model(checkpoint)
    ref = np.load(checkpoint / "logits.npz")
    ids, want = ref["ids_long"].tolist(), ref["long"]
    cache = model.make_cache(64)
    rows = [model(mx.array([ids[:30]]), cache=cache)[0]]
    cache.commit()
    for t in ids[30:36]:
        rows.append(model(mx.array([[t]]), cache=cache)[0])
        cache.commit()
    rows.append(model(mx.array([ids[36:]]), cache=cache)[0])
    assert relative_error(mx.concatenate(rows), want) < TOL


def test_global_settings_read_from_either_config_form(tmp_path):
    """`per_layer_config` (what transformers 5.25 writes) or the top-level
    `global_head_dim` / `num_global_key_value_heads` of older configs: the same model."""
    path = copied("k_eq_v", tmp_path / "old")
    config = json.loads((path / "config.json").read_text())
    overrides = config.pop("per_layer_config")
    full = next(iter(overrides.values()))
    config.update(global_head_dim=full["head_dim"],
                  num_global_key_value_heads=full["num_key_value_heads"])
    (path / "config.json").write_text(json.dumps(config))
    model, _ = load_model(path)
    ref = np.load(path / "logits.npz")
    assert relative_error(model(mx.array([ref["ids_long"].tolist()]))[0], ref["long"]) < TOL
    attn = model.layers[-1].self_attn
    assert (attn.head_dim, attn.n_kv_heads) == (full["head_dim"], full["num_key_value_heads"])
    assert "v_proj" not in attn


def test_shared_layers_hold_no_cache_and_the_estimate_counts_producers(tmp_path):
    model, _ = load_model(copied("shared_ple", tmp_path / "m"))
    a = model.args
    assert a.producers == [0, 1, 2] and [s.producer for s in a.specs] == [0, 1, 2, 2, 1]
    assert a.store_layers == {"sliding_attention": 2, "full_attention": 1}
    cache = model.make_cache(100)
    model(mx.array([[5, 6, 7]]), cache=cache)
    per_token = sum(2 * s.kv_heads * s.head_dim * 4 for s in a.specs[:3])
    assert cache.nbytes == 100 * per_token          # capped at its 100 rows, 3 layers
    assert estimate_bytes(a, 0, 100, mx.float32) == 100 * per_token


def test_a_wrong_layer_count_is_a_clear_error(tmp_path):
    path = copied("dense", tmp_path / "m")
    config = json.loads((path / "config.json").read_text())
    config["layer_types"] = config["layer_types"][:-1]
    (path / "config.json").write_text(json.dumps(config))
    with pytest.raises(LoadError, match="layer_types must name 4 layers"):
        load_model(path)


@pytest.mark.parametrize("name", ["dense", "moe", "shared_ple"])
def test_tree_decoding_is_token_identical_past_the_window(tmp_path, name):
    """The model as its own strong drafter: tree steps commit several tokens, pending tree
    rows read by the shared layers through their producers."""
    path = copied(name, tmp_path / name)
    family = load(path, drafters=[path], warmup=False)
    fixed = dataclasses.replace(family.tree, adaptive=False, verify_pad=())
    assert len(family.tokenizer.encode(PROMPT)) > 8      # longer than the sliding window
    ar = generate(family, PROMPT, "ar", max_tokens=40)
    for strategy in ("ngram", "treegraft", "draft", "chain:3"):
        for tree in (family.tree, fixed):
            out = generate(family, PROMPT, strategy, max_tokens=40, tree=tree)
            assert out.token_ids == ar.token_ids, (strategy, tree.adaptive)
    out = generate(family, PROMPT, "treegraft", max_tokens=40, tree=fixed)
    assert out.mean_accepted >= 1.5


def test_turns_and_a_stop_inside_a_block(tmp_path):
    """Two chat turns on one session (the prefix reused), then a stop string inside an
    accepted block: what fresh `ar` generations give."""
    path = copied("shared_ple", tmp_path / "m")
    family = load(path, drafters=[path], warmup=False)
    session = Session(family, family.tree)
    text = PROMPT
    for turn in range(2):
        want = generate(family, text, "ar", max_tokens=20)
        got = generate(family, text, "treegraft", max_tokens=20, session=session)
        assert got.token_ids == want.token_ids, turn
        text = text + got.text + "\nfor j in range(3):\n"
    stop_inside_a_block(family, session, "treegraft", "draft")


def test_pipeline_refuses_shared_kv(tmp_path):
    from treegraft_mlx.pipeline import PipelineError, refuse_hybrid

    with pytest.raises(PipelineError, match="shared keys and values"):
        refuse_hybrid(copied("shared_ple", tmp_path / "m"))
    with pytest.raises(PipelineError, match="per-layer K/V shapes"):
        refuse_hybrid(copied("dense", tmp_path / "d"))


def old_form(path: Path) -> Path:
    """The config with the top-level global settings older configs (and mlx_lm) read."""
    config = json.loads((path / "config.json").read_text())
    text = config.get("text_config", config)
    full = next(iter(text["per_layer_config"].values()))
    text.update(global_head_dim=full["head_dim"],
                num_global_key_value_heads=full.get("num_key_value_heads"))
    (path / "config.json").write_text(json.dumps(config))
    return path


@pytest.mark.parametrize("name", ["dense", "moe", "shared_ple", "multimodal"])
def test_converted_bundles_keep_the_logits(tmp_path, name):
    """`treegraft convert` writes a text model (a multimodal checkpoint's text tower as
    `gemma4_text`): in full precision the logits are transformers' (and mlx_lm's reading of
    the bundle's); in 4 bits the
    projections are quantized and greedy tree decoding still gives what `ar` gives (its
    numbers: test_mlx_lm_converted_directories_load)."""
    from treegraft_mlx.convert import QuantSpec, convert_family

    src = copied(name, tmp_path / name)
    ref = np.load(src / "logits.npz")
    ids = mx.array([ref["ids_long"].tolist()])
    plain = convert_family(str(src), [], str(tmp_path / "fp"), log=lambda s: None)
    model, _ = load_model(plain / "target")
    assert relative_error(model(ids)[0], ref["long"]) < TOL
    written = json.loads((plain / "target" / "config.json").read_text())
    assert written["model_type"] == "gemma4_text" and "global_head_dim" in written
    theirs, _ = mlx_lm.load(str(plain / "target"))    # a text model mlx_lm reads alike
    assert relative_error(np.array(theirs(ids)[0]), ref["long"]) < TOL
    q4 = convert_family(str(src), [], str(tmp_path / "q4"), quant=QuantSpec(4, 32),
                        log=lambda s: None)
    model, _ = load_model(q4 / "target")
    assert model.quantization["bits"] == 4
    assert type(model.layers[0].self_attn.q_proj).__name__ == "QuantizedLinear"
    if name == "shared_ple":                   # the per-layer inputs' gate, as mlx_lm does
        assert type(model.layers[0].per_layer_input_gate).__name__ == "QuantizedLinear"
    family = load(q4, warmup=False)
    fixed = dataclasses.replace(family.tree, adaptive=False, verify_pad=())
    assert (generate(family, PROMPT, "ngram", max_tokens=16, tree=fixed).token_ids
            == generate(family, PROMPT, "ar", max_tokens=16).token_ids)


@pytest.mark.parametrize("name", ["dense", "k_eq_v", "shared_ple"])
def test_mlx_lm_converted_directories_load(tmp_path, name):
    """A directory mlx_lm itself converted to 4 bits: the logits mlx_lm computes from it
    (mlx_lm reads the older top-level global settings)."""
    src = old_form(copied(name, tmp_path / name))
    out = tmp_path / "mlx"
    mlx_lm.convert(str(src), mlx_path=str(out), quantize=True, q_bits=4, q_group_size=32)
    ours, _ = load_model(out)
    theirs, _ = mlx_lm.load(str(out))
    theirs.set_dtype(mx.float32)
    ids = mx.array([np.load(src / "logits.npz")["ids_long"].tolist()])
    assert ours.quantization["bits"] == 4
    assert relative_error(ours(ids)[0], np.array(theirs(ids)[0])) < 1e-3


def test_the_multimodal_text_tower_under_mlx_lm_names(tmp_path):
    """mlx_lm saves a `gemma4` checkpoint's text tower as `language_model.model.*`."""
    from safetensors.numpy import load_file, save_file

    path = copied("multimodal", tmp_path / "m")
    weights = load_file(path / "model.safetensors")
    renamed = {k.replace("model.language_model.", "language_model.model."): v
               for k, v in weights.items() if k.startswith("model.language_model.")}
    save_file(renamed, path / "model.safetensors", metadata={"format": "mlx"})
    model, _ = load_model(path)
    ref = np.load(path / "logits.npz")
    assert relative_error(model(mx.array([ref["ids_long"].tolist()]))[0], ref["long"]) < TOL
