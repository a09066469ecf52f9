"""Gemma 4's assistant drafter: its logits against transformers' generator's (first draft
and deeper ones, tests/hf_reference/gemma4/assistant/), its pairing checks, and decoding
with it: greedy strategies token-identical to `ar` across turns and a stop inside a block,
tree layers expanded by it, sampling lossless."""

import json
import shutil
from pathlib import Path

import mlx.core as mx
import numpy as np
import pytest

from checkpoints import write_tokenizer
from scripted import deterministic
from test_hybrid import stop_inside_a_block
from treegraft_mlx import LoadError, generate, load, load_model
from treegraft_mlx.drafters import AssistantDrafter
from treegraft_mlx.history import History
from treegraft_mlx.session import Session

REFERENCES = Path(__file__).parent / "hf_reference" / "gemma4"
TOL = 1e-4
PROMPT = "def add(a, b):\n    return a + b\nclass Foo:\n    pass\nfor i in range(10):\n"


def relative_error(got, want) -> float:
    return float(np.abs(np.asarray(got) - want).max() / np.abs(want).max())


@pytest.fixture(scope="module")
def pair(tmp_path_factory) -> tuple[Path, Path]:
    """The shared-KV / PLE target (with a tokenizer) and its assistant (without one: it
    reads its target's)."""
    root = tmp_path_factory.mktemp("pair")
    target = root / "target"
    shutil.copytree(REFERENCES / "shared_ple", target)
    write_tokenizer(target)
    assistant = root / "assistant"
    shutil.copytree(REFERENCES / "assistant", assistant)
    return target, assistant


def prefilled(target, ids: list[int]):
    """The target's cache after a prefill of `ids`, its hidden states and next token."""
    cache = target.make_cache(128)
    hidden = target.run_layers(target.embed(mx.array([ids])), cache)[0]
    cache.commit()
    root = int(mx.argmax(target.head(hidden[None, -1:])[0, -1]).item())
    return cache, hidden, root


def test_drafts_and_logits_match_transformers(pair):
    """After the prompt's prefill (40 tokens: past the window), the assistant's chain of 4:
    transformers' drafted tokens, and its logits for the first draft and the deeper ones."""
    target, _ = load_model(pair[0])
    assistant, tok = load_model(pair[1])
    assert tok is None
    ref = np.load(pair[1] / "drafts.npz")
    ids = ref["prompt"].tolist()
    cache, hidden, root = prefilled(target, ids)
    assert root == int(ref["root"])
    drafter = AssistantDrafter(assistant, target, cache)
    drafter.feed(0, hidden)
    history = History(ids + [root], capacity=128)
    chain = drafter.queue_chain(root, len(ref["drafts"]), history)
    assert np.array(chain.tokens).tolist() == ref["drafts"].tolist()
    for depth in range(len(ref["drafts"])):
        assert relative_error(chain.rows[depth], ref["logits"][depth]) < TOL, depth


def test_a_tree_layer_is_one_forward_and_matches_the_chain(pair):
    """`expand` runs every node of one depth in one forward; the root's row is the chain's
    first, and a node's children are scored from its parent's carry."""
    from treegraft_mlx.tree import DraftTree

    target, _ = load_model(pair[0])
    assistant, _ = load_model(pair[1])
    ref = np.load(pair[1] / "drafts.npz")
    ids = ref["prompt"].tolist()
    cache, hidden, root = prefilled(target, ids)
    drafter = AssistantDrafter(assistant, target, cache, top_k=3)
    drafter.feed(0, hidden)
    history = History(ids + [root], capacity=128)
    tree = DraftTree.rooted_at(root)
    frontier = drafter.expand(tree, [0], 1, history)
    assert drafter.calls == 1 and int(ref["drafts"][0]) in [tree.token[v] for v in frontier]
    drafter.expand(tree, frontier, 2, history)
    assert drafter.calls == 2                    # all three children of the root in one
    first = tree.child(0, int(ref["drafts"][0]))
    best = max((v for v in range(len(tree)) if tree.parent[v] == first),
               key=lambda v: tree.score[v])
    assert tree.token[best] == int(ref["drafts"][1])


def test_pairing_refusals_are_clear(pair, tmp_path):
    """Another architecture, another vocabulary, the assistant as the target, store layers
    of another K/V shape."""
    from safetensors.numpy import load_file, save_file

    other = tmp_path / "llama"
    shutil.copytree(Path(__file__).parent / "hf_reference" / "llama3-rope", other)
    write_tokenizer(other)
    with pytest.raises(LoadError, match="only for a Gemma 4 target, not llama"):
        load(other, drafters=[pair[1]], warmup=False)
    small = tmp_path / "vocab"
    shutil.copytree(pair[1], small)
    config = json.loads((small / "config.json").read_text())
    config["text_config"]["vocab_size"] = 200
    (small / "config.json").write_text(json.dumps(config))
    weights = load_file(small / "model.safetensors")
    weights["model.embed_tokens.weight"] = weights["model.embed_tokens.weight"][:200]
    weights["masked_embedding.token_ordering"] = np.arange(200)
    save_file(weights, small / "model.safetensors", metadata={"format": "pt"})
    with pytest.raises(LoadError, match="vocabulary mismatch: the assistant has 200 tokens"):
        load(pair[0], drafters=[small], warmup=False)
    with pytest.raises(LoadError, match="it cannot be the target"):
        load(pair[1], warmup=False)
    narrow = tmp_path / "k_eq_v"               # one global KV head where it reads two
    shutil.copytree(REFERENCES / "k_eq_v", narrow)
    write_tokenizer(narrow)
    with pytest.raises(LoadError, match="full_attention layers read K/V of shape"):
        load(narrow, drafters=[pair[1]], warmup=False)


@pytest.fixture
def family(pair):
    """A fresh family per test (what decoding learned in one test never steers another),
    on the scripted clock (what it learns never depends on load)."""
    return deterministic(load(pair[0], drafters=[pair[1]], warmup=False))


def test_greedy_strategies_are_token_identical_to_ar(family):
    import dataclasses

    fixed = dataclasses.replace(family.tree, adaptive=False, verify_pad=())
    ar = generate(family, PROMPT, "ar", max_tokens=32)
    for strategy in ("draft", "chain:3", "treegraft", "treegraft-fixed:1,2"):
        for tree in (family.tree, fixed):
            out = generate(family, PROMPT, strategy, max_tokens=32, tree=tree)
            assert out.token_ids == ar.token_ids, (strategy, tree.adaptive)
            assert out.drafter_calls > 0, strategy


@pytest.mark.parametrize("fitted", [False, True], ids=["transformers", "fitted"])
def test_turns_reuse_the_prefix_and_a_stop_inside_a_block(pair, overconfident, fitted,
                                                          monkeypatch):
    """Two chat turns on one session and a stop string inside a block: what fresh `ar`
    generations give, the assistant drafting on every step (the call policy forced); the
    fitted one's drafts are accepted."""
    from treegraft_mlx.pricing import CallPolicy

    monkeypatch.setattr(CallPolicy, "peek", lambda self, bucket: 3)
    family = deterministic(load(pair[0], drafters=[overconfident if fitted else pair[1]],
                                warmup=False))
    session = Session(family, family.tree)
    text, accepted = PROMPT, 0
    for turn in range(2):
        for strategy in ("draft", "treegraft"):
            want = generate(family, text, "ar", max_tokens=20)
            got = generate(family, text, strategy, max_tokens=20, session=session)
            assert got.token_ids == want.token_ids, (turn, strategy)
            assert got.drafter_calls > 0
            accepted += sum(s.accepted for s in got.step_stats) if strategy == "draft" else 0
        text = text + got.text + "\nfor j in range(3):\n"
    assert accepted > 0 or not fitted
    stop_inside_a_block(family, session, "draft", "treegraft")


def fit_assistant(target_dir: Path, assistant_dir: Path, dest: Path, scale: float) -> Path:
    """An assistant of the target's width (plain tied head, the target's embedding) made to
    predict what the target does after PROMPT: its layers silenced (output projections zero)
    and `pre_projection` fitted by least squares to map [embedding of a token, the target's
    final-norm hidden state before it] to the target's (unweighted) normed hidden state at
    that token, over PROMPT's last position paired with each of the target's 3 likeliest
    first tokens and the greedy continuations (63 rows for 64 inputs: an exact fit); its
    final norm makes its logits about `scale` times the target's, and `post_projection`
    hands the target's hidden state on. Its drafts are accepted there, where a random
    assistant's almost never are."""
    from mlx.utils import tree_flatten
    from safetensors.numpy import save_file

    from treegraft_mlx.models import build_model, model_args

    target, tokenizer = load_model(target_dir)
    t = target.args
    config = json.loads((assistant_dir / "config.json").read_text())
    config["use_ordered_embeddings"] = False
    config["text_config"]["hidden_size"] = t.hidden_size
    assistant = build_model(model_args(config))
    weights = {k: np.array(v) for k, v in tree_flatten(assistant.parameters())}
    for name in weights:
        if name.endswith(("self_attn.o_proj.weight", "mlp.down_proj.weight")):
            weights[name][:] = 0.0
    w_norm = np.array(target.model.norm.weight)
    weights["model.embed_tokens.weight"] = np.array(target.model.embed_tokens.weight)
    weights["model.norm.weight"] = scale * w_norm
    weights["post_projection.weight"] = np.eye(t.hidden_size, dtype=np.float32) / scale
    prompt = tokenizer.encode(PROMPT)
    logits = np.array(target(mx.array([prompt]))[0, -1])
    family = load(target_dir, warmup=False)
    rows, goals = [], []
    for first in np.argsort(-logits)[:3].tolist():
        ids = prompt + [first] + generate(family, prompt + [first], "ar",
                                          max_tokens=20).token_ids
        g = np.array(target.model.norm(target.run_layers(target.embed(mx.array([ids])))))[0]
        e = np.array(target.token_embedding(mx.array([ids])))[0]
        n = len(prompt) - 1
        rows.append(np.concatenate([e[n + 1:], g[n:-1]], -1))
        goals.append(g[n + 1:] / w_norm)
    fit, *_ = np.linalg.lstsq(np.concatenate(rows), np.concatenate(goals), rcond=None)
    weights["pre_projection.weight"] = np.ascontiguousarray(fit.T.astype(np.float32))
    dest.mkdir(parents=True)
    save_file(weights, str(dest / "model.safetensors"))
    (dest / "config.json").write_text(json.dumps(config))
    return dest


@pytest.fixture(scope="module")
def overconfident(pair, tmp_path_factory) -> Path:
    """A fitted assistant with its logits four times the target's: drafts from a
    distribution close to the target's but sharper, so min(1, p/q) rejects some of them."""
    return fit_assistant(pair[0], pair[1], tmp_path_factory.mktemp("sharp") / "assistant", 4.0)


@pytest.mark.parametrize("strategy", ["draft", "treegraft"])
def test_sampling_with_the_assistant_is_lossless(pair, overconfident, strategy, monkeypatch):
    """The first two sampled tokens (the second drafted by the assistant from its own
    distribution, accepted by min(1, p/q)) follow the target's: chi-square over 400 seeds,
    alpha 0.001 (test_hybrid.first_pairs_chi_square). The assistant's drafts are accepted
    often, so a wrong acceptance rule shows."""
    from test_hybrid import first_pairs_chi_square
    from treegraft_mlx.pricing import CallPolicy

    monkeypatch.setattr(CallPolicy, "peek", lambda self, bucket: 3)
    family = deterministic(load(pair[0], drafters=[overconfident], warmup=False))
    accepted = 0
    for seed in range(40):
        out = generate(family, PROMPT, strategy, max_tokens=2, temp=1.5, top_k=3, seed=seed)
        accepted += sum(step.accepted for step in out.step_stats)
    assert accepted >= 10
    pairs, chi2, calls = first_pairs_chi_square(family, strategy)
    assert calls >= 400
    assert pairs == 9 and chi2 < 26.12          # df 8, alpha 0.001


def test_the_fitted_assistant_drafts_what_the_target_accepts(pair, overconfident):
    """Greedy, its chains are accepted (the fit is right) and the output is `ar`'s."""
    family = deterministic(load(pair[0], drafters=[overconfident], warmup=False))
    ar = generate(family, PROMPT, "ar", max_tokens=20)
    out = generate(family, PROMPT, "draft", max_tokens=20)
    assert out.token_ids == ar.token_ids and out.mean_accepted > 1.5


def test_without_an_assistant_the_ngram_drafter_serves(pair):
    """A Gemma 4 target alone (no assistant cached or named) speculates with n-grams."""
    import dataclasses

    from treegraft_mlx.pairing import choose_drafter

    choice = choose_drafter(pair[0], str(pair[0]), download=False)
    assert choice.path is None and "n-gram drafter alone" in choice.line
    family = deterministic(load(pair[0], warmup=False))
    fixed = dataclasses.replace(family.tree, adaptive=False, verify_pad=())
    ar = generate(family, PROMPT, "ar", max_tokens=32)
    out = generate(family, PROMPT, "ngram", max_tokens=32, tree=fixed)
    assert out.token_ids == ar.token_ids
    assert any(s.nodes_verified > 1 for s in out.step_stats)     # n-gram drafts verified


def test_the_cached_assistant_of_the_targets_width_is_picked(pair, tmp_path, monkeypatch):
    """Known pairs name Google's assistants; from the cache, the assistant trained beside
    a target of this width is picked, one of another width skipped."""
    from huggingface_hub import constants

    from test_hub import fake_cache
    from treegraft_mlx.pairing import choose_drafter, known_drafter

    assert known_drafter("google/gemma-4-E2B-it") == "google/gemma-4-E2B-it-assistant"
    assert known_drafter("google/gemma-4-26B-A4B-it") == "google/gemma-4-26B-A4B-it-assistant"
    monkeypatch.setattr(constants, "HF_HUB_CACHE", str(tmp_path / "hub"))
    wide = tmp_path / "wide"
    shutil.copytree(pair[1], wide)
    config = json.loads((wide / "config.json").read_text())
    config["backbone_hidden_size"] *= 2
    (wide / "config.json").write_text(json.dumps(config))
    fake_cache(tmp_path / "hub", "acme/gemma-4-big-assistant", wide)
    fake_cache(tmp_path / "hub", "acme/gemma-4-assistant", pair[1])
    choice = choose_drafter(pair[0], "acme/gemma-4", download=False)
    assert choice.name == "acme/gemma-4-assistant"
    family = load(pair[0], drafters=[choice.path], warmup=False)
    assert isinstance(Session(family, family.tree).strong, AssistantDrafter)


def test_a_converted_bundle_keeps_the_assistant(pair, tmp_path):
    """`treegraft convert` with the assistant as drafter (no tokenizer of its own): in
    full precision its drafts are transformers', in 4 bits the bundle decodes as `ar`."""
    from treegraft_mlx.convert import QuantSpec, convert_family

    quiet = dict(log=lambda line: None)
    plain = convert_family(str(pair[0]), [str(pair[1])], str(tmp_path / "fp"), **quiet)
    family = load(plain, warmup=False)
    assert isinstance(Session(family, family.tree).strong, AssistantDrafter)
    ref = np.load(pair[1] / "drafts.npz")
    ids = ref["prompt"].tolist()
    cache, hidden, root = prefilled(family.target, ids)
    drafter = AssistantDrafter(family.strong, family.target, cache)
    drafter.feed(0, hidden)
    chain = drafter.queue_chain(root, len(ref["drafts"]), History(ids + [root], capacity=64))
    assert relative_error(chain.rows, ref["logits"]) < TOL
    q4 = convert_family(str(pair[0]), [str(pair[1])], str(tmp_path / "q4"),
                        quant=QuantSpec(4, 32), **quiet)
    family = deterministic(load(q4, warmup=False))
    assert (generate(family, PROMPT, "draft", max_tokens=16).token_ids
            == generate(family, PROMPT, "ar", max_tokens=16).token_ids)
