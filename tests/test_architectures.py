"""Gemma 2/3, Phi-3, Mixtral, Qwen3-MoE and RoPE settings in both config forms: logits against
transformers' own (tiny checkpoints it wrote, tests/hf_reference/), against mlx_lm's model
classes on the same weights, through the converter, and tree decoding against plain decoding
with contexts longer than the sliding window."""

import dataclasses
import json
import shutil
from pathlib import Path

import mlx.core as mx
import mlx_lm
import numpy as np
import pytest

from checkpoints import write_tokenizer
from treegraft_mlx import LoadError, generate, load, load_model
from treegraft_mlx.convert import QuantSpec, convert_family
from treegraft_mlx.models import legacy_config
from treegraft_mlx.models.rope import rope_spec

REFERENCES = Path(__file__).parent / "hf_reference"
CASES = sorted(p.name for p in REFERENCES.iterdir() if (p / "config.json").exists())
TOL = 1e-5  # relative to the largest logit; fp32 on both sides
# Hybrids (Gated DeltaNet): transformers runs the delta rule chunked, summing in another order.
HYBRID_TOL = {"qwen3_5": 1e-4, "qwen3_5_moe": 1e-4}


def as_written(name: str, dest: Path) -> Path:
    """The checkpoint as transformers 5 saved it (rope_parameters), plus a tokenizer."""
    shutil.copytree(REFERENCES / name, dest)
    write_tokenizer(dest)
    return dest


def as_transformers_4(name: str, dest: Path) -> Path:
    """The same checkpoint with the config keys transformers 4.x wrote instead: top-level
    rope_theta / rope_scaling (Gemma 3: rope_local_base_freq), Qwen3-MoE's num_experts."""
    as_written(name, dest)
    config = legacy_config(json.loads((dest / "config.json").read_text()))
    config.pop("rope_parameters")
    if config.get("model_type") == "qwen3_moe":
        config.pop("num_local_experts")
    if config.get("rope_scaling") is None:
        config.pop("rope_scaling", None)
    elif config["rope_scaling"]["type"] == "longrope":
        config["rope_scaling"] = {"type": "longrope",
                                  "short_factor": config["rope_scaling"]["short_factor"],
                                  "long_factor": config["rope_scaling"]["long_factor"]}
    (dest / "config.json").write_text(json.dumps(config))
    return dest


def relative_error(got, want) -> float:
    return float(np.abs(np.asarray(got) - want).max() / np.abs(want).max())


@pytest.mark.parametrize("form", [as_written, as_transformers_4], ids=["transformers5", "transformers4"])
@pytest.mark.parametrize("name", CASES)
def test_logits_match_transformers(tmp_path, name, form):
    model, _ = load_model(form(name, tmp_path / name))
    ref = np.load(REFERENCES / name / "logits.npz")
    for key in ("short", "long"):  # long: past the sliding window and longrope's short range
        got = model(mx.array([ref[f"ids_{key}"].tolist()]))[0]
        assert relative_error(got, ref[key]) < HYBRID_TOL.get(name, TOL), key


def mlx_lm_comparable(path: Path) -> Path:
    """What mlx_lm models alike: it reads only the 4.x keys, and for some of these families it
    applies no sliding window and no RoPE scaling (Gemma 2, Mixtral, Qwen3-MoE). Both models
    read the same edited directory; transformers' logits check the rest."""
    config = json.loads((path / "config.json").read_text())
    if config.get("sliding_window"):
        config["sliding_window"] = 64
    if config.get("model_type") in ("gemma2", "mixtral", "qwen3_moe"):
        config.pop("rope_scaling", None)
    config["sliding_window_pattern"] = 2  # mlx_lm's Gemma 3 counts layers with it
    (path / "config.json").write_text(json.dumps(config))
    return path


@pytest.mark.parametrize("name", [c for c in CASES if c not in HYBRID_TOL])  # test_hybrid.py
def test_logits_match_mlx_lm_on_the_same_weights(tmp_path, name):
    path = mlx_lm_comparable(as_transformers_4(name, tmp_path / name))
    ours, _ = load_model(path)
    theirs, _ = mlx_lm.load(str(path))
    ids = mx.array([np.load(REFERENCES / name / "logits.npz")["ids_long"].tolist()])
    want = np.array(theirs(ids)[0])  # long: mlx_lm's longrope always uses the long factors
    assert relative_error(ours(ids)[0], want) < TOL


@pytest.mark.parametrize("name", ["gemma2", "gemma3", "mistral-window", "phi3-longrope",
                                  "mixtral", "qwen3_moe", "qwen3_5", "qwen3_5_moe"])
def test_converted_bundles_keep_the_logits(tmp_path, name):
    src = as_written(name, tmp_path / name)
    ref = np.load(REFERENCES / name / "logits.npz")
    ids = mx.array([ref["ids_long"].tolist()])
    plain = convert_family(str(src), [], str(tmp_path / "fp"), log=lambda s: None)
    model, _ = load_model(plain / "target")
    assert relative_error(model(ids)[0], ref["long"]) < HYBRID_TOL.get(name, TOL)
    written = json.loads((plain / "target" / "config.json").read_text())
    assert "rope_parameters" in written and "rope_theta" in written  # both forms, for every reader
    q4 = convert_family(str(src), [], str(tmp_path / "q4"), quant=QuantSpec(4, 32),
                        log=lambda s: None)
    model, _ = load_model(q4 / "target")
    assert model.quantization["bits"] == 4
    if name == "qwen3_moe":  # stacked experts quantized as mlx_lm reads them; row 0 only:
        theirs, _ = mlx_lm.load(str(q4 / "target"))  # position 0, where scaling changes nothing
        assert relative_error(model(ids)[0, 0], np.array(theirs(ids)[0, 0])) < 1e-4


@pytest.mark.parametrize("name", ["gemma2", "gemma3", "mistral-window", "phi3-longrope",
                                  "mixtral", "qwen3_moe"])
def test_tree_decoding_is_token_identical_past_the_window(tmp_path, name):
    path = as_written(name, tmp_path / name)
    family = load(path, drafters=[path], warmup=False)  # the model as its own strong drafter
    fixed = dataclasses.replace(family.tree, adaptive=False, verify_pad=())
    prompt = "def add(a, b):\n    return a + b\nclass Foo:\n    pass\nfor i in range(10):\n"
    assert len(family.tokenizer.encode(prompt)) > 8  # longer than the sliding window (8)
    ar = generate(family, prompt, "ar", max_tokens=40)
    assert len(ar.token_ids) >= 10
    for strategy in ("ngram", "treegraft"):
        out = generate(family, prompt, strategy, max_tokens=40, tree=fixed)
        assert out.token_ids == ar.token_ids, strategy
    # the model drafting for itself: tree steps commit several tokens, through the window
    assert out.mean_accepted >= 1.5


def test_unknown_rope_type_is_a_clear_error(tmp_path):
    path = as_written("llama3-rope", tmp_path / "m")
    config = json.loads((path / "config.json").read_text())
    config["rope_parameters"]["rope_type"] = "warp"
    (path / "config.json").write_text(json.dumps(config))
    with pytest.raises(LoadError, match="unsupported rope_type 'warp'"):
        load_model(path)


def test_rope_spec_reads_both_forms_alike():
    legacy = {"rope_theta": 5e5, "rope_scaling": {"type": "su", "short_factor": [1.0],
                                                  "long_factor": [2.0]},
              "original_max_position_embeddings": 24, "partial_rotary_factor": 0.5}
    current = {"rope_parameters": {"rope_type": "longrope", "rope_theta": 5e5,
                                   "short_factor": [1.0], "long_factor": [2.0],
                                   "original_max_position_embeddings": 24,
                                   "partial_rotary_factor": 0.5}}
    assert rope_spec(legacy) == rope_spec(current)
    assert rope_spec(legacy).kind == "longrope" and rope_spec(legacy).theta == 5e5
    nested = {"rope_parameters": {"full_attention": {"rope_type": "linear", "factor": 8.0,
                                                     "rope_theta": 1e6},
                                  "sliding_attention": {"rope_type": "default", "rope_theta": 1e4}}}
    assert rope_spec(nested, "full_attention").params == {"factor": 8.0}
    assert rope_spec(nested, "sliding_attention").theta == 1e4
    old_gemma3 = {"rope_theta": 1e6, "rope_local_base_freq": 1e4,
                  "rope_scaling": {"rope_type": "linear", "factor": 8.0}}
    assert rope_spec(old_gemma3, "sliding_attention", 1e4, "rope_local_base_freq") == \
        rope_spec(nested, "sliding_attention")
    assert rope_spec({"rope_theta": 1e6}).theta == 1e6 and rope_spec({}).theta == 1e4


@pytest.mark.parametrize("name", ["gemma2", "gemma3", "phi3-longrope", "mixtral", "qwen3_moe"])
def test_mlx_lm_converted_directories_load(tmp_path, name):
    """A directory mlx_lm itself converted and quantized (its stacked experts, its names)."""
    src = mlx_lm_comparable(as_transformers_4(name, tmp_path / name))
    out = tmp_path / "mlx"
    mlx_lm.convert(str(src), mlx_path=str(out), quantize=True, q_bits=4, q_group_size=32)
    ours, _ = load_model(out)
    theirs, _ = mlx_lm.load(str(out))
    theirs.set_dtype(mx.float32)
    ids = mx.array([np.load(REFERENCES / name / "logits.npz")["ids_long"].tolist()])
    assert ours.quantization["bits"] == 4
    assert relative_error(ours(ids)[0], np.array(theirs(ids)[0])) < 1e-3
