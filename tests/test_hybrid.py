"""Qwen 3.5 hybrids (Gated DeltaNet + gated attention): logits against transformers' own tiny
checkpoints (tests/hf_reference/qwen3_5*), tree verification over the recurrent state, and
speculative decoding token-identical to `ar` across turns, rewinds and stop strings."""

import dataclasses
import json
import shutil
from pathlib import Path

import mlx.core as mx
import mlx.nn as nn
import numpy as np
import pytest

from checkpoints import make_hybrid_pair, write_tokenizer
from test_sampling import exact_pair_distribution
from treegraft_mlx import LoadError, fixture_path, generate, load, probe
from treegraft_mlx.loading import load_model, load_tokenizer
from treegraft_mlx.models import legacy_config
from treegraft_mlx.batch import decode_together
from treegraft_mlx.session import Session
from treegraft_mlx.tree import DraftTree, attention_mask, path_to, positions
from treegraft_mlx.verify import verify

REFERENCES = Path(__file__).parent / "hf_reference"
HYBRIDS = ["qwen3_5", "qwen3_5_moe", "qwen3_next"]
TOL = 1e-4   # the bound: transformers runs the delta rule chunked, in another order
PROMPT = "def add(a, b):\n    return a + b\nclass Foo:\n    pass\nfor i in range(10):\n"


def relative_error(got, want) -> float:
    return float(np.abs(np.asarray(got) - want).max() / np.abs(want).max())


@pytest.fixture(scope="module", params=HYBRIDS)
def checkpoint(request, tmp_path_factory) -> Path:
    dest = tmp_path_factory.mktemp(request.param) / request.param
    shutil.copytree(REFERENCES / request.param, dest)
    write_tokenizer(dest)
    return dest


@pytest.fixture(scope="module")
def dense(tmp_path_factory) -> Path:
    """The dense hybrid alone, for the slow tests whose subject is not the experts."""
    dest = tmp_path_factory.mktemp("dense") / "qwen3_5"
    shutil.copytree(REFERENCES / "qwen3_5", dest)
    write_tokenizer(dest)
    return dest


@pytest.fixture(scope="module")
def model(checkpoint):
    return load_model(checkpoint)[0]


def test_prefill_and_cached_decode_match_transformers(model, checkpoint):
    ref = np.load(checkpoint / "logits.npz")
    for key in ("short", "long"):
        ids = ref[f"ids_{key}"].tolist()
        assert relative_error(model(mx.array([ids]))[0], ref[key]) < TOL, key
        cache, rows = model.make_cache(), []
        for tok in ids:                                      # one token at a time
            rows.append(np.array(model(mx.array([[tok]]), cache=cache)[0, -1]))
            cache.commit()
        assert relative_error(np.stack(rows), ref[key]) < TOL, key


def random_tree(rng: np.random.Generator, nodes: int, vocab: int) -> DraftTree:
    tree = DraftTree.rooted_at(int(rng.integers(3, vocab)))
    while len(tree) < nodes:           # parents among the latest nodes: deep paths, siblings
        tree.add(int(rng.integers(max(0, len(tree) - 3), len(tree))),
                 int(rng.integers(3, vocab)), 0.0)
    return tree


def test_every_tree_row_sees_its_own_paths_state(model, checkpoint):
    """One forward over a tree after a committed prefix gives every node the logits of a
    plain forward over prefix + its root-to-node path (longer paths than the convolution
    window included); keeping a path commits exactly that path's state."""
    ref = np.load(checkpoint / "logits.npz")
    prefix = ref["ids_long"].tolist()[:20]
    rng = np.random.default_rng(0)
    vocab = model.args.vocab_size
    for trial in range(3):
        tree = random_tree(rng, 14, vocab)
        assert max(tree.depth) > model.args.linear_conv_kernel_dim
        cache = model.make_cache()
        model(mx.array([prefix]), cache=cache)
        cache.commit()
        got = np.array(verify(model, cache, tree))
        for v in range(len(tree)):
            plain = model(mx.array([prefix + tree.path_tokens(v)]))[0, -1]
            assert relative_error(got[v], np.array(plain)) < TOL, (trial, v)
        leaf = max(range(len(tree)), key=lambda v: tree.depth[v])
        path = path_to(tree.parent, leaf)
        cache.keep(path)
        nxt = int(rng.integers(3, vocab))
        after = model(mx.array([[nxt]]), cache=cache)[0, -1]
        plain = model(mx.array([prefix + tree.path_tokens(leaf) + [nxt]]))[0, -1]
        assert relative_error(np.array(after), np.array(plain)) < TOL


def test_a_kept_row_must_be_a_path_and_rewinds_go_where_states_were_kept(model):
    cache = model.make_cache()
    tree = DraftTree.rooted_at(5)
    a = tree.add(0, 6, 0.0)
    tree.add(0, 7, 0.0)
    model(mx.array([list(range(3, 13))]), cache=cache)
    cache.commit()
    model(mx.array([tree.token]), cache=cache, positions=positions(tree.parent, 10),
          mask=attention_mask(tree.parent, 10))
    with pytest.raises(ValueError, match="not a path"):
        cache.keep([0, a, 2])
    pending = [(r.states[0].nbytes + r.inputs[0].nbytes) for r in cache.layers.values()]
    assert cache.node_bytes() == sum(pending)           # what one pending tree row holds
    cache.keep([0, a])
    assert cache.offset == 12 and cache.rewindable(11) == 11 and cache.rewindable(10) == 10
    assert cache.rewindable(5) == 0           # inside the first block: not kept
    with pytest.raises(ValueError, match="cannot be rewound to 5"):
        cache.reset(5)
    cache.reset(11)                           # back to the state after token 5 ...
    again = model(mx.array([[6]]), cache=cache)[0, -1]
    plain = model(mx.array([list(range(3, 13)) + [5, 6]]))[0, -1]
    assert relative_error(np.array(again), np.array(plain)) < TOL   # ... which is exact


def test_tree_decoding_is_token_identical_to_ar(checkpoint):
    """The model drafting for itself (a hybrid target and a hybrid drafter), past the
    convolution window, per-step sizing and a fixed tree: every strategy equals `ar`."""
    family = load(checkpoint, drafters=[checkpoint], warmup=False)
    ar = generate(family, PROMPT, "ar", max_tokens=40)
    assert len(ar.token_ids) >= 10
    fixed = dataclasses.replace(family.tree, adaptive=False, verify_pad=())
    for strategy in ("ngram", "draft", "treegraft", "chain:3"):
        for tree in (family.tree, fixed):
            out = generate(family, PROMPT, strategy, max_tokens=40, tree=tree)
            assert out.token_ids == ar.token_ids, (strategy, tree.adaptive)
    assert max(s.accepted for s in out.step_stats) >= 2     # trees committed several tokens


def test_turns_reuse_the_prefix_and_stop_inside_a_block(checkpoint):
    """A session over several turns (prefix reuse rewinds the recurrent state to a kept
    length and prefills the rest) and a stop string inside an accepted block give what fresh
    `ar` generations give."""
    family = load(checkpoint, drafters=[checkpoint], warmup=False)
    session = Session(family, family.tree)
    text = PROMPT
    for turn in range(3):
        want = generate(family, text, "ar", max_tokens=24)
        got = generate(family, text, "treegraft", max_tokens=24, session=session)
        assert got.token_ids == want.token_ids, turn
        text = text + got.text + "\nfor j in range(3):\n"
    stop_inside_a_block(family, session, "ngram", "treegraft")


def stop_inside_a_block(family, session: Session, strategy: str, after: str) -> None:
    """On a used session, `strategy` stopped by a string inside an accepted block gives what
    `ar` gives, and a turn of `after` that continues the text (rewound to before the stop)
    too."""
    full = generate(family, PROMPT, "ar", max_tokens=30).text
    stop = full[len(full) // 2:len(full) // 2 + 3]
    want = generate(family, PROMPT, "ar", max_tokens=30, stop=[stop])
    got = generate(family, PROMPT, strategy, max_tokens=30, stop=[stop], session=session)
    assert got.text == want.text and stop not in got.text
    again = generate(family, PROMPT + got.text, after, max_tokens=12, session=session)
    assert again.token_ids == generate(family, PROMPT + got.text, "ar", max_tokens=12).token_ids


def as_mlx_lm_reads_it(src: Path, dest: Path) -> Path:
    """The checkpoint as the Qwen 3.5 releases store it and `mlx_lm` reads it: named by its
    multimodal type, RoPE settings in both config forms (mlx_lm reads Qwen 3.5's from
    `rope_parameters` only, Qwen3-Next's from the top-level keys only) and Qwen 3.5 MoE's
    experts fused into `experts.gate_up_proj` / `experts.down_proj`."""
    from safetensors.numpy import load_file, save_file

    shutil.copytree(src, dest)
    config = legacy_config(json.loads((dest / "config.json").read_text()))  # both RoPE forms
    config["model_type"] = config["model_type"].removesuffix("_text")
    (dest / "config.json").write_text(json.dumps(config))
    weights = load_file(dest / "model.safetensors")
    for layer in range(config["num_hidden_layers"]):
        prefix = f"model.layers.{layer}.mlp.experts"
        if f"{prefix}.0.gate_proj.weight" not in weights or config["model_type"] == "qwen3_next":
            continue                              # Qwen3-Next releases them one by one
        e = range(config["num_experts"])
        gate_up = [np.concatenate([weights.pop(f"{prefix}.{i}.gate_proj.weight"),
                                   weights.pop(f"{prefix}.{i}.up_proj.weight")]) for i in e]
        weights[f"{prefix}.gate_up_proj"] = np.stack(gate_up)
        weights[f"{prefix}.down_proj"] = np.stack([weights.pop(f"{prefix}.{i}.down_proj.weight")
                                                   for i in e])
    save_file(weights, str(dest / "model.safetensors"))
    return dest


def test_logits_match_mlx_lm_as_released_and_as_mlx_lm_converts(checkpoint, tmp_path):
    """On the same weights, `mlx_lm`'s classes and ours agree (fused experts read alike; the
    MoE's within 1e-4: expert sums in another order), and
    a directory `mlx_lm` converted and quantized loads in ours as in its own."""
    import mlx_lm

    ids = mx.array([np.load(checkpoint / "logits.npz")["ids_long"].tolist()])
    released = as_mlx_lm_reads_it(checkpoint, tmp_path / "released")
    ours, theirs = load_model(released)[0], mlx_lm.load(str(released))[0]
    assert relative_error(ours(ids)[0], np.array(theirs(ids)[0])) < TOL
    mlx_lm.convert(str(released), mlx_path=str(tmp_path / "q4"), quantize=True, q_bits=4,
                   q_group_size=32)
    ours, theirs = load_model(tmp_path / "q4")[0], mlx_lm.load(str(tmp_path / "q4"))[0]
    theirs.set_dtype(mx.float32)
    assert ours.quantization["bits"] == 4
    assert relative_error(ours(ids)[0], np.array(theirs(ids)[0])) < 1e-3


def test_a_multimodal_checkpoint_is_read_for_its_text_model(checkpoint, tmp_path):
    """`text_config` nesting and `model.language_model.` names: the same logits, and one
    warning naming the vision weights left out."""
    from safetensors.numpy import load_file, save_file

    dest = tmp_path / "vl"
    shutil.copytree(checkpoint, dest)
    text = json.loads((dest / "config.json").read_text())
    kind = text["model_type"].removesuffix("_text")
    (dest / "config.json").write_text(json.dumps({"model_type": kind, "text_config": text,
                                                  "vision_config": {"depth": 1}}))
    weights = {k.replace("model.", "model.language_model.", 1): v
               for k, v in load_file(dest / "model.safetensors").items()}
    weights["model.visual.patch_embed.proj.weight"] = np.zeros((4, 3), np.float32)
    save_file(weights, str(dest / "model.safetensors"))
    with pytest.warns(UserWarning, match="1 vision weights left out"):
        model = load_model(dest)[0]
    ref = np.load(checkpoint / "logits.npz")
    assert relative_error(model(mx.array([ref["ids_short"].tolist()]))[0], ref["short"]) < TOL


def test_the_converter_reads_released_checkpoints_and_keeps_what_it_must(checkpoint, tmp_path):
    """`treegraft convert` on the released layout (fused experts, an MTP head): the same
    logits; cast to bf16, the decay parameters stay fp32 and the MTP head's tensors are
    carried into the bundle (left out on load); quantized to 4 bits (the Gated DeltaNet
    projections too), `mlx_lm` reads a Qwen 3.5 bundle as ours does."""
    import mlx_lm
    from safetensors.numpy import load_file, save_file
    from treegraft_mlx.convert.bundle import QuantSpec, convert_family

    src = as_mlx_lm_reads_it(checkpoint, tmp_path / "released")
    with_mtp = Path(shutil.copytree(src, tmp_path / "with_mtp"))
    weights = load_file(with_mtp / "model.safetensors")
    weights["mtp.fc.weight"] = np.zeros((64, 128), np.float32)
    save_file(weights, str(with_mtp / "model.safetensors"))
    ref = np.load(checkpoint / "logits.npz")
    ids = mx.array([ref["ids_long"].tolist()])
    quiet = dict(log=lambda line: None)
    plain = convert_family(str(with_mtp), [], str(tmp_path / "fp32"), **quiet) / "target"
    assert relative_error(load_model(plain)[0](ids)[0], ref["long"]) < TOL
    bf16 = convert_family(str(with_mtp), [], str(tmp_path / "bf16"), dtype="bfloat16", **quiet)
    stored = mx.load(str(next((bf16 / "target").glob("*.safetensors"))))
    assert stored["model.layers.0.linear_attn.A_log"].dtype == mx.float32
    fused = "qkvz" if "qwen3_next" in checkpoint.name else "qkv"   # kept as released
    assert stored[f"model.layers.0.linear_attn.in_proj_{fused}.weight"].dtype == mx.bfloat16
    assert "mtp.fc.weight" in stored
    model = load_model(bf16 / "target", dtype=mx.bfloat16)[0]
    assert model.model.layers[0].linear_attn.A_log.dtype == mx.float32
    q4 = convert_family(str(src), [], str(tmp_path / "q4"), quant=QuantSpec(4, 32),
                        **quiet) / "target"
    ours = load_model(q4)[0]
    assert ours.quantization["bits"] == 4
    assert isinstance(ours.model.layers[0].linear_attn.in_proj_z, nn.QuantizedLinear)
    if "qwen3_next" in checkpoint.name:   # mlx_lm takes stacked experts for its own layout
        return                            # and then skips moving the convolution's axes
    theirs = mlx_lm.load(str(q4))[0]
    theirs.set_dtype(mx.float32)
    assert relative_error(ours(ids)[0], np.array(theirs(ids)[0])) < 1e-3


@pytest.mark.parametrize("strategy", ["draft", "treegraft"])   # n-gram drafts: none at token 2
def test_sampling_on_a_hybrid_is_lossless(dense, strategy, monkeypatch):
    """The first two sampled tokens (the second through tree acceptance over the recurrent
    state; the drafter called on every step, its chain sampled) follow the target's
    distribution: chi-square over 400 seeds, alpha 0.001 (the rarest pair expects 9). Measured
    power: greedy acceptance mixed into sampling, injected, gave chi-square 501 in both cases."""
    from treegraft_mlx.pricing import CallPolicy

    monkeypatch.setattr(CallPolicy, "peek", lambda self, bucket: 3)
    pairs, chi2, _ = first_pairs_chi_square(load(dense, drafters=[dense], warmup=False),
                                            strategy)
    assert pairs == 9 and chi2 < 26.12          # df 8, alpha 0.001


def first_pairs_chi_square(family, strategy: str, seeds: int = 400) -> tuple[int, float, int]:
    """The first two tokens `strategy` samples after PROMPT (temperature 1.5, top-k 3) over
    `seeds` seeds on one session, against the target's exact distribution of them: (pairs
    the target can sample, chi-square, drafter forwards run). A pair the target never
    samples fails at once, with its seed."""
    from treegraft_mlx.sampling import SamplerSettings

    ids = family.tokenizer.encode(PROMPT)
    exact = exact_pair_distribution(family.target, ids, SamplerSettings(temp=1.5, top_k=3))
    keys = sorted(exact)
    counts = np.zeros(len(keys))
    session, calls = Session(family, family.tree), 0
    for seed in range(seeds):
        out = generate(family, ids, strategy, max_tokens=2, temp=1.5, top_k=3, seed=seed,
                       session=session)
        pair = tuple(out.token_ids)
        assert pair in exact, f"seed {seed}: {pair}, which the target never samples"
        counts[keys.index(pair)] += 1
        calls += out.drafter_calls
    expected = np.array([exact[k] for k in keys]) * counts.sum()
    return len(keys), float(((counts - expected) ** 2 / expected).sum()), calls


def test_pipeline_refuses_a_hybrid_target(checkpoint):
    from treegraft_mlx.pipeline import PipelineError, refuse_hybrid

    with pytest.raises(PipelineError, match="recurrent state"):
        refuse_hybrid(checkpoint)


def test_tree_mask_calls_of_a_hybrid_drafter_are_a_clear_error(checkpoint):
    family = load(checkpoint, drafters=[checkpoint], warmup=False)
    with pytest.raises(ValueError, match="hybrid"):
        generate(family, PROMPT, "treegraft-fixed:1", max_tokens=4)


@pytest.fixture(scope="module")
def pair(tmp_path_factory) -> tuple[Path, Path]:
    """A 6-layer Qwen 3.5 target and its 2-layer Qwen 3.5 drafter (no full-attention layer)."""
    return make_hybrid_pair(tmp_path_factory.mktemp("pair"))


def test_a_hybrid_drafter_is_probed_and_drafts_for_prompts_of_any_length(pair, measured_timing):
    """The default `load` (its first-use probe measuring the drafter as it can run: its
    chain), then prompts of 200, 1 and 5 tokens on one session (the later ones shorter than
    the lengths the recurrent caches recorded), two turns each: every strategy a hybrid
    drafter runs gives `ar`'s tokens, and its drafts are accepted along the way. A chain
    longer than the drafter's cache can rewind is refused up front."""
    family = load(pair[0], drafters=[pair[1]])
    assert probe.scheduler_timing(family, family.tree).t_mid_ms > 0
    rng = np.random.default_rng(0)
    prompts = [(rng.integers(3, 8000, 10).tolist() * 20), [5], rng.integers(3, 8000, 5).tolist()]
    for strategy in ("treegraft", "draft", "chain:2"):
        session, accepted = Session(family, family.tree), 0
        for ids in prompts:
            for turn in range(2):
                want = generate(family, ids, "ar", max_tokens=10).token_ids
                got = generate(family, ids, strategy, max_tokens=10, session=session)
                assert got.token_ids == want, (strategy, len(ids), turn)
                accepted += sum(s.accepted for s in got.step_stats)
                ids = ids + got.token_ids + [17, 29]
        assert accepted > 0, strategy
    with pytest.raises(ValueError, match="a chain of at most 15"):   # not a rewind error
        generate(family, prompts[2], "chain:16", max_tokens=4)


def test_a_tokenizer_mismatch_names_the_class_each_side_loaded(pair, tmp_path):
    """transformers loads a `qwen3_5` checkpoint's tokenizer by its model type (a class that
    adds `<|endoftext|>`), a Llama's by its tokenizer_config: the drafter is refused, and the
    error says which tokenizer class each side loaded."""
    target = Path(shutil.copytree(pair[0], tmp_path / "released"))
    config = json.loads((target / "config.json").read_text())
    (target / "config.json").write_text(json.dumps({**config, "model_type": "qwen3_5"}))
    drafter = fixture_path() / "target"
    classes = [type(load_tokenizer(p)._tokenizer).__name__ for p in (target, drafter)]
    if classes[0] == classes[1]:
        pytest.skip(f"this transformers loads {classes[0]} for both (5.25 does not)")
    with pytest.raises(LoadError, match="tokenizer mismatch") as refused:
        load(target, drafters=[drafter], warmup=False)
    assert f"tokenizer classes: target {classes[0]}, drafter target {classes[1]}" in str(
        refused.value)


def test_requests_decoded_together_equal_each_alone(checkpoint):
    """Hybrid requests joining the batch steps apart (one packed forward over every request's
    recurrent state and tree, each rolled back to its own accepted path) give what each
    gives alone."""
    family = load(checkpoint, drafters=[checkpoint], warmup=False)
    requests = [dict(prompt=PROMPT, strategy="treegraft", max_tokens=30),
                dict(prompt=PROMPT[:40], strategy="ngram", max_tokens=20),
                dict(prompt="for i in range(3):\n", strategy="draft", max_tokens=25)]
    got = decode_together(family, requests, [0, 1, 3])
    for request, responses in zip(requests, got):
        want = generate(family, request["prompt"], request["strategy"],
                        max_tokens=request["max_tokens"])
        assert [t for r in responses for t in r.tokens] == want.token_ids, request
