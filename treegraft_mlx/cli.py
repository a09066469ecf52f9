"""The `treegraft` command line: one click group; each capability adds a subcommand."""

from __future__ import annotations

import functools
import json
import sys
from dataclasses import dataclass
from typing import Optional

import click

from .fixtures import fixture_path
from .loading import LoadError


@click.group()
@click.version_option(package_name="treegraft-mlx")
def main() -> None:
    """TreeGraft speculative decoding on MLX."""


@dataclass(frozen=True)
class ModelSource:
    """--model and what travels with it: which models to load, and how."""

    model: Optional[str] = None          # None: the bundled tg-tiny family
    revision: Optional[str] = None
    draft_models: tuple[str, ...] = ()
    q_bits: Optional[int] = None
    autotune: bool = True
    pipeline: bool = False


def family_options(f):
    """--model, --revision, --draft-model, --q-bits, --autotune, --pipeline (gathered into one
    `source: ModelSource`) and --strategy, shared by the commands that generate."""
    @functools.wraps(f)
    def command(model, revision, draft_models, q_bits, autotune, pipeline, **kwargs):
        source = ModelSource(model, revision, draft_models, int(q_bits) if q_bits else None,
                             autotune, pipeline)
        if not pipeline:
            return f(source=source, **kwargs)
        try:
            f(source=source, **kwargs)
        except click.ClickException as e:
            e.show()
            leave_the_ring(e.exit_code)
        leave_the_ring(0)

    command = click.option("--strategy", default="treegraft", show_default=True,
                           help="ar, chain[:k], ngram, draft, treegraft or "
                           "treegraft-fixed:<layers>.")(command)
    command = click.option("--pipeline", is_flag=True,
                           help="Split the target's layers over the processes mlx.launch "
                           "started (--hosts / --hostfile); rank 0 drafts and prints.")(command)
    command = click.option("--autotune/--no-autotune", default=True, show_default=True,
                           help="Measure this device's step costs on the first run of a model "
                           "pair (cached); without, steps verify the bundle's fixed tree.")(command)
    command = click.option("--q-bits", default=None, type=click.Choice(["2", "3", "4", "6", "8"]),
                           help="Quantize a plain checkpoint once (cached) and run that "
                           "(default: as given).")(command)
    command = click.option("--revision", default=None,
                           help="Hub revision (branch, tag or commit) of --model.")(command)
    return model_options(command)


def leave_the_ring(code: int) -> None:
    """End a --pipeline rank's process once its command is done: the exit handlers run (rank
    0's tells the other ranks to stop), the streams are flushed, and the process ends without
    the interpreter's and the C++ runtime's teardown, where MLX's ring backend can abort
    ("terminate called without an active exception": a clean Ctrl-C of `serve --pipeline`
    died so about once in ten)."""
    import atexit
    import os

    atexit._run_exitfuncs()
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(code)


def model_options(f):
    """--model and --draft-model, as `mlx_lm` spells them."""
    f = click.option("--draft-model", "draft_models", multiple=True,
                     help="Drafter: path or Hub repo (repeatable; the last is the strong "
                     "drafter). Absent: one is chosen for a target; 'none': the n-gram drafter "
                     "alone.")(f)
    return click.option("--model", default=None, help="Bundle directory, model directory, Hub "
                        "repo id (downloaded on first use), or a GGUF: a file or a name LM "
                        "Studio or Ollama shows, converted once (default: the bundled tg-tiny "
                        "family).")(f)


def sampling_options(f):
    for opt in reversed([
        click.option("--max-tokens", default=256, show_default=True, type=click.IntRange(1)),
        click.option("--temp", default=0.0, show_default=True, type=click.FloatRange(0)),
        click.option("--top-p", default=1.0, show_default=True,
                     type=click.FloatRange(0, 1, min_open=True)),
        click.option("--top-k", default=0, show_default=True, type=click.IntRange(0)),
        click.option("--min-p", default=0.0, show_default=True,
                     type=click.FloatRange(0, 1, max_open=True)),
        click.option("--seed", default=None, type=int),
    ]):
        f = opt(f)
    return f


def load_family(source: ModelSource, strategy: Optional[str] = None):
    """The family to generate with; None on a pipeline rank other than 0, once rank 0 is done
    (it served its layers meanwhile). A `strategy` given is checked against the drafters the
    run will have before anything loads (refuse_without_drafter), and against the loaded
    family (an MTP head, a drafter that can rewind) before any cost is measured."""
    from .convert import ConvertError
    from .engine import load, warm_up
    from .strategy import parse_strategy, runs_on
    from .family import NO_DRAFTER, drafters_off
    from .pairing import choose_models
    from .pipeline import PipelineError

    try:
        if source.model is None:
            target, drafters = fixture_path(), source.draft_models
        else:
            models = choose_models(source.model, source.draft_models, source.revision,
                                   source.q_bits, log=lambda line: click.echo(line, err=True))
            target, drafters = models.target, models.drafters
        if drafters_off(source.draft_models):       # a bundle's own drafters left out too
            drafters = NO_DRAFTER
        if strategy is not None:
            refuse_without_drafter(strategy, target, drafters)
        family = load(target, drafters=drafters, autotune=source.autotune, warmup=False,
                      pipeline=source.pipeline)
    except (LoadError, MemoryError, PipelineError, ConvertError) as e:
        raise click.ClickException(str(e)) from None
    if family is not None and strategy is not None:
        try:
            runs_on(parse_strategy(strategy), family)
        except ValueError as e:
            raise click.ClickException(str(e)) from None
    if family is not None and source.autotune:
        warm_up(family)
    return family


def refuse_without_drafter(strategy: str, target, drafters) -> None:
    """A strategy that needs a strong drafter, on a run that has none (`--draft-model none`,
    or none fits the target), is refused before any weights load or any cost is measured:
    only the configs have been read. `treegraft` runs there as the n-gram tree."""
    from .strategy import for_family, parse_strategy
    from .family import bundle_drafters, drafters_off

    if not drafters_off(drafters) and (drafters or bundle_drafters(target)):
        return
    try:
        needs = for_family(parse_strategy(strategy), has_strong=False, has_mtp=False)
    except ValueError as e:
        raise click.ClickException(str(e)) from None
    if needs.needs_strong:
        raise click.ClickException(
            f"strategy {strategy!r} needs a strong drafter and this run has none: name one "
            "with --draft-model, or run treegraft or ngram")


def say_if_test_model(family, command: str) -> Optional[str]:
    """One stderr line when the family is a bundled test model (what it writes is noise):
    which, and the command that runs a real model. Returns the line (serve's page shows it)."""
    from .fixtures import bundled_model_note

    note = bundled_model_note(family.model_paths.get("target"), command)
    if note:
        click.echo(note, err=True)
    return note


@main.command()
@family_options
@click.option("--prompt", default=None, help="Prompt text; '-' or absent reads stdin.")
@sampling_options
@click.option("--stop", multiple=True,
              help="Stop before this string (repeatable; the earliest in the text wins).")
@click.option("--chat-template/--no-chat-template", default=True, show_default=True,
              help="Apply the tokenizer's chat template when it has one.")
@click.option("--json", "as_json", is_flag=True, help="Print one JSON object instead of text.")
@click.option("--verbose", is_flag=True, help="Print a statistics line to stderr.")
@click.option("--color", is_flag=True, help="Colour tokens that came from accepted drafts.")
@click.option("--trace", is_flag=True,
              help="Print every step's decisions to stderr (also: TREEGRAFT_TRACE=1).")
def generate(source, strategy, prompt, max_tokens, temp,
             top_p, top_k, min_p, seed, stop, chat_template, as_json, verbose, color,
             trace) -> None:
    """Generate text from a prompt, streamed to stdout."""
    from .engine import stream_generate
    from .generate import chat_prompt, summary
    from .pipeline import PipelineError
    from .sampling import SamplerSettings

    family = load_family(source, strategy)
    if family is None:
        return
    say_if_test_model(family, "generate")
    if prompt is None or prompt == "-":
        prompt = sys.stdin.read()
    if chat_template and getattr(family.tokenizer, "chat_template", None):
        prompt = chat_prompt(family.tokenizer, [{"role": "user", "content": prompt}])
    text, ids, last = "", [], None
    try:
        for r in stream_generate(family, prompt, strategy, max_tokens=max_tokens,
                                 settings=SamplerSettings(temp, top_p, top_k, min_p), seed=seed,
                                 stop=stop, trace=trace or None):
            text += r.text
            ids += r.tokens
            last = r
            if not as_json:
                click.echo(_colored(family.tokenizer, r) if color else r.text, nl=False)
    except (ValueError, PipelineError) as e:
        raise click.ClickException(str(e)) from None
    if as_json:
        click.echo(json.dumps({"text": text, "token_ids": ids, **summary(last, strategy)}))
    else:
        click.echo()
    if verbose and last:
        click.echo(f"prompt: {last.prompt_tokens} tokens, {last.prompt_tps:.1f} tok/s | "
                   f"generation: {last.generation_tokens} tokens, {last.generation_tps:.1f} "
                   f"tok/s, {last.steps} steps, {last.mean_accepted:.2f} tokens/step", err=True)


def _colored(tokenizer, r) -> str:
    """A step's first token is the target's own; the rest of its block were accepted drafts."""
    head = tokenizer.decode(r.tokens[:1]) if r.tokens else ""
    if len(r.tokens) < 2 or not r.text.startswith(head):
        return r.text
    return head + click.style(r.text[len(head):], fg="cyan")


@main.command()
@family_options
@sampling_options
def chat(source, strategy, max_tokens, temp, top_p, top_k,
         min_p, seed) -> None:
    """Interactive multi-turn chat, streamed; caches are reused across turns.

    Commands: /reset forgets the conversation, /stats shows the last turn's statistics,
    /quit (or Ctrl-D) leaves. Ctrl-C stops a reply; at the prompt it leaves.
    """
    from .engine import stream_generate
    from .generate import chat_prompt
    from .sampling import SamplerSettings
    from .session import Session

    family = load_family(source, strategy)
    if family is None:
        return
    say_if_test_model(family, "chat")
    session, messages, stats = Session(family), [], None
    settings = SamplerSettings(temp, top_p, top_k, min_p)
    click.echo("treegraft chat: /reset, /stats, /quit", err=True)
    while True:
        try:
            line = input(">> ")
        except (EOFError, KeyboardInterrupt):
            click.echo()
            return
        if line.strip() == "/quit":
            return
        if line.strip() == "/reset":
            session, messages = Session(family), []
            click.echo("(conversation reset)", err=True)
            continue
        if line.strip() == "/stats":
            click.echo(stats or "(no reply yet)", err=True)
            continue
        messages.append({"role": "user", "content": line})
        reply, last = "", None
        try:
            for r in stream_generate(family, chat_prompt(family.tokenizer, messages), strategy,
                                     max_tokens=max_tokens, settings=settings, seed=seed,
                                     session=session):
                reply += r.text
                last = r
                click.echo(r.text, nl=False)
        except KeyboardInterrupt:
            click.echo("\n(stopped)", err=True)
        except ValueError as e:
            click.echo(f"\nerror: {e}", err=True)
            messages.pop()
            continue
        click.echo()
        messages.append({"role": "assistant", "content": reply})
        if last:
            stats = (f"{last.generation_tokens} tokens, {last.generation_tps:.1f} tok/s, "
                     f"{last.steps} steps, {last.mean_accepted:.2f} "
                     f"tokens/step, {session.cache.offset} tokens cached")


@main.command()
@family_options
@click.option("--host", default="127.0.0.1", show_default=True)
@click.option("--port", default=8080, show_default=True, type=click.IntRange(0, 65535))
@click.option("--max-tokens-limit", default=2048, show_default=True, type=click.IntRange(1))
@click.option("--max-body-bytes", default=1 << 20, show_default=True, type=click.IntRange(1))
@click.option("--max-queue", default=16, show_default=True, type=click.IntRange(0),
              help="Requests that may wait for the model; more are refused with 503.")
@click.option("--max-batch", default=4, show_default=True, type=click.IntRange(1),
              help="Requests decoded together, one forward a step for all of them (1: one "
              "at a time). A pipelined target decodes one at a time.")
@click.option("--timeout", default=60.0, show_default=True, type=click.FloatRange(0, min_open=True),
              help="Seconds a connection may stall (sending its request, or reading the "
              "reply) before it is dropped.")
@click.option("--api-key", envvar="TREEGRAFT_API_KEY", default=None,
              help="Require 'Authorization: Bearer KEY' on /v1/* and /treegraft/* (also "
              "TREEGRAFT_API_KEY).")
@click.option("--exit-on-stdin-close", is_flag=True,
              help="Exit when standard input closes: an app that launches the server holds "
              "it open, so the server never outlives the app (TreegraftKit sets this).")
def serve(source, strategy, host, port, max_tokens_limit, max_body_bytes, max_queue, max_batch,
          timeout, api_key, exit_on_stdin_close) -> None:
    """OpenAI-compatible server (/v1/models, /v1/completions, /v1/chat/completions), a chat
    page at / and /health. Once it listens it prints one line on stderr, `serving MODEL
    (STRATEGY) on http://HOST:PORT`, with the real port (--port 0 picks a free one)."""
    from pathlib import Path

    from .strategy import parse_strategy
    from .server import ServerConfig, is_loopback, make_server, stop_when_closed

    try:
        parse_strategy(strategy)
    except ValueError as e:
        raise click.ClickException(str(e)) from None
    family = load_family(source, strategy)
    if family is None:
        return
    model_id = Path(str(source.model)).name if source.model else "tg-tiny"
    config = ServerConfig(model_id=model_id, strategy=strategy, max_tokens_limit=max_tokens_limit,
                          max_body_bytes=max_body_bytes, max_queue=max_queue,
                          max_batch=max_batch, timeout=timeout,
                          api_key=api_key or None, note=say_if_test_model(family, "serve"))
    server = make_server(family, host, port, config)
    if config.api_key is None and not is_loopback(host):
        click.echo(f"warning: the server has no authentication and {host!r} is reachable from "
                   "other machines: anyone who reaches it can use the model (pass --api-key)",
                   err=True)
    click.echo(f"serving {model_id} ({strategy}) on http://{host}:{server.server_port}", err=True)
    if exit_on_stdin_close:
        stop_when_closed(server, sys.stdin.buffer)
    try:
        server.serve_forever()
    except KeyboardInterrupt:
        pass
    finally:
        server.server_close()


@main.command()
@click.option("--prompts", "prompts_file", type=click.Path(exists=True, dir_okay=False),
              required=True, help="JSONL file of {id, category, prompt}.")
@click.option("--strategies", default="ar,mlx_lm,mlx_lm_spec,chain,ngram,draft,treegraft",
              show_default=True, help="Comma-separated; treegraft-fixed:<layers> uses '+' "
              "between layers here (treegraft-fixed:1+3).")
@model_options
@click.option("--max-tokens", default=128, show_default=True, type=click.IntRange(1))
@click.option("--repeat", default=1, show_default=True, type=click.IntRange(1))
@click.option("--warmup", default=1, show_default=True, type=click.IntRange(0))
@click.option("--per-category", default=0, type=click.IntRange(0),
              help="Use only the first N prompts of each category (0 = all).")
@click.option("--temp", default=0.0, show_default=True, type=click.FloatRange(0))
@click.option("--top-p", default=1.0, show_default=True, type=click.FloatRange(0, 1, min_open=True))
@click.option("--top-k", default=0, show_default=True, type=click.IntRange(0))
@click.option("--min-p", default=0.0, show_default=True, type=click.FloatRange(0, 1, max_open=True))
@click.option("--seed", default=0, show_default=True, type=int)
@click.option("--budget", default=None, type=click.IntRange(1), help="Override the tree budget.")
@click.option("--json", "json_out", type=click.Path(dir_okay=False), required=True)
@click.option("--plot", "plot_out", type=click.Path(dir_okay=False), default=None,
              help="Also write a PNG of tokens/s per strategy and category (needs matplotlib).")
@click.option("--concurrency", default=None, type=str,
              help="Concurrent requests, e.g. 1,2,4: each strategy served one at a time and "
              "decoded together, beside mlx_lm's BatchGenerator (aggregate and per-request "
              "tokens/s, time to first token).")
@click.option("--http", "over_http", is_flag=True,
              help="With --concurrency: over HTTP, each engine a server process of its own "
              "(treegraft serve one at a time and batching, mlx_lm.server), streaming.")
@click.option("--spec-ks", default="1,2,3,4,5,6,7,8", show_default=True,
              help="The num_draft_tokens values mlx_lm_spec runs (its best is reported).")
@click.option("--checkpoint", "checkpoint_file", type=click.Path(dir_okay=False), default=None,
              help="Append each finished run to this file and reuse the runs it already "
              "holds: an interrupted bench goes on where it stopped.")
def bench(prompts_file, strategies, model, draft_models, max_tokens, repeat, warmup,
          per_category, temp, top_p, top_k, min_p, seed, budget, json_out, plot_out,
          concurrency, over_http, spec_ks, checkpoint_file) -> None:
    """Benchmark strategies side by side (one process, alternating order)."""
    import dataclasses
    from pathlib import Path

    from . import bench as B
    from . import report as R
    from .sampling import SamplerSettings

    settings = SamplerSettings(temp, top_p, top_k, min_p)
    names = [s.strip().replace("+", ",") for s in strategies.split(",") if s.strip()]
    if "ar" not in names:
        names.insert(0, "ar")
    levels = parse_levels(concurrency) if concurrency is not None else None
    if over_http and levels is None:
        raise click.UsageError("--http benchmarks concurrency: give --concurrency too")
    if over_http and draft_models:
        raise click.UsageError("--http serves each engine's default drafters: drop "
                               "--draft-model")
    family = load_family(ModelSource(model, draft_models=draft_models))
    prompts = B.read_prompts(Path(prompts_file))
    if per_category:
        prompts = B.first_per_category(prompts, per_category)
    if levels is not None:
        return bench_concurrency(family, prompts, [n for n in names if not n.startswith("mlx_lm")],
                                 levels, max_tokens, repeat, settings, seed, Path(json_out),
                                 model, over_http)
    tree = dataclasses.replace(family.tree, budget=budget) if budget else None
    checkpoint = Path(checkpoint_file) if checkpoint_file else None
    done = B.read_checkpoint(checkpoint) if checkpoint else {}
    if done:
        click.echo(f"{len(done)} runs reused from {checkpoint}", err=True)
    with click.progressbar(length=len(prompts) * len(names) * repeat, label="bench",
                           file=sys.stderr) as bar:
        runs = B.run_bench(family, prompts, names, max_tokens, repeat, warmup,
                           settings, seed, tree, progress=bar.update,
                           spec_ks=parse_levels(spec_ks, "--spec-ks"), done=done,
                           on_run=(lambda r: B.append_checkpoint(checkpoint, r))
                           if checkpoint else None)
    meta = {**B.machine_info(), "command": " ".join(sys.argv), **dataclasses.asdict(settings),
            "max_tokens": max_tokens, "tree": dataclasses.asdict(tree or family.tree),
            "dtype": str(family.target.model.norm.weight.dtype),
            "ar_bound": R.ar_bound(family.target)}
    B.write_report(Path(json_out), runs, meta)
    if plot_out:
        R.plot(R.load_reports({"greedy" if temp == 0 else "sampled": Path(json_out)}),
               Path(plot_out))
    summary = B.summarize(runs)
    for s, cats in summary["strategies"].items():
        a = cats["all"]
        acc = f"{a['mean_accepted']:.2f}" if a["mean_accepted"] else "-"
        click.echo(f"{s:>24}  {a['tokens_per_sec']:8.1f} tok/s  x{a['speedup_vs_ar']:.2f} vs ar  "
                   f"accepted {acc}  first token {1000 * a['ttft_s']:.0f} ms  "
                   f"waits/token {a['waits_per_token']:.2f}")
    mismatches = B.check_greedy(runs) if temp == 0 else []
    if mismatches:
        for m in mismatches:
            click.echo(f"MISMATCH: {m}", err=True)
        raise click.ClickException(f"{len(mismatches)} greedy outputs differ from ar")


def parse_levels(text: str, option: str = "--concurrency") -> list[int]:
    """A list option's positive integers, e.g. "1,2,4"."""
    try:
        levels = [int(x) for x in text.split(",") if x.strip()]
    except ValueError:
        levels = []
    if not levels or min(levels) < 1:
        raise click.BadParameter(f"expected positive integers like 1,2,4, got {text!r}",
                                 param_hint=option)
    return levels


def bench_concurrency(family, prompts, names, levels, max_tokens, repeat, settings, seed,
                      json_out, model=None, over_http=False) -> None:
    """`bench --concurrency`: bench_concurrency.py's table (bench_http.py's, `over_http`),
    and its JSON."""
    from . import bench as B
    from . import bench_concurrency as C
    from . import bench_http as H

    engines = 2 * len(names) + 1      # serial and together per strategy, and mlx_lm's
    with click.progressbar(length=repeat * len(levels) * engines, label="bench",
                           file=sys.stderr) as bar:
        if over_http:
            served = H.run_http(model, family.model_paths["target"],
                                family.target.model.norm.weight.dtype, prompts, names, levels,
                                max_tokens, repeat, settings, seed, progress=bar.update)
        else:
            served = C.run_concurrency(family, prompts, names, levels, max_tokens, repeat,
                                       settings, seed, progress=bar.update)
    rows = C.summarize(served, levels)
    if over_http:
        mismatches = H.check_greedy_text(served) if settings.greedy else []
        base_engine, checked = "serial_http", {"mlx_lm_server_differs": len(
            H.check_greedy_text(served, ("mlx_lm_server",))) if settings.greedy else None}
    else:
        mismatches = C.check_greedy(served) if settings.greedy else []
        base_engine, checked = "serial", {"mlx_lm_batch_differs": len(
            C.check_greedy(served, ("mlx_lm_batch",))) if settings.greedy else None}
    meta = {**B.machine_info(), "command": " ".join(sys.argv), "max_tokens": max_tokens,
            "levels": levels, "temp": settings.temp, "over_http": over_http, **checked}
    B.write_json(json_out, {"meta": meta, "summary": rows, "served": C.as_json(served)})
    serial = {(r["strategy"], r["concurrency"]): r["aggregate_tps"] for r in rows
              if r["engine"] == base_engine}
    for r in rows:
        base = serial.get((r["strategy"], r["concurrency"])) or serial.get(("ar", r["concurrency"]))
        click.echo(f"{r['engine']:>13} {r['strategy']:>12} x{r['concurrency']:<3} "
                   f"{r['aggregate_tps']:8.1f} tok/s all  {r['request_tps']:7.1f} a request  "
                   f"first token {1000 * r['ttft_s']:6.0f} ms  x{r['aggregate_tps'] / base:.2f} "
                   "vs serial")
    if mismatches:
        for m in mismatches:
            click.echo(f"MISMATCH: {m}", err=True)
        raise click.ClickException(f"{len(mismatches)} greedy outputs differ from ar")


@main.command()
@click.argument("repo")
@click.option("--revision", default=None, help="Branch, tag or commit (default: main).")
def pull(repo, revision) -> None:
    """Download a model from the Hub into the local cache, without running it."""
    from .hub import fetch

    try:
        click.echo(fetch(repo, revision))
    except LoadError as e:
        raise click.ClickException(str(e)) from None


@main.command("ls")
def list_models() -> None:
    """The models treegraft can run: those in the local Hugging Face cache, with the drafter
    each gets, and the GGUF models LM Studio and Ollama keep (run them by the name shown)."""
    from .pairing import cached_models
    from .stores import stored_models

    rows = [(m.repo, f"{m.bytes / 2**30:.2f} GiB", m.quantization, m.drafter)
            for m in cached_models()]
    rows += [(m.name, f"{m.path.stat().st_size / 2**30:.2f} GiB", f"GGUF ({m.store})",
              "converted once on first run") for m in stored_models()]
    if not rows:
        click.echo("no runnable model in the local cache (`treegraft pull REPO` fetches one), "
                   "nor in LM Studio's or Ollama's model folders")
        return
    rows.insert(0, ("model", "size", "weights", "drafter"))
    widths = [max(len(r[i]) for r in rows) for i in range(3)]
    for r in rows:
        click.echo("  ".join(c.ljust(w) for c, w in zip(r, widths)) + "  " + r[3])


@main.command()
@click.option("--hf-path", required=True,
              help="Target: local path, Hub repo id (downloaded on first use), or a GGUF "
              "(file, or a name LM Studio or Ollama shows).")
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
    """Convert a target and its drafters into one MLX TreeGraft bundle. A GGUF (a file, a
    split set's first file, or a name LM Studio or Ollama shows) is requantized at --q-bits
    unless --dtype keeps it in float."""
    from .convert import ConvertError, QuantSpec, convert_family
    from .convert.gguf import gguf_once, is_gguf

    def bar(role: str, n: int):
        return click.progressbar(length=n, label=f"converting {role}", file=sys.stderr)

    def log(m: str) -> None:
        click.echo(m, err=True)

    ctx = click.get_current_context()
    given = [f"--{name.replace('_', '-')}" for name in ("q_bits", "q_group_size", "quant_recipe")
             if ctx.get_parameter_source(name) is click.core.ParameterSource.COMMANDLINE]
    try:
        ggufs = [is_gguf(p) for p in (hf_path, *draft_paths)]
        if any(ggufs) and not quantize and dtype is None:
            quantize = True          # a GGUF is a quantized model: it stays one by default
        if given and not quantize:
            raise click.UsageError(f"{', '.join(given)} only apply with -q/--quantize")
        hf_path, *draft_paths = [gguf_once(p, None, log, bar) if g else p
                                 for p, g in zip((hf_path, *draft_paths), ggufs)]
        quant = QuantSpec(int(q_bits), int(q_group_size), quant_recipe) if quantize else None
        convert_family(hf_path, draft_paths, mlx_path, quant, dtype, context,
                       progress_factory=bar, log=log)
    except (ConvertError, LoadError) as e:
        raise click.ClickException(str(e)) from None


@main.command("calibrate-budget")
@click.option("--prompts", "prompts_file", type=click.Path(exists=True, dir_okay=False),
              default="benchmarks/prompts/calibration.jsonl", show_default=True)
@click.option("--model", default=None, help="Bundle (default: the bundled tg-tiny family).")
@click.option("--strategy", default="treegraft-fixed:1", show_default=True)
@click.option("--budgets", default="8,12,16,24,32", show_default=True)
@click.option("--top-ks", default="3,5,10", show_default=True)
@click.option("--depths", default="4,5", show_default=True)
@click.option("--max-tokens", default=64, show_default=True, type=click.IntRange(1))
@click.option("--write", is_flag=True, help="Store the best settings in the bundle's treegraft.json.")
@click.option("--json", "json_out", type=click.Path(dir_okay=False), default=None)
def calibrate_budget(prompts_file, model, strategy, budgets, top_ks, depths, max_tokens, write,
                     json_out) -> None:
    """Measure verification latency and pick the fastest tree budget, top_k and depth here;
    refresh this device's cached step costs (what per-step sizing prices)."""
    import dataclasses
    from pathlib import Path

    from . import bench as B
    from .family import save_tree_settings

    def ints(spec: str) -> list[int]:
        return [int(x) for x in spec.split(",") if x.strip()]

    family = load_family(ModelSource(model))
    prompts = B.read_prompts(Path(prompts_file))
    grid = (ints(budgets), ints(top_ks), ints(depths))
    with click.progressbar(length=len(prompts) * len(grid[0]) * len(grid[1]) * len(grid[2]),
                           label="calibrate", file=sys.stderr) as bar:
        result = B.calibrate_tree(family, prompts, *grid, strategy, max_tokens, bar.update)
    for r in result["settings"]:
        click.echo(f"budget {r['budget']:4d} top_k {r['top_k']:3d} depth {r['depth']}: expected "
                   f"{r['expected_tokens_per_sec']:7.1f} tok/s (wall {r['tokens_per_sec']:6.1f}), "
                   f"{r['mean_accepted']:.2f} tokens/step")
    click.echo("verification latency (ms): " + ", ".join(
        f"n={n}: {ms:.1f}" for n, ms in result["verification_latency_ms"].items()), err=True)
    click.echo(f"verify_pad: {result['verify_pad']}")
    from .probe import step_costs

    costs = step_costs(family, family.tree, refresh=True)
    result["step_costs"] = dataclasses.asdict(costs)
    click.echo(f"step costs (cached for per-step sizing): AR step {costs.ar_ms:.1f} ms, tree "
               f"step host work {costs.overhead_ms:.1f} ms, n-gram drafting "
               f"{costs.draft_ms:.2f} ms, +{1000 * costs.row_context_ms:.2f} us per row and "
               "context token", err=True)
    best = {**result["best"], "verify_pad": tuple(result["verify_pad"])}
    click.echo(f"best: {result['best']}")
    report = {**B.machine_info(), "command": " ".join(sys.argv), **result}
    if json_out:
        Path(json_out).write_text(json.dumps(report, indent=1))
    if write:
        save_tree_settings(family.path, dataclasses.replace(family.tree, **best))
        click.echo(f"wrote {best} to {family.path / 'treegraft.json'}")


def calibration_options(work_dir: str, what: str):
    """--prompts, --model, --work-dir, --max-tokens, --seed, --temp, --top-p: shared by the
    commands that calibrate on prompts."""
    def wrap(f):
        for opt in reversed([
            click.option("--prompts", "prompts_file", type=click.Path(exists=True, dir_okay=False),
                         default="benchmarks/prompts/calibration.jsonl", show_default=True,
                         help="Calibration prompts (keep them out of the benchmark suite)."),
            click.option("--model", default=None,
                         help="Bundle (default: the bundled tg-tiny family)."),
            click.option("--work-dir", type=click.Path(file_okay=False), default=work_dir,
                         show_default=True, help=f"{what}; rerun to resume."),
            click.option("--max-tokens", default=64, show_default=True, type=click.IntRange(1)),
            click.option("--seed", default=0, show_default=True, type=int),
            click.option("--temp", default=0.0, show_default=True, type=click.FloatRange(0.0),
                         help="Calibrate for sampling at this temperature (0: greedy)."),
            click.option("--top-p", default=1.0, show_default=True,
                         type=click.FloatRange(0.0, 1.0, min_open=True)),
        ]):
            f = opt(f)
        return f
    return wrap


@main.command()
@calibration_options("calibration-run", "Dataset and latency curve")
@click.option("--b0", default=5, show_default=True, type=click.IntRange(1),
              help="Most strong-drafter calls per step while labelling; the runtime budget "
                   "is chosen from the data, at most this.")
@click.option("--write", is_flag=True,
              help="Install the artifact in the bundle (scheduler/, or scheduler-sampled/ when "
                   "--temp > 0).")
def calibrate(prompts_file, model, work_dir, max_tokens, seed, temp, top_p, b0, write) -> None:
    """Label call/skip decisions counterfactually, distil them into the scheduler MLP."""
    from pathlib import Path

    from . import bench as B
    from . import report as R
    from .calibrate import CalibrationRun, calibrate as run, calibration_units, dataset_timing
    from .family import install_scheduler
    from .probe import scheduler_timing
    from .sampling import SamplerSettings

    family = load_family(ModelSource(model))
    if family.strong is None:
        raise click.ClickException("calibration needs a family with a strong drafter")
    prompts = B.read_prompts(Path(prompts_file))
    settings = SamplerSettings(temp, top_p)
    work = Path(work_dir)
    timing = dataset_timing(work, lambda: scheduler_timing(family, family.tree))
    click.echo(f"T_tgt {timing.t_tgt_ms:.1f} ms, T_mid {timing.t_mid_ms:.1f} ms", err=True)
    artifact = work / "scheduler"
    with click.progressbar(length=calibration_units(prompts), label="calibrate",
                           file=sys.stderr) as bar:
        meta = run(family, Path(prompts_file), prompts, work, timing, artifact,
                   CalibrationRun(max_tokens, b0, seed, settings), bar.update)
    click.echo("\n".join(R.scheduler_lines(meta)))
    click.echo(f"artifact: {artifact}")
    if write:
        if family.path is None or not (family.path / "treegraft.json").exists():
            raise click.ClickException("--write needs a bundle with treegraft.json")
        dest = install_scheduler(family.path, artifact, sampled=not settings.greedy)
        click.echo(f"installed in {dest}")


@main.command("calibrate-acceptance")
@calibration_options("calibration-acceptance", "Logged outcomes per regime")
@click.option("--write", is_flag=True,
              help="Store the regime's weights in the bundle's acceptance.json.")
def calibrate_acceptance(prompts_file, model, work_dir, max_tokens, seed, temp, top_p,
                         write) -> None:
    """Log per-node verification outcomes and fit the acceptance estimates the per-step tree
    size is chosen with; prints the reliability curve (predicted vs observed)."""
    from pathlib import Path

    from . import acceptance as A
    from . import bench as B
    from . import report as R
    from .calibrate import provenance
    from .calibrate_acceptance import calibrate_acceptance as run
    from .family import store_acceptance
    from .sampling import SamplerSettings

    family = load_family(ModelSource(model))
    prompts = B.read_prompts(Path(prompts_file))
    settings = SamplerSettings(temp, top_p)
    with click.progressbar(length=len(prompts), label="log outcomes", file=sys.stderr) as bar:
        report = run(family, prompts, Path(work_dir), settings, max_tokens, seed, bar.update)
    name = A.regime(not settings.greedy)
    click.echo("\n".join(R.acceptance_lines(name, report)))
    if write:
        if family.path is None or not (family.path / "treegraft.json").exists():
            raise click.ClickException("--write needs a bundle with treegraft.json")
        out = store_acceptance(family.path, name, {
            **report, "calibration_prompts": provenance(Path(prompts_file), prompts),
            "machine": B.machine_info(), "max_tokens": max_tokens, "seed": seed})
        click.echo(f"wrote {name} weights to {out}")


@main.command("export-coreml")
@click.option("--model", default=None, help="Bundle with a scheduler (default: tg-tiny).")
@click.option("--scheduler", "scheduler_dir", type=click.Path(exists=True, file_okay=False),
              default=None, help="Scheduler artifact directory (default: the bundle's).")
@click.option("--sampled", is_flag=True,
              help="The bundle's scheduler calibrated for sampling (default: the greedy one).")
@click.option("--out", required=True, type=click.Path(), help="Output .mlpackage path.")
def export_coreml(model, scheduler_dir, sampled, out) -> None:
    """Export the learned scheduler as a Core ML ML Program (.mlpackage) for macOS apps."""
    from pathlib import Path

    from .coreml import export_coreml as export

    if scheduler_dir is None:
        from .family import bundle_scheduler

        bundle = Path(model) if model else fixture_path()
        scheduler_dir = bundle_scheduler(bundle, sampled=sampled)
        if scheduler_dir is None:
            kind, how = ("sampling-calibrated", " --temp T") if sampled else ("calibrated", "")
            raise click.ClickException(f"{bundle} has no {kind} scheduler; run `treegraft "
                                       f"calibrate{how} --write` or pass --scheduler")
    try:
        path = export(Path(scheduler_dir), Path(out))
    except (ValueError, FileNotFoundError) as e:
        raise click.ClickException(str(e)) from None
    click.echo(f"wrote {path}")


@main.command()
@click.option("--greedy", type=click.Path(exists=True, dir_okay=False), required=True,
              help="bench JSON of the greedy run.")
@click.option("--sampled", type=click.Path(exists=True, dir_okay=False), default=None,
              help="bench JSON of the sampled run.")
@click.option("--acceptance", type=click.Path(exists=True, dir_okay=False), default=None,
              help="A bundle's acceptance.json: add its reliability table.")
@click.option("--readme", type=click.Path(exists=True, dir_okay=False), default=None,
              help="Rewrite the generated results block of this file (benchmarks/RESULTS.md).")
@click.option("--plot", "plot_out", type=click.Path(dir_okay=False), default=None)
def report(greedy, sampled, acceptance, readme, plot_out) -> None:
    """Results tables (and plot) from committed bench JSON files."""
    from pathlib import Path

    from . import report as R

    paths = {"greedy": Path(greedy), **({"sampled": Path(sampled)} if sampled else {})}
    reports = R.load_reports(paths)
    section = R.results_section(reports, json.loads(Path(acceptance).read_text())
                                if acceptance else None)
    if readme:
        try:
            R.update_readme(Path(readme), section)
        except ValueError as e:
            raise click.ClickException(str(e)) from None
        click.echo(f"updated {readme}")
    else:
        click.echo(section)
    if plot_out:
        try:
            R.plot(reports, Path(plot_out))
        except RuntimeError as e:
            raise click.ClickException(str(e)) from None
        click.echo(f"wrote {plot_out}")
