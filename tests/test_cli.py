"""Every `treegraft` command through click's CliRunner: schemas, exit codes, error messages."""

import json
from pathlib import Path

import numpy as np
import pytest
from click.testing import CliRunner

from checkpoints import make_checkpoint, write_tokenizer
from scripted import scripted_step_costs
from serving import IdleServer
from treegraft_mlx import calibrate as C
from treegraft_mlx import family as F
from treegraft_mlx import probe
from treegraft_mlx import server as server_mod
from treegraft_mlx import fixture_path, generate, load
from treegraft_mlx.strategy import parse_strategy
from treegraft_mlx.engine import make_decoder
from treegraft_mlx.cli import main
from treegraft_mlx.generate import chat_prompt, encode_prompt
from treegraft_mlx.sampling import SamplerSettings
from treegraft_mlx.session import Session

SUITE = Path(__file__).parents[1] / "benchmarks/prompts/public.jsonl"
FIELDS = {"text", "token_ids", "prompt_tokens", "generation_tokens", "steps", "mean_accepted",
          "tokens_per_sec", "strategy", "drafter_calls"}


def run(*args, input=None):
    return CliRunner().invoke(main, list(args), input=input)


@pytest.fixture(scope="module")
def family():
    return load(fixture_path())


@pytest.fixture
def prefills(monkeypatch) -> list[tuple[int, int]]:
    """(cached tokens reused, prompt tokens) of every session's prefill while the test runs
    (Session.prefill_part: the prefill of every loop, alone or in a batch)."""
    seen: list[tuple[int, int]] = []
    real = Session.prefill_part

    def spy(self, ids, settings, rng):
        seen.append((self.reusable(ids), len(ids)))
        return real(self, ids, settings, rng)

    monkeypatch.setattr(Session, "prefill_part", spy)
    return seen


def test_generate_json_schema_for_each_strategy():
    # The learned scheduler's calls depend on this machine's measured T_tgt / T_mid, so the
    # "drafter was called" check uses a fixed schedule; every strategy must match `ar`.
    outs = {}
    for strategy in ("ar", "ngram", "treegraft", "treegraft-fixed:1"):
        r = run("generate", "--prompt", "import os\n\ndef walk(path):\n", "--max-tokens", "24",
                "--strategy", strategy, "--json")
        assert r.exit_code == 0, r.output
        out = json.loads(r.stdout)
        assert set(out) == FIELDS and out["strategy"] == strategy
        assert out["generation_tokens"] == len(out["token_ids"]) <= 24
        assert out["mean_accepted"] == (out["generation_tokens"] - 1) / out["steps"]  # after the first
        outs[strategy] = out
    assert all(o["token_ids"] == outs["ar"]["token_ids"] for o in outs.values())
    assert outs["ar"]["drafter_calls"] == outs["ngram"]["drafter_calls"] == 0
    assert outs["treegraft-fixed:1"]["drafter_calls"] > 0


def test_no_autotune_measures_nothing_and_keeps_the_output(tmp_path, monkeypatch):
    """A pair nobody measured: --no-autotune writes no timings and verifies the fixed tree;
    the first autotuned run measures and caches (then later runs read the cache)."""
    monkeypatch.setenv("TREEGRAFT_CACHE", str(tmp_path))
    args = ("generate", "--prompt", "def f(x):\n", "--max-tokens", "16", "--strategy", "ngram",
            "--json")
    plain = run(*args, "--no-autotune")
    assert plain.exit_code == 0, plain.output
    assert not (tmp_path / "timings.json").exists()
    tuned = run(*args)
    assert tuned.exit_code == 0, tuned.output
    assert "steps|" in (tmp_path / "timings.json").read_text()
    assert json.loads(tuned.stdout)["token_ids"] == json.loads(plain.stdout)["token_ids"]


STDIN_PROMPT = "def area(r):\n"


@pytest.mark.parametrize("prompt_args", [(), ("--prompt", "-")])
def test_generate_reads_stdin_and_streams_text(family, prompt_args):
    """Without --prompt (or with '-') the prompt is stdin: the streamed text is exactly the
    generation from it (not from an empty or default prompt)."""
    expected = generate(family, STDIN_PROMPT, "ar", max_tokens=8)
    r = run("generate", *prompt_args, "--max-tokens", "8", "--strategy", "ngram", "--verbose",
            input=STDIN_PROMPT)
    assert r.exit_code == 0, r.output
    assert r.stdout == expected.text + "\n"
    assert f"prompt: {len(encode_prompt(family.tokenizer, STDIN_PROMPT))} tokens" in r.stderr
    assert "generation: 8 tokens" in r.stderr


def test_generate_errors_name_the_problem(tmp_path):
    r = run("generate", "--model", str(tmp_path / "missing"), "--prompt", "x")
    assert r.exit_code == 1 and "does not exist" in r.output
    r = run("generate", "--prompt", "x", "--strategy", "warp-speed")
    assert r.exit_code == 1 and "unknown strategy" in r.output
    r = run("generate", "--prompt", "x = 1\n" * 1200, "--max-tokens", "4")
    assert r.exit_code == 1 and "context" in r.output
    other = tmp_path / "other"
    make_checkpoint(other, "llama")
    write_tokenizer(other, vocab_size=280)
    r = run("generate", "--model", str(fixture_path() / "target"), "--draft-model", str(other),
            "--prompt", "x")
    assert r.exit_code == 1 and "tokenizer mismatch" in r.output
    r = run("generate", "--prompt", "x", "--temp", "-1")
    assert r.exit_code == 2
    r = run("generate", "--prompt", "x", "--stop", "")  # would stop before any text
    assert r.exit_code == 1 and "stop strings must be non-empty" in r.output


def test_chat_session_commands(family, prefills):
    """A second turn reuses the cached conversation (only its new tokens are prefilled) and
    still replies exactly what a fresh generation of the whole chat gives; /reset starts over."""
    r = run("chat", "--max-tokens", "8", "--strategy", "ngram",
            input="def f():\n/stats\nand again\n/reset\nclass A:\n/quit\n")
    assert r.exit_code == 0, r.output
    assert "tokens cached" in r.output and "(conversation reset)" in r.output
    (first, _), (reused, length), (after_reset, _) = prefills
    turn1 = [{"role": "user", "content": "def f():"}]
    reply1 = generate(family, chat_prompt(family.tokenizer, turn1), "ar", max_tokens=8).text
    turn2 = turn1 + [{"role": "assistant", "content": reply1}, {"role": "user", "content": "and again"}]
    reply2 = generate(family, chat_prompt(family.tokenizer, turn2), "ar", max_tokens=8).text
    assert f">> {reply1}\n" in r.stdout and f">> {reply2}\n" in r.stdout
    assert first == after_reset == 0
    assert length == len(encode_prompt(family.tokenizer, chat_prompt(family.tokenizer, turn2)))
    # at least the first prompt (its last token may merge with the reply, so it re-runs)
    assert reused >= len(encode_prompt(family.tokenizer, chat_prompt(family.tokenizer, turn1))) - 1


def test_bench_small_run(tmp_path):
    out = tmp_path / "bench.json"
    r = run("bench", "--prompts", str(SUITE), "--strategies", "ar,ngram@paper,treegraft-fixed:1+3",
            "--per-category", "1", "--max-tokens", "16", "--warmup", "0", "--json", str(out))
    assert r.exit_code == 0, r.output
    report = json.loads(out.read_text())
    strategies = report["summary"]["strategies"]
    assert set(strategies) == {"ar", "ngram@paper", "treegraft-fixed:1,3"}
    for name, by_cat in strategies.items():     # every ratio is to ar's speed in the same run
        for cat, v in by_cat.items():
            assert v["speedup_vs_ar"] == pytest.approx(
                v["tokens_per_sec"] / strategies["ar"][cat]["tokens_per_sec"]), (name, cat)
    assert len(report["runs"]) == 4 * 3 and report["meta"]["max_tokens"] == 16


def test_bench_checkpoint_resumes_and_counts_forwards(tmp_path):
    """Each finished run goes to the checkpoint; a bench run again reuses the runs it holds
    (none is run twice: the output equals the first JSON's runs) and a line cut short by an
    interruption is run again. The summary has what transfers to another machine: tokens per
    target forward and drafter calls per token (mlx_lm_spec's forwards from its own stream)."""
    out, ckpt = tmp_path / "bench.json", tmp_path / "bench.jsonl"
    args = ["bench", "--prompts", str(SUITE), "--strategies", "ar,draft,mlx_lm_spec",
            "--spec-ks", "2", "--per-category", "1", "--max-tokens", "16", "--warmup", "0",
            "--json", str(out), "--checkpoint", str(ckpt)]
    assert run(*args).exit_code == 0
    first = json.loads(out.read_text())
    lines = ckpt.read_text().splitlines()
    assert len(lines) == len(first["runs"]) == 4 * 3
    ckpt.write_text("\n".join(lines[:-1]) + "\n" + lines[-1][:20])   # the last one cut short
    r = run(*args)
    assert r.exit_code == 0 and "11 runs reused" in r.output, r.output
    again = json.loads(out.read_text())
    assert [x["token_ids"] for x in again["runs"]] == [x["token_ids"] for x in first["runs"]]
    assert [x["tokens_per_sec"] for x in again["runs"][:11]] == \
        [x["tokens_per_sec"] for x in first["runs"][:11]]
    s = first["summary"]["strategies"]
    assert s["ar"]["all"]["tokens_per_forward"] == pytest.approx(1.0)
    assert s["draft"]["all"]["tokens_per_forward"] > 1.0
    assert s["draft"]["all"]["drafter_calls_per_token"] > 0
    assert s["ar"]["all"]["drafter_calls_per_token"] == 0
    assert s["mlx_lm_spec"]["all"]["tokens_per_forward"] > 1.0

def test_bench_concurrency_small_run(tmp_path):
    """`bench --concurrency`: every engine at every level, ratios to the serial server in the
    same run, every request's tokens checked against serial `ar` (greedy); a bad level list
    is refused before anything loads."""
    out = tmp_path / "conc.json"
    r = run("bench", "--prompts", str(SUITE), "--strategies", "ar,ngram", "--per-category",
            "1", "--max-tokens", "8", "--concurrency", "1,3", "--json", str(out))
    assert r.exit_code == 0, r.output
    report = json.loads(out.read_text())
    rows = {(x["engine"], x["strategy"], x["concurrency"]): x for x in report["summary"]}
    assert set(rows) == {(e, s, n) for e in ("serial", "batch") for s in ("ar", "ngram")
                         for n in (1, 3)} | {("mlx_lm_batch", "ar", n) for n in (1, 3)}
    prompts = len(report["served"]) // len(rows)
    assert all(x["requests"] == prompts for x in rows.values())
    assert report["meta"]["mlx_lm_batch_differs"] is not None
    closed_loops(report["served"], rows)
    assert "x1.00 vs serial" in r.output
    r = run("bench", "--prompts", str(SUITE), "--concurrency", "2,x", "--json", str(out))
    assert r.exit_code == 2 and "--concurrency" in r.output


def closed_loops(report_served: list[dict], keys) -> None:
    """The bench's load in each (engine, strategy, concurrency) run: as many requests sent
    at the start as the concurrency, each later one sent when an earlier one was answered,
    and never more in flight."""
    for key in keys:
        closed_loop(key[2], [x for x in report_served
                             if (x["engine"], x["strategy"], x["concurrency"]) == key])


def closed_loop(clients: int, served: list[dict]) -> None:
    by_sent = sorted(served, key=lambda x: x["sent"])
    assert len(by_sent) > clients
    assert all(x["sent"] <= x["first"] <= x["last"] for x in served)
    assert all(x["sent"] < min(y["first"] for y in served) for x in by_sent[:clients])
    assert all(x["sent"] >= min(y["last"] for y in served) for x in by_sent[clients:])
    for x in served:
        assert sum(y["sent"] <= x["sent"] < y["last"] for y in served) <= clients


def test_bench_concurrency_over_http(tmp_path):
    """`bench --concurrency --http`: three server processes (ours one at a time and batching,
    mlx_lm.server) answer every request of the closed loop, streamed; every request's text
    under greedy decoding equals the one-at-a-time server's `ar`; token counts are the
    servers' usage; `--http` without `--concurrency` is refused."""
    out = tmp_path / "http.json"
    r = run("bench", "--prompts", str(SUITE), "--strategies", "ar,ngram", "--per-category",
            "1", "--max-tokens", "6", "--concurrency", "1,2", "--http", "--json", str(out))
    assert r.exit_code == 0, r.output
    report = json.loads(out.read_text())
    rows = {(x["engine"], x["strategy"], x["concurrency"]): x for x in report["summary"]}
    assert set(rows) == {(e, s, n) for e in ("serial_http", "batch_http") for s in ("ar", "ngram")
                         for n in (1, 2)} | {("mlx_lm_server", "ar", n) for n in (1, 2)}
    served = report["served"]
    assert served and all(0 < x["count"] <= 6 and x["text"] for x in served)
    assert report["meta"]["over_http"]
    closed_loops(served, rows)
    assert report["meta"]["mlx_lm_server_differs"] == 0      # our compute dtype, same tokens
    ours = {}
    for x in served:
        if x["engine"] != "mlx_lm_server":
            ours.setdefault(x["prompt_id"], set()).add(x["text"])
    assert all(len(texts) == 1 for texts in ours.values())
    assert "x1.00 vs serial" in r.output
    r = run("bench", "--prompts", str(SUITE), "--http", "--json", str(out))
    assert r.exit_code == 2 and "--concurrency" in r.output


def test_convert_command(tmp_path):
    src = make_checkpoint(tmp_path / "src", "qwen3")
    r = run("convert", "--hf-path", str(src), "--mlx-path", str(tmp_path / "out"), "-q",
            "--q-bits", "8", "--q-group-size", "32")
    assert r.exit_code == 0, r.output
    assert json.loads((tmp_path / "out/treegraft.json").read_text())["quantization"]["bits"] == 8
    r = run("convert", "--hf-path", str(src), "--mlx-path", str(tmp_path / "plain"),
            "--q-bits", "8")                # a quantization setting without -q is a mistake
    assert r.exit_code == 2 and "--q-bits" in r.output and "-q" in r.output
    assert not (tmp_path / "plain").exists()
    r = run("convert", "--hf-path", str(src), "--mlx-path", str(tmp_path / "out"))
    assert r.exit_code == 1 and "already exists" in r.output


def linked_bundle(tmp_path: Path) -> Path:
    """A writable copy of the bundled family's manifest whose models link to the fixture."""
    src, dst = fixture_path(), tmp_path / "bundle"
    (dst / "drafters").mkdir(parents=True)
    (dst / "target").symlink_to(src / "target")
    for d in (src / "drafters").iterdir():
        (dst / "drafters" / d.name).symlink_to(d)
    manifest = json.loads((src / "treegraft.json").read_text())
    manifest.pop("scheduler", None)
    manifest.pop("scheduler_sampled", None)
    manifest.pop("acceptance", None)
    (dst / "treegraft.json").write_text(json.dumps(manifest))
    return dst


def test_calibrate_budget_calibrate_export_and_report(tmp_path):
    """The calibration commands end to end on a tiny budget: tree settings and the scheduler
    land in the bundle, the artifact exports to Core ML, bench JSON becomes a README block."""
    bundle = linked_bundle(tmp_path)
    prompts = tmp_path / "cal.jsonl"
    rows = [json.loads(x) for x in SUITE.read_text().splitlines()[:3]]
    prompts.write_text("\n".join(json.dumps(r) for r in rows) + "\n")
    r = run("calibrate-budget", "--model", str(bundle), "--prompts", str(prompts),
            "--budgets", "4,8", "--top-ks", "3", "--depths", "3", "--max-tokens", "8", "--write",
            "--json", str(tmp_path / "tree.json"))
    assert r.exit_code == 0, r.output
    best = json.loads((tmp_path / "tree.json").read_text())["best"]
    tree = json.loads((bundle / "treegraft.json").read_text())["tree"]
    assert best["budget"] in (4, 8) and {k: tree[k] for k in best} == best

    r = run("calibrate", "--model", str(bundle), "--prompts", str(prompts), "--work-dir",
            str(tmp_path / "work"), "--max-tokens", "8", "--b0", "2", "--write")
    assert r.exit_code == 0, r.output
    meta = json.loads((bundle / "scheduler" / "scheduler.json").read_text())
    assert meta["calibration_prompts"]["prompt_ids"] == [x["id"] for x in rows]
    budget = meta["budget"]
    assert budget["most"] == 2 and meta["b0"] == C.choose_b0(budget["by_calls"], 2)
    assert budget["decision_ms"] > 0 and len(budget["by_calls"]) == 2
    offset = meta["value_offset"]
    assert offset["offset"] in [m["offset"] for m in offset["measured"]] and len(offset["measured"]) >= 2
    assert json.loads((bundle / "treegraft.json").read_text())["scheduler"] == "scheduler"
    r = run("generate", "--model", str(bundle), "--prompt", "def f(x):\n", "--max-tokens", "12",
            "--json")
    assert r.exit_code == 0, r.output
    r2 = run("generate", "--model", str(bundle), "--prompt", "def f(x):\n", "--max-tokens", "12",
             "--json", "--strategy", "ar")
    assert json.loads(r.stdout)["token_ids"] == json.loads(r2.stdout)["token_ids"]

    r = run("export-coreml", "--model", str(bundle), "--out", str(tmp_path / "s.mlpackage"))
    assert r.exit_code == 0, r.output
    assert (tmp_path / "s.mlpackage").is_dir()
    r = run("export-coreml", "--model", str(bundle), "--sampled", "--out",
            str(tmp_path / "s2.mlpackage"))
    assert r.exit_code == 1 and "no sampling-calibrated scheduler" in r.output

    # Sampling gets its own artifact (labels: expected committed tokens under sampling).
    r = run("calibrate", "--model", str(bundle), "--prompts", str(prompts), "--work-dir",
            str(tmp_path / "work-sampled"), "--max-tokens", "8", "--b0", "2", "--temp", "0.7",
            "--top-p", "0.95", "--write")
    assert r.exit_code == 0, r.output
    manifest = json.loads((bundle / "treegraft.json").read_text())
    assert manifest["scheduler"] == "scheduler" and manifest["scheduler_sampled"] == "scheduler-sampled"
    sampled_meta = json.loads((bundle / "scheduler-sampled" / "scheduler.json").read_text())
    assert sampled_meta["sampling"]["temp"] == 0.7 and meta["sampling"]["temp"] == 0.0
    family = load(bundle)
    for temp, artifact in ((0.0, "scheduler"), (0.7, "scheduler-sampled")):
        decoder = make_decoder(Session(family), parse_strategy("treegraft-learned"),
                               SamplerSettings(temp), np.random.default_rng(0))
        assert decoder.policy.schedule.mlp is family.scheduler(temp > 0)[0]
        assert family.scheduler(temp > 0)[1]["sampling"]["temp"] == temp
    r = run("export-coreml", "--model", str(bundle), "--sampled", "--out",
            str(tmp_path / "s2.mlpackage"))
    assert r.exit_code == 0, r.output
    r = run("export-coreml", "--model", str(linked_bundle(tmp_path / "plain")), "--out",
            str(tmp_path / "t.mlpackage"))
    assert r.exit_code == 1 and "no calibrated scheduler" in r.output

    out = tmp_path / "bench.json"
    r = run("bench", "--model", str(bundle), "--prompts", str(prompts), "--strategies",
            "ar,treegraft", "--max-tokens", "8", "--warmup", "0", "--json", str(out))
    assert r.exit_code == 0, r.output
    readme = tmp_path / "README.md"
    readme.write_text("<!-- results:begin (generated by `treegraft report`; do not edit) -->\n"
                      "<!-- results:end -->\n")
    r = run("report", "--greedy", str(out), "--readme", str(readme))
    assert r.exit_code == 0, r.output
    assert "| tokens/s |" in readme.read_text() and "AR limit from memory bandwidth" in readme.read_text()


def test_calibrate_acceptance_writes_both_regimes_and_resumes(tmp_path):
    bundle = linked_bundle(tmp_path)
    prompts = tmp_path / "cal.jsonl"
    rows = [json.loads(x) for x in SUITE.read_text().splitlines()[:3]]
    prompts.write_text("\n".join(json.dumps(r) for r in rows) + "\n")
    work = tmp_path / "acc"
    args = ["calibrate-acceptance", "--model", str(bundle), "--prompts", str(prompts),
            "--work-dir", str(work), "--max-tokens", "12", "--write"]
    r = run(*args)
    assert r.exit_code == 0, r.output
    assert "held-out reliability" in r.output
    r = run(*args, "--temp", "0.7", "--top-p", "0.95")
    assert r.exit_code == 0, r.output
    stored = json.loads((bundle / "acceptance.json").read_text())
    assert {"greedy", "sampled"} <= set(stored)
    assert stored["sampled"]["sampling"]["temp"] == 0.7
    assert stored["greedy"]["calibration_prompts"]["prompt_ids"] == [x["id"] for x in rows]
    assert json.loads((bundle / "treegraft.json").read_text())["acceptance"] == "acceptance.json"
    lines = (work / "greedy.jsonl").read_text().splitlines()
    assert len(lines) == 3
    assert run(*args).exit_code == 0                      # resumed: nothing logged again
    assert (work / "greedy.jsonl").read_text().splitlines() == lines
    from treegraft_mlx.acceptance import AcceptanceModel

    assert AcceptanceModel.load(bundle / "acceptance.json").calibrated


NO_DRAFTER = ("--model", str(fixture_path() / "target"), "--draft-model", "none")
# What each generating command needs besides its options to run once and end.
ONCE = {"generate": dict(args=("--prompt", "def add(a, b):", "--max-tokens", "4")),
        "chat": dict(input="def add(a, b):\n/quit\n"), "serve": dict()}


def run_once(command: str, *args):
    """`command` with `args`, run once to its end (`serve` returns as soon as it would
    serve)."""
    return run(command, *args, *ONCE[command].get("args", ()), input=ONCE[command].get("input"))


def test_draft_model_none_runs_treegraft_as_the_ngram_tree():
    """`--draft-model none` and the default strategy: `generate` runs `treegraft` on the
    n-gram tree (no drafter call), gives `ar`'s tokens, and one stderr line says the n-gram
    drafter serves alone; `chat` answers two turns as `ar` does."""
    args = (*NO_DRAFTER, "--prompt", "def add(a, b):", "--max-tokens", "8", "--json")
    r = run("generate", *args)
    assert r.exit_code == 0, r.output
    assert [line for line in r.stderr.splitlines() if "n-gram" in line] == [
        "drafter: none (--draft-model none); the n-gram drafter alone serves"]
    out, ar = json.loads(r.stdout), json.loads(run("generate", *args, "--strategy", "ar").stdout)
    assert out["strategy"] == "treegraft" and out["drafter_calls"] == 0
    assert out["token_ids"] == ar["token_ids"] and len(ar["token_ids"]) == 8
    turns = "def add(a, b):\nand again\n/quit\n"
    r = run("chat", *NO_DRAFTER, "--max-tokens", "8", input=turns)
    assert r.exit_code == 0 and "error" not in r.output, r.output
    assert r.stdout == run("chat", *NO_DRAFTER, "--max-tokens", "8", "--strategy", "ar",
                           input=turns).stdout
    assert r.stdout.count(">> ") == 3                 # two replies, then /quit


@pytest.fixture
def loads(monkeypatch, tmp_path) -> dict[str, list]:
    """The weights loaded (family.load_model) and the step costs measured while the test
    runs (scripted costs stand in for the measurement); `serve` returns at once."""
    seen = {"loaded": [], "measured": []}
    real = F.load_model
    monkeypatch.setattr(F, "load_model",
                        lambda *a, **k: seen["loaded"].append(a[0]) or real(*a, **k))
    monkeypatch.setattr(probe, "measure_step_costs",
                        lambda *a: seen["measured"].append(a) or scripted_step_costs())
    monkeypatch.setattr(server_mod, "make_server", lambda *a: IdleServer())
    monkeypatch.setenv("TREEGRAFT_CACHE", str(tmp_path))
    return seen


@pytest.mark.parametrize("command", ["generate", "chat", "serve"])
def test_a_strategy_that_needs_a_strong_drafter_is_refused_before_loading(command, loads):
    """`draft` and `chain:k` with `--draft-model none`, on a plain target, on a bundle that
    names its own drafter, and on the default model (that bundle): refused with exit 1, no
    weights loaded and nothing measured."""
    runs = (NO_DRAFTER, ("--model", str(fixture_path()), "--draft-model", "none"),
            ("--draft-model", "none"))
    for args in runs:
        for strategy in ("draft", "chain:2"):
            r = run_once(command, *args, "--strategy", strategy)
            assert r.exit_code == 1, (args, r.output)
            assert f"strategy {strategy!r} needs a strong drafter" in r.output, args
            assert loads == {"loaded": [], "measured": []}, (args, strategy)


def test_draft_model_none_leaves_out_a_bundles_own_drafter(loads):
    """On a bundle (the default model, or named), `--draft-model none` loads the target
    alone: the bundle's drafter is not loaded and `treegraft` makes no drafter call."""
    for args in (("--draft-model", "none"), ("--model", str(fixture_path()), "--draft-model",
                                             "none")):
        loads["loaded"].clear()
        r = run("generate", *args, "--prompt", "def add(a, b):", "--max-tokens", "8", "--json")
        assert r.exit_code == 0, (args, r.output)
        assert [Path(p).name for p in loads["loaded"]] == ["target"], args
        assert json.loads(r.stdout)["drafter_calls"] == 0, args


@pytest.mark.parametrize("command", ["generate", "serve"])
def test_a_strategy_the_loaded_family_cannot_run_is_refused_before_measuring(command, loads):
    """`mtp` on a target without an MTP head: exit 1 with the reason, and no step cost
    measured (what `--strategy` needs is known once the weights are read)."""
    r = run_once(command, "--strategy", "mtp")
    assert r.exit_code == 1, r.output
    assert "needs the target's multi-token-prediction head" in r.output
    assert loads["loaded"] and loads["measured"] == []


@pytest.mark.parametrize("command", ["generate", "chat", "serve"])
def test_the_bundled_test_model_says_what_it_is(command, tmp_path, monkeypatch):
    """On the bundled tg-tiny family (by default, or named), one stderr line says it is a
    small test model and gives the command that runs a real one; another model gets none."""
    monkeypatch.setattr(server_mod, "make_server", lambda *a: IdleServer())
    for args in ((), ("--model", str(fixture_path()))):
        r = run_once(command, *args)
        assert r.exit_code == 0, r.output
        said = [line for line in r.stderr.splitlines() if "test model" in line]
        assert len(said) == 1 and "tg-tiny" in said[0], r.stderr
        assert f"treegraft {command} --model mlx-community/Qwen3-8B-4bit" in said[0]
    other = make_checkpoint(tmp_path / "llama", "llama")
    r = run_once(command, "--model", str(other), "--draft-model", "none")
    assert r.exit_code == 0, r.output
    assert "test model" not in r.stderr
