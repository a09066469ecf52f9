"""Measure the numbers of the fixture family's model card, on this machine, with this runtime.

  - held-out loss (nats/token) of each model on the held-out stdlib modules
  - drafter-vs-target greedy next-token agreement on held-out code (teacher forced)
  - one-token forward latency (fp32, 64 tokens of context) of each model, and their ratio
  - the target's greedy loop share on the public prompt suite, per category

    python examples/evaluate_family.py --json treegraft_mlx/fixtures/tg-tiny/evaluation.json
"""

from __future__ import annotations

import argparse
import json
import statistics
import sysconfig
import time
from pathlib import Path

import mlx.core as mx
import numpy as np

from treegraft_mlx import fixture_path, generate, load
from treegraft_mlx.bench import loop_share, read_prompts
from treegraft_mlx.device import blas_library

SUITE = Path(__file__).resolve().parents[1] / "benchmarks/prompts/public.jsonl"


def heldout_ids(tokenizer, family_dir: Path) -> list[list[int]]:
    split = json.loads((family_dir / "split.json").read_text())
    root = Path(sysconfig.get_paths()["stdlib"])
    docs = []
    for module in split["heldout"]:
        path = root.joinpath(*module.split(".")).with_suffix(".py")
        text = path.read_text(encoding="utf-8")
        docs.append(tokenizer.encode(text) + [tokenizer.eos_token_id])
    return docs


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


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--json", type=Path, required=True)
    ap.add_argument("--max-tokens", type=int, default=128)
    args = ap.parse_args()
    family_dir = fixture_path()
    family = load(family_dir)
    drafter = family.strong
    docs = heldout_ids(family.tokenizer, family_dir)
    loss_t, loss_d, agreement = loss_and_agreement(family.target, drafter, docs)
    t_ms, d_ms = one_token_ms(family.target), one_token_ms(drafter)
    loops: dict[str, list[float]] = {}
    for p in read_prompts(SUITE):
        out = generate(family, p["prompt"], "ar", max_tokens=args.max_tokens)
        loops.setdefault(p["category"], []).append(loop_share(out.token_ids))
    report = {
        "heldout_loss_target": loss_t, "heldout_loss_drafter": loss_d,
        "greedy_agreement_drafter_vs_target": agreement,
        "one_token_ms_target": t_ms, "one_token_ms_drafter": d_ms,
        "latency_ratio_target_over_drafter": t_ms / d_ms,
        "greedy_loop_share": {c: float(np.mean(v)) for c, v in loops.items()},
        "greedy_loop_share_all": float(np.mean([x for v in loops.values() for x in v])),
        "loop_share_max_tokens": args.max_tokens,
        "blas": blas_library() or "MLX bundled", "mlx": mx.__version__,
        "date": time.strftime("%Y-%m-%d"),
    }
    args.json.write_text(json.dumps(report, indent=2))
    print(json.dumps(report, indent=2))


if __name__ == "__main__":
    main()
