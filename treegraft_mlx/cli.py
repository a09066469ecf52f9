"""The `treegraft` command line: one click group; each capability adds a subcommand."""

from __future__ import annotations

import json
import sys
from typing import Optional

import click

from .fixtures import family_manifest, fixture_path
from .loading import LoadError


def _default_target() -> str:
    path = fixture_path()
    return str(path / family_manifest(path)["target"])


@click.group()
@click.version_option(package_name="treegraft-mlx")
def main() -> None:
    """TreeGraft speculative decoding on MLX."""


@main.command()
@click.option("--model", default=None, help="Target model path or cached repo id "
              "(default: the bundled tg-tiny fixture).")
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
def generate(model: Optional[str], prompt: Optional[str], max_tokens: int, temp: float,
             top_p: float, top_k: int, min_p: float, seed: Optional[int], chat_template: bool,
             as_json: bool, verbose: bool) -> None:
    """Generate text from a prompt, streamed to stdout."""
    from .generate import stream_generate_ar
    from .loading import load_model

    if prompt is None or prompt == "-":
        prompt = sys.stdin.read()
    try:
        target, tokenizer = load_model(model or _default_target())
    except (LoadError, MemoryError) as e:
        raise click.ClickException(str(e)) from None
    if chat_template and getattr(tokenizer, "chat_template", None):
        prompt = tokenizer.apply_chat_template([{"role": "user", "content": prompt}],
                                               tokenize=False, add_generation_prompt=True)
    text, ids, last = "", [], None
    try:
        for r in stream_generate_ar(target, tokenizer, prompt, max_tokens=max_tokens, temp=temp,
                                    top_p=top_p, top_k=top_k, min_p=min_p, seed=seed):
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
            "tokens_per_sec": last.generation_tps if last else 0.0, "strategy": "ar",
            "drafter_calls": 0}))
    else:
        click.echo()
    if verbose and last:
        click.echo(f"prompt: {last.prompt_tokens} tokens, {last.prompt_tps:.1f} tok/s | "
                   f"generation: {last.generation_tokens} tokens, {last.generation_tps:.1f} tok/s, "
                   f"{last.steps} steps", err=True)


if __name__ == "__main__":
    main()
