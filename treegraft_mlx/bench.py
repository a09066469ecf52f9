"""Benchmark strategies side by side in one process, on one prompt suite.

Speed is reported as generation tokens/s (prompt processing excluded for every strategy) and
as ratios to `ar` measured in the same run. Strategy order alternates across repeats to
cancel drift. Under greedy decoding every strategy's output is checked against `ar`.
"""

from __future__ import annotations

import dataclasses
import json
import platform
import time
from collections import defaultdict
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Callable, Optional, Sequence

import mlx.core as mx

from .device import blas_library
from .engine import generate
from .family import Family, TreeConfig
from .waits import Waits
from .sampling import SamplerSettings
from .timing import pad_map, verification_latency

MLX_LM_SPEC_KS = range(1, 9)
# Tree shapes a strategy name may ask for with a suffix (`treegraft@paper`).
SHAPES = {None: lambda tree: tree,
          "paper": lambda tree: TreeConfig(adaptive=False),
          "budget": lambda tree: dataclasses.replace(tree, adaptive=False)}


@dataclass
class Run:
    prompt_id: str
    category: str
    strategy: str
    repeat: int
    tokens: int
    steps: int
    mean_accepted: float
    tokens_per_sec: float
    token_ids: list[int]
    t_draft: float = 0.0
    t_verify: float = 0.0
    t_accept: float = 0.0
    t_schedule: float = 0.0
    rows: int = 0                  # rows the target's forwards verified (after prefill)
    per_k: Optional[dict] = None   # mlx_lm_spec: {num_draft_tokens: [tokens, tokens/s]}
    loop_steps: int = 0            # steps whose first token continues a loop (loop_split)
    loop_tokens: int = 0           # the tokens those steps committed
    ttft_s: float = 0.0            # time to first token (prefill included)
    waits: int = 0                 # host waits on the device (waits.Waits), prefill included
    read_bytes: int = 0            # bytes those waits read back
    drafter_calls: int = 0         # forwards of the strong drafter (or drafter head)


def read_prompts(path: Path) -> list[dict]:
    rows = []
    for n, line in enumerate(Path(path).read_text().splitlines(), 1):
        if line.strip():
            row = json.loads(line)
            missing = {"id", "category", "prompt"} - set(row)
            if missing:
                raise ValueError(f"{path}:{n}: missing fields {sorted(missing)}")
            rows.append(row)
    return rows


def first_per_category(prompts: list[dict], n: int) -> list[dict]:
    """The first n prompts of each category, in file order."""
    kept, counts = [], defaultdict(int)
    for p in prompts:
        if counts[p["category"]] < n:
            kept.append(p)
            counts[p["category"]] += 1
    return kept


def loop_share(tokens: list[int], n: int = 4) -> float:
    """Share of generated tokens whose n-gram (ending at them) already occurred earlier."""
    seen, repeated, total = set(), 0, 0
    for i in range(n - 1, len(tokens)):
        gram = tuple(tokens[i - n + 1:i + 1])
        total += 1
        repeated += gram in seen
        seen.add(gram)
    return repeated / total if total else 0.0


def loop_split(tokens: list[int], blocks: list[int], n: int = 4) -> tuple[int, int]:
    """(steps, tokens) of the steps inside a loop: those whose first committed token ends an
    n-gram that already occurred (as `loop_share` counts them). `blocks`: tokens committed
    per step; the last may run past `tokens` (cut at max_tokens)."""
    seen, steps, inside, block_at, start = set(), 0, 0, {}, 0
    for size in blocks:                 # position of each step's first token -> its size
        block_at[start], start = size, start + size
    for i in range(len(tokens)):
        gram = tuple(tokens[i - n + 1:i + 1]) if i >= n - 1 else None
        if i in block_at and gram in seen:
            steps += 1
            inside += min(block_at[i], len(tokens) - i)
        if gram is not None:
            seen.add(gram)
    return steps, inside


def _mlx_lm_runner(family: Family, settings: SamplerSettings):
    """mlx_lm's own generation (AR, or speculative with the same strong drafter) on the same
    weights, in the same compute dtype as this runtime."""
    import mlx_lm
    from mlx_lm.sample_utils import make_sampler

    models = {}
    sampler = make_sampler(temp=settings.temp, top_p=settings.top_p, min_p=settings.min_p,
                           top_k=settings.top_k)

    def model(role: str):
        if role not in models:
            m, _ = mlx_lm.load(str(family.model_paths[role]))
            m.set_dtype(family.target.model.norm.weight.dtype)
            models[role] = m
        return models[role]

    def run(prompt: str, max_tokens: int, draft: Optional[int]):
        ids = family.tokenizer.encode(prompt)
        toks, last, ttft, forwards = [], None, 0.0, 0
        kwargs = {}
        if draft:
            strong = list(family.drafters)[-1]
            kwargs = {"draft_model": model(strong), "num_draft_tokens": draft}
        for r in mlx_lm.stream_generate(model("target"), family.tokenizer, ids,
                                        max_tokens=max_tokens,
                                        sampler=sampler, **kwargs):
            if not ttft:
                ttft = r.prompt_tokens / r.prompt_tps
            if r.token in family.tokenizer.eos_token_ids:
                break
            toks.append(r.token)
            forwards += not getattr(r, "from_draft", False)   # one target token a forward
            last = r
        return toks, (last.generation_tps if last else 0.0), ttft, forwards

    return run


def run_bench(family: Family, prompts: list[dict], strategies: list[str], max_tokens: int,
              repeat: int = 1, warmup: int = 1, settings: SamplerSettings = SamplerSettings(),
              seed: int = 0, tree: Optional[TreeConfig] = None,
              progress: Optional[Callable[[int], None]] = None,
              spec_ks: Sequence[int] = MLX_LM_SPEC_KS, done: Optional[dict] = None,
              on_run: Optional[Callable[[Run], None]] = None) -> list[Run]:
    """All (repeat, prompt, strategy) runs; strategies alternate order between repeats.

    A strategy suffixed `@paper` (e.g. `treegraft@paper`) runs with the paper's default tree
    (budget 64, top_k 10, depth 5, every step pruned to the budget) instead of the bundle's
    calibrated one, to show what the calibration buys on this device; `@budget` runs the
    bundle's tree pruned to its fixed budget every step, to show what per-step sizing buys.
    `mlx_lm_spec` runs every num_draft_tokens in `spec_ks` (summarize picks from them).
    `done` holds runs of an interrupted bench by (prompt id, strategy, repeat): those are
    reused, not run again; `on_run` sees each new run as it ends (a checkpoint).
    """
    mlx_run = _mlx_lm_runner(family, settings)
    runs: list[Run] = []

    def one(p: dict, s: str, r: int) -> Run:
        if s in ("mlx_lm", "mlx_lm_spec"):
            per_k = {}
            for k in (spec_ks if s == "mlx_lm_spec" else [None]):
                mx.random.seed(seed)
                with Waits() as waits:
                    toks, tps, ttft, forwards = mlx_run(p["prompt"], max_tokens, k)
                per_k[k] = [len(toks), tps, waits.count, waits.nbytes, forwards]
            return Run(p["id"], p["category"], s, r, len(toks), forwards - 1, 0.0, tps, toks,
                       per_k=per_k if s == "mlx_lm_spec" else None, ttft_s=ttft,
                       waits=waits.count, read_bytes=waits.nbytes)
        name, shape = s.split("@", 1) if "@" in s else (s, None)
        if shape not in SHAPES:
            raise ValueError(f"unknown tree shape {shape!r} in {s!r} (choose from "
                             f"{', '.join(x for x in SHAPES if x)})")
        with Waits() as waits:
            res = generate(family, p["prompt"], name, max_tokens=max_tokens,
                           settings=settings, seed=seed, tree=SHAPES[shape](tree or family.tree))
        st = res.step_stats
        loops = loop_split(res.token_ids, [1] + [x.accepted + 1 for x in st])  # prefill's first
        return Run(p["id"], p["category"], s, r, res.generation_tokens, res.steps,
                   res.mean_accepted, res.tokens_per_sec, res.token_ids,
                   sum(x.t_draft for x in st), sum(x.t_verify for x in st),
                   sum(x.t_accept for x in st), sum(x.t_schedule for x in st),
                   sum(x.rows for x in st), loop_steps=loops[0], loop_tokens=loops[1],
                   ttft_s=res.time_to_first_token, waits=waits.count,
                   read_bytes=waits.nbytes, drafter_calls=res.drafter_calls)

    for p in prompts[:warmup]:
        for s in strategies:
            one(p, s, -1)
    for r in range(repeat):
        order = strategies if r % 2 == 0 else strategies[::-1]
        for p in prompts:
            for s in order:
                run = (done or {}).get((p["id"], s, r))
                if run is None:
                    run = one(p, s, r)
                    if on_run:
                        on_run(run)
                runs.append(run)
                if progress:
                    progress(1)
    return runs


def read_checkpoint(path: Path) -> dict:
    """The runs a checkpoint file (one JSON Run a line) holds, by (prompt id, strategy,
    repeat); a line cut short by an interrupted write is dropped."""
    done = {}
    if path.exists():
        for line in path.read_text().splitlines():
            try:
                run = Run(**json.loads(line))
            except (json.JSONDecodeError, TypeError):
                continue
            if run.per_k:
                run.per_k = {int(k) if k not in (None, "null") else None: v
                             for k, v in run.per_k.items()}
            done[(run.prompt_id, run.strategy, run.repeat)] = run
    return done


def append_checkpoint(path: Path, run: Run) -> None:
    with open(path, "a") as f:
        f.write(json.dumps(dataclasses.asdict(run)) + "\n")


def check_greedy(runs: list[Run]) -> list[str]:
    """Every strategy's tokens must equal `ar`'s for the same prompt and repeat."""
    ref = {(r.prompt_id, r.repeat): r.token_ids for r in runs if r.strategy == "ar"}
    return [f"{r.strategy} differs from ar on {r.prompt_id}"
            for r in runs if (r.prompt_id, r.repeat) in ref
            and r.token_ids != ref[(r.prompt_id, r.repeat)]]


def spec_runs(runs: list[Run]) -> list[Run]:
    """`mlx_lm_spec` as a user runs it, one num_draft_tokens for every prompt (the k fastest
    over the whole run), and `mlx_lm_spec_oracle`, each prompt's fastest k: a best-of-8 that
    flatters the baseline, shown as such."""
    spec = [r for r in runs if r.strategy == "mlx_lm_spec" and r.per_k]
    if not spec:
        return []

    def seconds(r: Run, k) -> float:
        tokens, tps = r.per_k[k][:2]
        return tokens / tps if tps else 0.0

    ks = list(spec[0].per_k)
    best_k = max(ks, key=lambda k: sum(r.per_k[k][0] for r in spec)
                 / max(1e-9, sum(seconds(r, k) for r in spec)))
    out = []
    for r in spec:
        oracle = max(ks, key=lambda k: r.per_k[k][1])
        for name, k in (("mlx_lm_spec", best_k), ("mlx_lm_spec_oracle", oracle)):
            tokens, tps, *counts = r.per_k[k]   # counts: waits, bytes, forwards (newer runs)
            waits, nbytes, forwards = (list(counts) + [0, 0, 0])[:3]
            out.append(dataclasses.replace(r, strategy=name, tokens=tokens, tokens_per_sec=tps,
                                           per_k={k: r.per_k[k]}, waits=waits,
                                           read_bytes=nbytes, steps=max(0, forwards - 1)))
    return out


def summarize(runs: list[Run]) -> dict:
    """Per strategy and category: tokens/s (tokens over time), mean accepted, rows verified
    per step, speedup over ar."""
    runs = [r for r in runs if r.strategy != "mlx_lm_spec"] + spec_runs(runs)
    agg = defaultdict(lambda: {"tokens": 0, "time": 0.0, "steps": 0, "rows": 0, "draft": 0.0,
                               "verify": 0.0, "accept": 0.0, "schedule": 0.0, "n": 0,
                               "loop_steps": 0, "loop_tokens": 0, "ttft": 0.0, "waits": 0,
                               "read_bytes": 0, "drafter_calls": 0})
    for r in runs:
        for cat in (r.category, "all"):
            a = agg[(r.strategy, cat)]
            a["tokens"] += r.tokens
            a["time"] += r.tokens / r.tokens_per_sec if r.tokens_per_sec else 0.0
            a["steps"] += r.steps
            a["rows"] += r.rows
            a["draft"] += r.t_draft
            a["verify"] += r.t_verify
            a["accept"] += r.t_accept
            a["schedule"] += r.t_schedule
            a["loop_steps"] += r.loop_steps
            a["loop_tokens"] += r.loop_tokens
            a["ttft"] += r.ttft_s
            a["waits"] += r.waits
            a["read_bytes"] += r.read_bytes
            a["drafter_calls"] += r.drafter_calls
            a["n"] += 1
    out: dict = defaultdict(dict)
    for (s, cat), a in agg.items():
        tps = a["tokens"] / a["time"] if a["time"] else 0.0
        out[s][cat] = {"tokens_per_sec": tps,
                       "mean_accepted": ((a["tokens"] - a["n"]) / a["steps"]  # after each
                                         if a["steps"] else None),               # first token
                       "rows_per_step": a["rows"] / a["steps"] if a["rows"] else None,
                       "draft_s": a["draft"], "verify_s": a["verify"], "accept_s": a["accept"],
                       "schedule_s": a["schedule"],
                       "schedule_share": a["schedule"] / a["time"] if a["time"] else 0.0,
                       "ttft_s": a["ttft"] / a["n"], "runs": a["n"],
                       # what transfers to another machine as it is: the target's forwards
                       # (the prefill's included) and the strong drafter's, per token
                       "tokens_per_forward": (a["tokens"] / (a["steps"] + a["n"])
                                              if a["steps"] else None),
                       "drafter_calls_per_token": (a["drafter_calls"] / a["tokens"]
                                                   if a["tokens"] else None),
                       # per generated token, prefill included: comparable with mlx_lm's,
                       # whose forwards are not counted (its speculative steps are unseen)
                       "waits_per_token": a["waits"] / a["tokens"] if a["tokens"] else None,
                       "read_bytes_per_token": (a["read_bytes"] / a["tokens"]
                                                if a["tokens"] else None),
                       "waits_per_forward": (a["waits"] / (a["steps"] + a["n"])
                                             if a["steps"] else None)}   # prefill's included
        other_steps = a["steps"] - a["loop_steps"]
        if a["steps"]:          # tokens per forward, steps inside a loop and outside one
            out[s][cat]["mean_accepted_loop"] = (a["loop_tokens"] / a["loop_steps"]
                                                 if a["loop_steps"] else None)
            out[s][cat]["mean_accepted_other"] = ((a["tokens"] - a["n"] - a["loop_tokens"])
                                                  / other_steps
                                                  if other_steps > 0 else None)
            out[s][cat]["loop_step_share"] = a["loop_steps"] / a["steps"]
        if s == "mlx_lm_spec":
            out[s][cat]["num_draft_tokens"] = next(iter(runs_k(runs, s)))
    for s in out:
        for cat, v in out[s].items():
            ar = out.get("ar", {}).get(cat, {}).get("tokens_per_sec")
            v["speedup_vs_ar"] = v["tokens_per_sec"] / ar if ar else None
            plain = out.get("mlx_lm", {}).get(cat, {}).get("ttft_s")
            v["ttft_vs_mlx_lm"] = v["ttft_s"] / plain if plain and v["ttft_s"] else None
    loops = defaultdict(list)
    for r in runs:
        if r.strategy == "ar":
            loops[r.category].append(loop_share(r.token_ids))
            loops["all"].append(loop_share(r.token_ids))
    return {"strategies": dict(out),
            "ar_loop_share": {c: sum(v) / len(v) for c, v in loops.items()}}


def runs_k(runs: list[Run], strategy: str) -> set:
    """The num_draft_tokens values the runs of `strategy` used."""
    return {k for r in runs if r.strategy == strategy and r.per_k for k in r.per_k}


def machine_info() -> dict:
    return {"platform": platform.platform(), "processor": platform.processor() or platform.machine(),
            "device": str(mx.default_device()), "blas": blas_library() or "MLX bundled",
            "mlx": mx.__version__, "date": time.strftime("%Y-%m-%d")}


def write_report(path: Path, runs: list[Run], meta: dict) -> None:
    write_json(path, {"meta": meta, "summary": summarize(runs), "runs": [asdict(r) for r in runs]})


def write_json(path: Path, report: dict) -> None:
    """`report` as JSON at `path`, whole or not at all (written beside it, then moved)."""
    tmp = Path(str(path) + ".tmp")
    tmp.write_text(json.dumps(report, indent=1))
    tmp.replace(path)


def calibrate_tree(family: Family, prompts: list[dict], budgets: list[int], top_ks: list[int],
                   depths: list[int], strategy: str, max_tokens: int,
                   progress: Optional[Callable[[int], None]] = None) -> dict:
    """Tokens/s of `strategy` for every (budget, top_k, depth) on calibration prompts.

    Every step prunes to the budget here (the paper's way, and what per-step sizing falls
    back to with `adaptive=False`). In the spirit of Sequoia's hardware-aware trees: the
    target's verification latency is
    measured here for every block size up to the largest budget (median of repeats), small
    blocks are padded to a faster size where one exists (`verify_pad`), and each tree shape
    runs on this machine; its expected speed is committed tokens / (measured drafting and
    acceptance time + the measured latency of the blocks it verified). The latency table
    keeps one noisy step from picking the shape; wall-clock tokens/s is reported beside it.
    """
    limit = max(budgets)
    latency = verification_latency(family.target, sizes=tuple(range(1, limit + 1)), repeats=9)
    pad = pad_map(latency, limit)
    results = []
    for depth in depths:
        for top_k in top_ks:
            for b in budgets:
                tree = dataclasses.replace(family.tree, budget=b, top_k=top_k, depth=depth,
                                           verify_pad=pad, adaptive=False)
                tokens, committed, seconds, steps, model_ms = 0, 0, 0.0, 0, 0.0
                for p in prompts:
                    res = generate(family, p["prompt"], strategy, max_tokens=max_tokens, tree=tree)
                    tokens += res.generation_tokens
                    committed += res.generation_tokens - 1   # by the steps (not the prefill)
                    seconds += res.generation_tokens / res.tokens_per_sec if res.tokens_per_sec else 0.0
                    steps += res.steps
                    model_ms += sum(1000 * (s.t_draft + s.t_accept)
                                    + latency[tree.rows_for(s.nodes_verified)]
                                    for s in res.step_stats)
                    if progress:
                        progress(1)
                results.append({"budget": b, "top_k": top_k, "depth": depth,
                                "expected_tokens_per_sec": (1000 * committed / model_ms
                                                            if model_ms else 0.0),
                                "tokens_per_sec": tokens / seconds if seconds else 0.0,
                                "mean_accepted": committed / steps if steps else 0.0})
    best = max(results, key=lambda r: r["expected_tokens_per_sec"])
    return {"strategy": strategy, "verification_latency_ms": latency, "verify_pad": list(pad),
            "settings": results, "best": {k: best[k] for k in ("budget", "top_k", "depth")}}
