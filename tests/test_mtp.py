"""The MTP head as a drafter: a transformers-written tiny hybrid given a random `mtp.*` head.
Its forward against the formula written out in numpy, decoding with it token-identical to `ar`
across turns, prefix reuse and a stop inside a block, sampling with it lossless, and its
weights through `treegraft convert`."""

import json
import shutil
from pathlib import Path

import mlx.core as mx
import mlx.nn as nn
import numpy as np
import pytest
from safetensors.numpy import load_file, save_file

from checkpoints import write_tokenizer
from test_hybrid import (PROMPT, REFERENCES, first_pairs_chi_square, relative_error,
                         stop_inside_a_block)
from treegraft_mlx import generate, load
from treegraft_mlx.loading import load_model
from treegraft_mlx.session import Session

TOL = 1e-4


def with_mtp_head(src: Path, dest: Path, layers: int = 1, seed: int = 0) -> Path:
    """A copy of a reference hybrid with a random MTP head (shaped as its full-attention
    layer 3, whose MLP kind the head's layer 0 shares) and `mtp_num_hidden_layers`."""
    shutil.copytree(src, dest)
    write_tokenizer(dest)
    rng = np.random.default_rng(seed)
    weights = load_file(dest / "model.safetensors")
    hidden = weights["model.embed_tokens.weight"].shape[1]

    def noise(*shape, scale=0.15):
        return (scale * rng.standard_normal(shape)).astype(np.float32)

    for name, w in list(weights.items()):
        if name.startswith("model.layers.3."):
            scale = 0.2 if name.endswith("norm.weight") else 0.15
            weights[name.replace("model.layers.3.", "mtp.layers.0.")] = noise(*w.shape,
                                                                               scale=scale)
    weights["mtp.fc.weight"] = noise(hidden, 2 * hidden)
    for norm in ("pre_fc_norm_embedding", "pre_fc_norm_hidden", "norm"):
        weights[f"mtp.{norm}.weight"] = noise(hidden, scale=0.2)
    save_file(weights, str(dest / "model.safetensors"))
    config = json.loads((dest / "config.json").read_text())
    (dest / "config.json").write_text(json.dumps({**config, "mtp_num_hidden_layers": layers}))
    return dest


def fit_head(dest: Path, firsts: int = 1, tokens: int = 60, scale: float = 1.0) -> Path:
    """The head of a `with_mtp_head` checkpoint made to predict what the target does after
    PROMPT: its attention and MLP silenced (output projections zero) and `fc` fitted by least
    squares to map each row's normed inputs to the target's normed hidden state one position
    later, over PROMPT followed by each of the target's `firsts` likeliest first tokens and
    the greedy continuation (`tokens` in all: fewer rows than fc's inputs, an exact fit); its
    final norm makes its logits about `scale` times the target's. Its drafts are accepted
    there, where a random head's almost never are."""
    weights = load_file(dest / "model.safetensors")
    for name in ("self_attn.o_proj", "mlp.down_proj"):            # a dense layer's
        weights[f"mtp.layers.0.{name}.weight"][:] = 0.0
    family = load(dest, warmup=False)
    model, eps = family.target, family.target.args.rms_norm_eps
    prompt = family.tokenizer.encode(PROMPT)
    first = np.argsort(-np.array(model(mx.array([prompt]))[0, -1]))[:firsts].tolist()
    rows, targets = [], []
    for t in first:
        ids = prompt + [t]
        ids += generate(family, ids, "ar", max_tokens=tokens // firsts).token_ids
        target = np.array(model.model.norm(model.run_layers(model.embed(mx.array([ids]))))[0])
        embedded = weights["model.embed_tokens.weight"][np.array(ids[1:])]
        rows.append(np.concatenate([
            rms(embedded, weights["mtp.pre_fc_norm_embedding.weight"], eps),
            rms(target[:-1], weights["mtp.pre_fc_norm_hidden.weight"], eps)], -1))
        targets.append(target[1:])
    fc, *_ = np.linalg.lstsq(np.concatenate(rows), np.concatenate(targets), rcond=None)
    weights["mtp.fc.weight"] = np.ascontiguousarray(fc.T.astype(np.float32))
    size = np.sqrt((np.concatenate(targets) ** 2).mean())       # the targets' RMS
    weights["mtp.norm.weight"][:] = scale * size - 1.0
    save_file(weights, str(dest / "model.safetensors"))
    return dest


@pytest.fixture(scope="module", params=["qwen3_5", "qwen3_5_moe", "qwen3_next"])
def headed(request, tmp_path_factory) -> Path:
    return with_mtp_head(REFERENCES / request.param,
                         tmp_path_factory.mktemp(request.param) / request.param)


@pytest.fixture(scope="module")
def overconfident(tmp_path_factory) -> Path:
    """A head fitted after each first token the sampled test can see, its logits doubled:
    drafts from a distribution close to the target's but sharper, so min(1, p/q) rejects
    some of them. What
    gives the sampled test its power: a random head's samples fall outside the target's
    top-k (always rejected, whatever the rule), a fitted one's are almost always accepted."""
    return fit_head(with_mtp_head(REFERENCES / "qwen3_5",
                                  tmp_path_factory.mktemp("sharp") / "qwen3_5"),
                    firsts=3, scale=2.0)


@pytest.fixture(scope="module")
def fitted(tmp_path_factory) -> Path:
    """The dense hybrid with a head fitted to its PROMPT: the decoding tests' target."""
    return fit_head(with_mtp_head(REFERENCES / "qwen3_5",
                                  tmp_path_factory.mktemp("fitted") / "qwen3_5"))


def rms(x: np.ndarray, weight: np.ndarray, eps: float) -> np.ndarray:
    """A zero-centred RMSNorm (weight stored as an offset from 1)."""
    return x / np.sqrt((x * x).mean(-1, keepdims=True) + eps) * (1.0 + weight)


def rotate(x: np.ndarray, positions: np.ndarray, dims: int, theta: float) -> np.ndarray:
    """Rotary embedding of the first `dims` of each head's dims (halves rotated), (L, h, d)."""
    freqs = theta ** (-np.arange(0, dims, 2) / dims)
    angle = positions[:, None, None] * freqs[None, None, :]
    a, b = x[..., :dims // 2], x[..., dims // 2:dims]
    return np.concatenate([a * np.cos(angle) - b * np.sin(angle),
                           a * np.sin(angle) + b * np.cos(angle), x[..., dims:]], -1)


def reference_head(w: dict, config: dict, tokens: np.ndarray, hidden: np.ndarray,
                   positions: np.ndarray) -> np.ndarray:
    """Logits of the MTP rows pairing the embedding of `tokens` with the target's normed
    final `hidden` at `positions`, straight from the formula (dense MLP layer)."""
    eps, H = config["rms_norm_eps"], config["hidden_size"]
    heads, kv, hd = (config["num_attention_heads"], config["num_key_value_heads"],
                     config["head_dim"])
    rope = config["rope_parameters"]
    dims = int(hd * rope["partial_rotary_factor"])
    p = "mtp.layers.0."
    e = rms(w["model.embed_tokens.weight"][tokens], w["mtp.pre_fc_norm_embedding.weight"], eps)
    h = rms(hidden, w["mtp.pre_fc_norm_hidden.weight"], eps)
    x = np.concatenate([e, h], -1) @ w["mtp.fc.weight"].T
    a = rms(x, w[p + "input_layernorm.weight"], eps)
    L = len(tokens)
    qg = (a @ w[p + "self_attn.q_proj.weight"].T).reshape(L, heads, 2 * hd)
    q, gate = qg[..., :hd], qg[..., hd:].reshape(L, heads * hd)
    k = (a @ w[p + "self_attn.k_proj.weight"].T).reshape(L, kv, hd)
    v = (a @ w[p + "self_attn.v_proj.weight"].T).reshape(L, kv, hd)
    q = rotate(rms(q, w[p + "self_attn.q_norm.weight"], eps), positions, dims, rope["rope_theta"])
    k = rotate(rms(k, w[p + "self_attn.k_norm.weight"], eps), positions, dims, rope["rope_theta"])
    k, v = np.repeat(k, heads // kv, axis=1), np.repeat(v, heads // kv, axis=1)
    scores = np.einsum("qhd,khd->hqk", q, k) / np.sqrt(hd)
    scores = np.where(np.tril(np.ones((L, L), bool)), scores, -np.inf)
    att = np.exp(scores - scores.max(-1, keepdims=True))
    att /= att.sum(-1, keepdims=True)
    out = np.einsum("hqk,khd->qhd", att, v).reshape(L, heads * hd) / (1 + np.exp(-gate))
    x = x + out @ w[p + "self_attn.o_proj.weight"].T
    m = rms(x, w[p + "post_attention_layernorm.weight"], eps)
    g, u = m @ w[p + "mlp.gate_proj.weight"].T, m @ w[p + "mlp.up_proj.weight"].T
    x = x + (g / (1 + np.exp(-g)) * u) @ w[p + "mlp.down_proj.weight"].T
    return rms(x, w["mtp.norm.weight"], eps) @ w["lm_head.weight"].T


def test_the_head_computes_its_formula_with_its_own_cache(tmp_path):
    """The head's logits over prompt rows equal the formula's (numpy above), run in one block
    and then row by row from its own cache, at positions past the start."""
    src = with_mtp_head(REFERENCES / "qwen3_5", tmp_path / "qwen3_5")
    model = load_model(src)[0]
    w = load_file(src / "model.safetensors")
    config = json.loads((src / "config.json").read_text())
    ids = np.load(src / "logits.npz")["ids_long"].tolist()[:24]
    hidden = model.model.norm(model.run_layers(model.embed(mx.array([ids]))))[0]
    tokens, rows = np.array(ids[1:]), np.array(hidden[:-1])      # (h_p, t_{p+1}) at p
    start = 5                                   # the head's rows begin after position 5
    want = reference_head(w, config, tokens[start:], rows[start:],
                          np.arange(start, len(tokens)).astype(np.float64))
    cache = model.mtp.make_cache(2, 16, 64, mx.float32)
    head = model.mtp(model.embed(mx.array([tokens[start:-4].tolist()])),
                     mx.array(rows[None, start:-4]), cache, start)
    cache.commit()
    got = [np.array(model.logits(head)[0])]
    for p in range(len(tokens) - 4, len(tokens)):
        one = model.mtp(model.embed(mx.array([[int(tokens[p])]])), mx.array(rows[None, p:p + 1]),
                        cache, p)
        cache.commit()
        got.append(np.array(model.logits(one)[0]))
    assert relative_error(np.concatenate(got), want) < TOL


def test_every_hybrid_loads_its_head_and_a_checkpoint_without_one_has_no_mtp(headed, tmp_path):
    model = load_model(headed)[0]
    assert model.mtp is not None and model.args.mtp_num_hidden_layers == 1
    plain = tmp_path / "plain"
    shutil.copytree(REFERENCES / headed.name, plain)
    write_tokenizer(plain)
    family = load(plain, warmup=False)
    assert family.mtp is None
    with pytest.raises(ValueError, match="multi-token-prediction head"):
        generate(family, PROMPT, "mtp", max_tokens=4)
    with pytest.warns(UserWarning, match="2 layers"):
        two = load_model(with_mtp_head(REFERENCES / headed.name, tmp_path / "two", layers=2))[0]
    assert getattr(two, "mtp", None) is None


def test_mtp_and_treegraft_are_token_identical_to_ar(headed):
    """Past the convolution window, sized per step and with a fixed tree, on every hybrid."""
    import dataclasses

    family = load(headed, warmup=False)
    ar = generate(family, PROMPT, "ar", max_tokens=32)
    fixed = dataclasses.replace(family.tree, adaptive=False, verify_pad=())
    for strategy in ("mtp", "treegraft"):
        for tree in (family.tree, fixed):
            out = generate(family, PROMPT, strategy, max_tokens=32, tree=tree)
            assert out.token_ids == ar.token_ids, (strategy, tree.adaptive)


def test_turns_reuse_the_prefix_stop_inside_a_block_and_drafts_are_accepted(fitted, monkeypatch):
    """Three chat turns on one session (the head's cache rewound with the target's), a stop
    string inside an accepted block, and a turn after it: what fresh `ar` generations give.
    The head drafts on every step (the call policy forced to call), hears every committed
    position (its cache never restarts at a gap) and its drafts are accepted."""
    from treegraft_mlx.pricing import CallPolicy, Fallback

    monkeypatch.setattr(CallPolicy, "peek", lambda self, bucket: 3)
    # Nor may a plain stretch take a turn's steps: the fallback decides on wall-clock rates,
    # and on a loaded machine it once took every step of a turn (no call to count).
    monkeypatch.setattr(Fallback, "next_stretch", lambda self: 0)
    family = load(fitted, warmup=False)
    session = Session(family, family.tree)
    text, accepted = PROMPT, 0
    for turn in range(3):
        for strategy in ("mtp", "treegraft"):
            want = generate(family, text, "ar", max_tokens=24)
            got = generate(family, text, strategy, max_tokens=24, session=session)
            assert got.token_ids == want.token_ids, (turn, strategy)
            assert got.drafter_calls > 0
            assert session.mtp.base == 0         # fed every committed position: no restart
            if strategy == "mtp":                     # every draft there is the head's
                accepted += sum(s.accepted for s in got.step_stats)
        text = text + got.text + "\nfor j in range(3):\n"
    assert accepted > 0
    stop_inside_a_block(family, session, "mtp", "mtp")


@pytest.mark.parametrize("strategy", ["mtp", "treegraft"])
def test_sampling_with_the_head_is_lossless(overconfident, strategy, monkeypatch):
    """The first two sampled tokens (the second drafted by the head, its chain sampled from
    its own distribution and accepted by min(1, p/q)) follow the target's distribution:
    chi-square over 400 seeds, alpha 0.001. Measured power (mutations of verify.py, run by
    hand): accepting every sampled draft, or with min(1, 2p/q), gives chi-square 72 in both
    cases; drawing from p instead of the residual after a rejection 22 (`mtp`) and 32."""
    from treegraft_mlx.pricing import CallPolicy

    monkeypatch.setattr(CallPolicy, "peek", lambda self, bucket: 3)
    pairs, chi2, calls = first_pairs_chi_square(load(overconfident, warmup=False), strategy)
    assert calls >= 400                             # the head drafted on every step
    assert pairs == 9 and chi2 < 26.12          # df 8, alpha 0.001


def test_the_head_survives_convert_and_quantization(headed, tmp_path):
    """`treegraft convert` keeps the head: in full precision its logits are the checkpoint's,
    in 4 bits its layer is quantized (its `fc` kept in full precision) and it still drafts
    what `ar` accepts."""
    from treegraft_mlx.convert.bundle import QuantSpec, convert_family

    quiet = dict(log=lambda line: None)
    ids = mx.array([np.load(headed / "logits.npz")["ids_short"].tolist()])

    def head_logits(model):
        hidden = model.model.norm(model.run_layers(model.embed(ids)))
        out = model.mtp(model.embed(ids), hidden, None, 0)
        return np.array(model.logits(out)[0])

    original = load_model(headed)[0]
    plain = convert_family(str(headed), [], str(tmp_path / "fp32"), **quiet) / "target"
    assert relative_error(head_logits(load_model(plain)[0]), head_logits(original)) < TOL
    q4 = convert_family(str(headed), [], str(tmp_path / "q4"), quant=QuantSpec(4, 32),
                        **quiet)
    model = load_model(q4 / "target")[0]
    assert isinstance(model.mtp.layers[0].self_attn.q_proj, nn.QuantizedLinear)
    assert not isinstance(model.mtp.fc, nn.QuantizedLinear)
    family = load(q4, warmup=False)
    assert (generate(family, PROMPT, "mtp", max_tokens=12).token_ids
            == generate(family, PROMPT, "ar", max_tokens=12).token_ids)
