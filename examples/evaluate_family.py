"""Measure the numbers of the fixture family's model card, on this machine, with this runtime.

  - held-out loss (nats/token) of each model on the held-out modules of the split: the
    standard library's (comparable across families) and the corpus packages' (fetched by
    name as the training script does)
  - drafter-vs-target greedy next-token agreement on held-out code (teacher forced)
  - one-token forward latency (fp32, 64 tokens of context) of each model, and their ratio
  - the target's greedy loop share on the public prompt suite, per category
  - tokens per target forward of `ngram`, `draft` and `treegraft` on the public suite (greedy,
    the bundle's fixed tree: deterministic, so families compare on a busy machine too)

    python examples/evaluate_family.py --json treegraft_mlx/fixtures/tg-tiny/evaluation.json

A family before and after a change compare on one split: `--family OLD --split NEW/split.json`.
"""

from __future__ import annotations

import treegraft_mlx  # noqa: F401  first: it loads the system BLAS before mlx (blas.py)

import argparse
import json
import statistics
import sys
import sysconfig
import time
from pathlib import Path

import mlx.core as mx
import numpy as np

from treegraft_mlx import fixture_path, generate, load
from treegraft_mlx.bench import loop_share, read_prompts
from treegraft_mlx.device import blas_library

SUITE = Path(__file__).resolve().parents[1] / "benchmarks/prompts/public.jsonl"
FORWARD_STRATEGIES = ("ngram", "draft", "treegraft")


def heldout_ids(tokenizer, split: dict, work: Path) -> dict[str, list[list[int]]]:
    """Token ids of the held-out documents, by source: "stdlib" and "packages" (the sdists
    named in the split, cached in `work`/sdists as the training script keeps them)."""
    held = set(split["heldout"])
    root = Path(sysconfig.get_paths()["stdlib"])
    texts: dict[str, list[str]] = {"stdlib": [], "packages": []}
    for module in split["heldout"]:
        if "/" not in module:
            path = root.joinpath(*module.split(".")).with_suffix(".py")
            texts["stdlib"].append(path.read_text(encoding="utf-8"))
    if split.get("packages"):
        sys.path.insert(0, str(Path(__file__).resolve().parent))
        from train_tiny_family import package_modules

        for spec in split["packages"]:
            texts["packages"] += [t for m, t in package_modules(work, spec) if m in held]
    return {source: [tokenizer.encode(t) + [tokenizer.eos_token_id] for t in docs]
            for source, docs in texts.items() if docs}


def loss_and_agreement(target, drafter, docs, window: int = 1024, max_tokens: int = 150_000):
    """Mean next-token loss of both models and top-1 agreement, over non-overlapping windows."""
    stream = [t for d in docs for t in d][: max_tokens + 1]
    tot_t = tot_d = agree = n = 0.0
    for start in range(0, len(stream) - 1, window):
        chunk = stream[start:start + window + 1]
        x, y = mx.array([chunk[:-1]]), mx.array(chunk[1:])
        lt, ld = target(x)[0].astype(mx.float32), drafter(x)[0].astype(mx.float32)
        ce_t = mx.logsumexp(lt, -1) - mx.take_along_axis(lt, y[:, None], -1)[:, 0]
        ce_d = mx.logsumexp(ld, -1) - mx.take_along_axis(ld, y[:, None], -1)[:, 0]
        same = mx.argmax(lt, -1) == mx.argmax(ld, -1)
        tot_t += ce_t.sum().item()
        tot_d += ce_d.sum().item()
        agree += same.sum().item()
        n += y.size
    return tot_t / n, tot_d / n, agree / n


def one_token_ms(model, repeats: int = 60) -> float:
    cache = model.make_cache()
    model(mx.array([list(range(3, 67))]), cache=cache)
    cache.commit()
    times = []
    tok = mx.array([[5]])
    for i in range(repeats + 5):
        t0 = time.perf_counter()
        mx.eval(model(tok, cache=cache))
        times.append(time.perf_counter() - t0)
        cache.reset(64)
    return statistics.median(times[5:]) * 1000


def tokens_per_forward(family, prompts: list[dict], max_tokens: int) -> dict:
    """Generated tokens per target forward, per strategy, greedy (the family is loaded without
    autotune, so tree strategies verify its fixed tree)."""
    out = {}
    for strategy in FORWARD_STRATEGIES:
        tokens = steps = 0
        for p in prompts:
            r = generate(family, p["prompt"], strategy, max_tokens=max_tokens)
            tokens, steps = tokens + len(r.token_ids), steps + r.steps
        out[strategy] = tokens / steps
    return out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--json", type=Path, required=True)
    ap.add_argument("--family", type=Path, default=None, help="default: the bundled fixture")
    ap.add_argument("--split", type=Path, default=None, help="default: the family's split.json")
    ap.add_argument("--work", type=Path, default=Path(".train/tg-tiny"),
                    help="where the corpus packages' source distributions are cached")
    ap.add_argument("--max-tokens", type=int, default=128)
    ap.add_argument("--forward-tokens", type=int, default=64,
                    help="new tokens per prompt when counting tokens per target forward")
    ap.add_argument("--no-latency", action="store_true",
                    help="skip the forward timings (a busy machine would falsify them)")
    args = ap.parse_args()
    family_dir = args.family or fixture_path()
    split = json.loads((args.split or family_dir / "split.json").read_text())
    family = load(family_dir, autotune=False)  # no step costs: nothing here sizes trees
    drafter = family.strong
    report: dict = {"family": str(family_dir)}
    for source, docs in heldout_ids(family.tokenizer, split, args.work).items():
        loss_t, loss_d, agreement = loss_and_agreement(family.target, drafter, docs)
        suffix = "" if source == "stdlib" else f"_{source}"  # the stdlib keeps the old keys
        report |= {f"heldout_loss_target{suffix}": loss_t,
                   f"heldout_loss_drafter{suffix}": loss_d,
                   f"greedy_agreement_drafter_vs_target{suffix}": agreement}
    if not args.no_latency:
        t_ms, d_ms = one_token_ms(family.target), one_token_ms(drafter)
        report |= {"one_token_ms_target": t_ms, "one_token_ms_drafter": d_ms,
                   "latency_ratio_target_over_drafter": t_ms / d_ms}
    prompts = read_prompts(SUITE)
    loops: dict[str, list[float]] = {}
    for p in prompts:
        out = generate(family, p["prompt"], "ar", max_tokens=args.max_tokens)
        loops.setdefault(p["category"], []).append(loop_share(out.token_ids))
    report |= {
        "greedy_loop_share": {c: float(np.mean(v)) for c, v in loops.items()},
        "greedy_loop_share_all": float(np.mean([x for v in loops.values() for x in v])),
        "loop_share_max_tokens": args.max_tokens,
        "tokens_per_target_forward": tokens_per_forward(family, prompts, args.forward_tokens),
        "forward_max_tokens": args.forward_tokens,
        "blas": blas_library() or "MLX bundled", "mlx": mx.__version__,
        "date": time.strftime("%Y-%m-%d"),
    }
    args.json.write_text(json.dumps(report, indent=2))
    print(json.dumps(report, indent=2))


if __name__ == "__main__":
    main()
