"""The `treegraft` command line: one click group; each capability adds a subcommand."""

from __future__ import annotations

import json
import sys
from typing import Optional

import click

from .fixtures import fixture_path
from .loading import LoadError


@click.group()
@click.version_option(package_name="treegraft-mlx")
def main() -> None:
    """TreeGraft speculative decoding on MLX."""


@main.command()
@click.option("--model", default=None, help="Bundle directory, target model path or cached "
              "repo id (default: the bundled tg-tiny family).")
@click.option("--draft-model", "draft_models", multiple=True,
              help="Drafter model path (repeatable; the last one is the strong drafter).")
@click.option("--strategy", default="treegraft", show_default=True,
              help="ar, chain[:k], ngram, draft, treegraft or treegraft-fixed:<layers>.")
@click.option("--prompt", default=None, help="Prompt text; '-' or absent reads stdin.")
@click.option("--max-tokens", default=256, show_default=True, type=click.IntRange(1))
@click.option("--temp", default=0.0, show_default=True, type=click.FloatRange(0))
@click.option("--top-p", default=1.0, show_default=True, type=click.FloatRange(0, 1, min_open=True))
@click.option("--top-k", default=0, show_default=True, type=click.IntRange(0))
@click.option("--min-p", default=0.0, show_default=True, type=click.FloatRange(0, 1, max_open=True))
@click.option("--seed", default=None, type=int)
@click.option("--chat-template/--no-chat-template", default=True, show_default=True,
              help="Apply the tokenizer's chat template when it has one.")
@click.option("--json", "as_json", is_flag=True, help="Print one JSON object instead of text.")
@click.option("--verbose", is_flag=True, help="Print a statistics line to stderr.")
def generate(model: Optional[str], draft_models: tuple[str, ...], strategy: str, prompt: Optional[str], max_tokens: int, temp: float,
             top_p: float, top_k: int, min_p: float, seed: Optional[int], chat_template: bool,
             as_json: bool, verbose: bool) -> None:
    """Generate text from a prompt, streamed to stdout."""
    from .engine import stream_generate
    from .family import load

    if prompt is None or prompt == "-":
        prompt = sys.stdin.read()
    try:
        family = load(model or fixture_path(), drafters=draft_models)
    except (LoadError, MemoryError) as e:
        raise click.ClickException(str(e)) from None
    tokenizer = family.tokenizer
    if chat_template and getattr(tokenizer, "chat_template", None):
        prompt = tokenizer.apply_chat_template([{"role": "user", "content": prompt}],
                                               tokenize=False, add_generation_prompt=True)
    text, ids, last, decoders = "", [], None, []
    try:
        for r in stream_generate(family, prompt, strategy, max_tokens=max_tokens, temp=temp,
                                 top_p=top_p, top_k=top_k, min_p=min_p, seed=seed,
                                 decoder_out=decoders):
            text += r.text
            ids += r.tokens
            last = r
            if not as_json:
                click.echo(r.text, nl=False)
    except ValueError as e:
        raise click.ClickException(str(e)) from None
    if as_json:
        click.echo(json.dumps({
            "text": text, "token_ids": ids, "prompt_tokens": last.prompt_tokens if last else 0,
            "generation_tokens": len(ids), "steps": last.steps if last else 0,
            "mean_accepted": (len(ids) / last.steps) if last and last.steps else 0.0,
            "tokens_per_sec": last.generation_tps if last else 0.0, "strategy": strategy,
            "drafter_calls": decoders[0].drafter_calls if decoders else 0}))
    else:
        click.echo()
    if verbose and last:
        click.echo(f"prompt: {last.prompt_tokens} tokens, {last.prompt_tps:.1f} tok/s | "
                   f"generation: {last.generation_tokens} tokens, {last.generation_tps:.1f} tok/s, "
                   f"{last.steps} steps", err=True)


if __name__ == "__main__":
    main()


@main.command()
@click.option("--prompts", "prompts_file", type=click.Path(exists=True, dir_okay=False),
              required=True, help="JSONL file of {id, category, prompt}.")
@click.option("--strategies", default="ar,mlx_lm,mlx_lm_spec,chain,ngram,draft,treegraft",
              show_default=True, help="Comma-separated; treegraft-fixed:<layers> uses '+' "
              "between layers here (treegraft-fixed:1+3).")
@click.option("--model", default=None, help="Bundle or target (default: bundled tg-tiny).")
@click.option("--draft-model", "draft_models", multiple=True)
@click.option("--max-tokens", default=128, show_default=True, type=click.IntRange(1))
@click.option("--repeat", default=1, show_default=True, type=click.IntRange(1))
@click.option("--warmup", default=1, show_default=True, type=click.IntRange(0))
@click.option("--per-category", default=0, type=click.IntRange(0),
              help="Use only the first N prompts of each category (0 = all).")
@click.option("--temp", default=0.0, show_default=True, type=click.FloatRange(0))
@click.option("--top-p", default=1.0, show_default=True, type=click.FloatRange(0, 1, min_open=True))
@click.option("--seed", default=0, show_default=True, type=int)
@click.option("--budget", default=None, type=click.IntRange(1), help="Override the tree budget.")
@click.option("--json", "json_out", type=click.Path(dir_okay=False), required=True)
def bench(prompts_file, strategies, model, draft_models, max_tokens, repeat, warmup,
          per_category, temp, top_p, seed, budget, json_out) -> None:
    """Benchmark strategies side by side (one process, alternating order)."""
    import dataclasses
    from pathlib import Path

    from . import bench as B
    from .family import load

    names = [s.strip().replace("+", ",") for s in strategies.split(",") if s.strip()]
    if "ar" not in names:
        names.insert(0, "ar")
    try:
        family = load(model or fixture_path(), drafters=draft_models)
    except (LoadError, MemoryError) as e:
        raise click.ClickException(str(e)) from None
    prompts = B.read_prompts(Path(prompts_file))
    if per_category:
        prompts = B.first_per_category(prompts, per_category)
    tree = dataclasses.replace(family.tree, budget=budget) if budget else None
    with click.progressbar(length=len(prompts) * len(names) * repeat, label="bench",
                           file=sys.stderr) as bar:
        runs = B.run_bench(family, prompts, names, max_tokens, repeat, warmup, temp, top_p,
                           seed, tree, progress=bar.update)
    meta = {**B.machine_info(), "command": " ".join(sys.argv), "temp": temp, "top_p": top_p,
            "max_tokens": max_tokens, "tree": dataclasses.asdict(tree or family.tree),
            "dtype": str(family.target.model.norm.weight.dtype)}
    B.write_report(Path(json_out), runs, meta)
    summary = B.summarize(runs)
    for s, cats in summary["strategies"].items():
        a = cats["all"]
        acc = f"{a['mean_accepted']:.2f}" if a["mean_accepted"] else "-"
        click.echo(f"{s:>24}  {a['tokens_per_sec']:8.1f} tok/s  x{a['speedup_vs_ar']:.2f} vs ar  "
                   f"accepted {acc}")
    mismatches = B.check_greedy(runs) if temp == 0 else []
    if mismatches:
        for m in mismatches:
            click.echo(f"MISMATCH: {m}", err=True)
        raise click.ClickException(f"{len(mismatches)} greedy outputs differ from ar")


@main.command()
@click.option("--hf-path", required=True, help="Target: local path or repo id in the HF cache.")
@click.option("--draft-hf-path", "draft_paths", multiple=True, help="Drafter (repeatable).")
@click.option("--mlx-path", required=True, help="Output bundle directory (must not exist).")
@click.option("-q", "--quantize", is_flag=True, help="Quantize linear and embedding weights.")
@click.option("--q-bits", default=4, show_default=True, type=click.Choice(["2", "3", "4", "6", "8"]))
@click.option("--q-group-size", default=64, show_default=True,
              type=click.Choice(["32", "64", "128"]))
@click.option("--quant-recipe", default="uniform", show_default=True,
              type=click.Choice(["uniform", "mixed-8-embed"]),
              help="mixed-8-embed keeps embeddings and the LM head at 8 bits.")
@click.option("--dtype", default=None, type=click.Choice(["float16", "bfloat16", "float32"]),
              help="dtype of unquantized tensors (default: as in the checkpoint).")
@click.option("--context", default=4096, show_default=True, type=click.IntRange(1),
              help="Context length for the memory estimate.")
def convert(hf_path, draft_paths, mlx_path, quantize, q_bits, q_group_size, quant_recipe, dtype,
            context) -> None:
    """Convert a target and its drafters into one MLX TreeGraft bundle."""
    from .convert import ConvertError, QuantSpec, convert_family

    def bar(role: str, n: int):
        return click.progressbar(length=n, label=f"converting {role}", file=sys.stderr)

    try:
        quant = QuantSpec(int(q_bits), int(q_group_size), quant_recipe) if quantize else None
        convert_family(hf_path, draft_paths, mlx_path, quant, dtype, context,
                       progress_factory=bar, log=lambda m: click.echo(m, err=True))
    except ConvertError as e:
        raise click.ClickException(str(e)) from None
