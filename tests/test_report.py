"""Results: the README block and the plot are generated from bench JSON, numbers intact."""

import pytest

from treegraft_mlx import fixture_path, load
from treegraft_mlx import report as R
from treegraft_mlx.bench import Run, summarize


def fake_report(ar_tps: float = 40.0, ngram_tps: float = 50.0) -> dict:
    runs = []
    for cat, toks in (("copy", [1, 2, 3, 4, 1, 2, 3, 4]), ("function_completion", [5, 6, 7, 8])):
        # 101 tokens: the prefill's first one, then 100 from the steps
        runs.append(Run(f"{cat}-0", cat, "ar", 0, 101, 100, 1.0, ar_tps, toks))
        runs.append(Run(f"{cat}-0", cat, "ngram", 0, 101, 40, 2.5, ngram_tps, toks))
    meta = {"date": "2026-11-29", "platform": "Linux", "device": "cpu", "blas": "openblas",
            "dtype": "mlx.core.float32", "mlx": "0.32", "tree": {"budget": 16}, "temp": 0.0,
            "top_p": 1.0, "command": "treegraft bench --prompts p.jsonl",
            "ar_bound": {"bandwidth_gbs": 8.0, "weight_bytes": 80_000_000, "tokens_per_sec": 100.0}}
    return {"meta": meta, "summary": summarize(runs), "runs": []}


def test_results_section_carries_the_measured_numbers():
    text = R.results_section({"greedy": fake_report(40.0, 50.0)})
    assert "| tokens/s | 40.0 | 50.0 |" in text
    assert "| vs ar | 1.00x | 1.25x |" in text
    assert "| tokens per target forward | 1.00 | 2.50 |" in text
    assert "copy (greedy loop share 20%)" in text         # 1 of 5 four-grams repeats
    assert "100.0 tokens/s; measured ar 40.0" in text
    assert "treegraft bench --prompts p.jsonl" in text and "openblas" in text


def test_decision_share_row_only_for_strategies_that_decide():
    runs = []
    for cat, t_schedule in (("copy", 0.02), ("function_completion", 0.04)):
        runs.append(Run(f"{cat}-0", cat, "ar", 0, 100, 100, 1.0, 40.0, [1, 2]))
        runs.append(Run(f"{cat}-0", cat, "treegraft", 0, 100, 50, 2.0, 50.0, [1, 2],
                        t_schedule=t_schedule))        # 2 s per category
    report = fake_report()
    report["summary"] = summarize(runs)
    text = R.strategy_table(report, "greedy")
    assert "| scheduler decisions, share of time (categories min-max) | - | 1.5% (1.0%-2.0%) |" in text
    assert "scheduler decisions" not in R.strategy_table(fake_report(), "greedy")


def test_steps_inside_loops_and_outside_are_split_by_their_first_token():
    from treegraft_mlx.bench import loop_split

    tokens = [1, 2, 3, 4, 5, 1, 2, 3, 4, 5, 9]       # 4-grams repeat at positions 8 and 9
    assert loop_split(tokens, [1] * 11) == (2, 2)
    assert loop_split(tokens, [4, 1, 4, 2]) == (1, 2)  # the step at 9 commits 9 and 10
    assert loop_split(tokens, [5, 5, 3]) == (0, 0)     # steps start at 0, 5, 10: none repeats
    assert loop_split(tokens, [8, 6]) == (1, 3)        # the last block is cut at max_tokens
    # Each run's first token is the prefill's: 101 tokens, 100 of them from the steps.
    runs = [Run("a", "copy", "ar", 0, 101, 100, 1.0, 40.0, [1]),
            Run("a", "copy", "ngram", 0, 101, 40, 2.5, 50.0, [1], loop_steps=10, loop_tokens=40)]
    report = fake_report()
    report["summary"] = summarize(runs)
    ngram = report["summary"]["strategies"]["ngram"]["all"]
    assert ngram["mean_accepted_loop"] == 4.0 and ngram["mean_accepted_other"] == 2.0
    assert "| - / 1.00 (0%) | 4.00 / 2.00 (25%) |" in R.strategy_table(report, "greedy")


def test_readme_block_is_replaced_and_markers_are_required(tmp_path):
    readme = tmp_path / "README.md"
    readme.write_text(f"intro\n{R.RESULTS_BEGIN}\nold numbers\n{R.RESULTS_END}\noutro\n")
    R.update_readme(readme, "new numbers")
    text = readme.read_text()
    assert "old numbers" not in text and "new numbers" in text
    assert text.startswith("intro\n") and text.endswith("outro\n")
    readme.write_text("no markers here")
    with pytest.raises(ValueError, match="no generated results block"):
        R.update_readme(readme, "x")


def test_plot_writes_a_png(tmp_path):
    pytest.importorskip("matplotlib")
    out = tmp_path / "bench.png"
    R.plot({"greedy": fake_report(), "sampled": fake_report(30.0, 20.0)}, out)
    assert out.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"


def test_ar_bound_is_bandwidth_over_weight_bytes():
    target = load(fixture_path() / "target").target
    bound = R.ar_bound(target, bandwidth_gbs=10.0)
    assert bound["tokens_per_sec"] == pytest.approx(10e9 / bound["weight_bytes"])
    assert 75e6 < bound["weight_bytes"] < 90e6            # 20.45M fp32 parameters


def test_mlx_lm_spec_one_k_for_all_prompts_and_the_per_prompt_oracle():
    runs = [Run("a", "copy", "ar", 0, 100, 100, 1.0, 40.0, [1], rows=100),
            Run("b", "copy", "ar", 0, 100, 100, 1.0, 40.0, [1], rows=100),
            Run("a", "copy", "mlx_lm_spec", 0, 100, 0, 0.0, 60.0, [1],
                per_k={1: [100, 50.0], 2: [100, 60.0]}),
            Run("b", "copy", "mlx_lm_spec", 0, 100, 0, 0.0, 80.0, [1],
                per_k={1: [100, 80.0], 2: [100, 40.0]}),
            Run("a", "copy", "ngram", 0, 100, 40, 2.5, 50.0, [1], rows=160)]
    s = summarize(runs)["strategies"]
    # k = 1 for both: 200 tokens in 2 + 1.25 s; the oracle takes k = 2 for a, k = 1 for b.
    assert s["mlx_lm_spec"]["all"]["tokens_per_sec"] == pytest.approx(200 / 3.25)
    assert s["mlx_lm_spec"]["all"]["num_draft_tokens"] == 1
    assert s["mlx_lm_spec_oracle"]["all"]["tokens_per_sec"] == pytest.approx(200 / (100 / 60 + 1.25))
    assert s["ngram"]["all"]["rows_per_step"] == 4.0 and s["ar"]["all"]["rows_per_step"] == 1.0
    text = R.strategy_table({"summary": summarize(runs)}, "greedy")
    assert "| rows verified per step | 1.00 | 4.00 | - | - |" in text


def test_waits_per_token_and_per_forward_beside_mlx_lm_s():
    """Host waits and bytes read back: per token for every strategy, per target forward
    where the forwards are known (the prefill's included); mlx_lm's per token only."""
    runs = [Run("a", "copy", "ar", 0, 100, 99, 1.0, 40.0, [1], waits=100, read_bytes=400),
            Run("a", "copy", "ngram", 0, 100, 39, 2.5, 50.0, [1], waits=40, read_bytes=1200),
            Run("a", "copy", "mlx_lm", 0, 100, 0, 0.0, 40.0, [1], waits=101, read_bytes=404)]
    s = summarize(runs)["strategies"]
    assert s["ngram"]["all"]["waits_per_token"] == pytest.approx(0.4)
    assert s["ngram"]["all"]["waits_per_forward"] == pytest.approx(1.0)
    assert s["mlx_lm"]["all"]["waits_per_forward"] is None
    text = R.strategy_table({"summary": summarize(runs)}, "greedy")
    assert "| host waits per token (per target forward) / bytes read per token | " \
           "1.00 (1.00) / 4 | 0.40 (1.00) / 12 | 1.01 / 4 |" in text


def test_reliability_table_from_the_bundled_acceptance_file():
    import json

    acceptance = json.loads((fixture_path() / "acceptance.json").read_text())
    text = R.reliability_section(acceptance)
    g = acceptance["greedy"]["heldout"]["reliability"][0]
    assert f"| [0.0, 0.1) | {g['predicted']:.3f} / {g['observed']:.3f} ({g['nodes']})" in text
    assert "sampled: predicted / observed" in text
    assert f"{acceptance['sampled']['rows']} nodes" in text
    section = R.results_section({"greedy": fake_report()}, acceptance)
    assert section.endswith(text)
