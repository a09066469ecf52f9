"""Where a batch's time goes: the device's share against the host's, alone and at N requests.

Decoding is timed through the batch (bench_concurrency.together, a closed loop of N lanes)
inside waits.Waits, which times every MLX readback and every mx.async_eval. On MLX's CPU
backend a graph is computed inside those calls (async_eval blocks until all but a few ops
are done), so the run splits into the device's share and the host's (building graphs,
sizing, accepting, streaming). Tokens over the device's share alone is the rate with the
host's work free or hidden behind the device: the ceiling of what removing host cost gives.
Beside it, the ceiling the forward's own curve sets on trees sharing one: a request
verifying k rows alone against N requests verifying k each in one forward of N*k rows,
N * c(k) / c(N*k), measured here (timing.verification_latency).

    python benchmarks/batch_profile.py [--lanes 1,4] [--temp 1.0] [--per-category 2]
"""

from __future__ import annotations

import argparse
import time
from pathlib import Path

import treegraft_mlx  # noqa: F401  (loads the system OpenBLAS first)
from treegraft_mlx import fixture_path, load
from treegraft_mlx.bench import first_per_category, read_prompts
from treegraft_mlx.bench_concurrency import together
from treegraft_mlx.sampling import SamplerSettings
from treegraft_mlx.timing import verification_latency
from treegraft_mlx.waits import Waits

PROMPTS = Path(__file__).parent / "prompts/public.jsonl"


def profile(family, prompts, lanes: int, strategy: str, max_tokens: int,
            settings: SamplerSettings) -> dict:
    """One closed-loop run: tokens, wall seconds, the device's seconds, waits."""
    with Waits() as waits:
        t0 = time.perf_counter()
        out = together(family, prompts, lanes, strategy, max_tokens, settings, seed=0)
        wall = time.perf_counter() - t0
    tokens = sum(len(timed[0]) for timed in out)
    return {"tokens": tokens, "wall": wall, "device": waits.seconds + waits.queueing,
            "waits": waits.count}


def curve_ceiling(family, lanes: int) -> None:
    """Prints N * c(k) / c(N*k) for k = 1, 2, 4, 8 from one measurement of the curve."""
    sizes = sorted({k * n for k in (1, 2, 4, 8) for n in (1, lanes)})
    c = verification_latency(family.target, sizes=tuple(sizes))
    print(f"\nthe forward's curve: {lanes} requests of k rows in one forward against one alone")
    for k in (1, 2, 4, 8):
        print(f"  k={k}: c({k}) {c[k]:.1f} ms, c({lanes * k}) {c[lanes * k]:.1f} ms, "
              f"ceiling {lanes * c[k] / c[lanes * k]:.2f}x")


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--strategies", default="ar,ngram,treegraft")
    ap.add_argument("--lanes", default="1,4")
    ap.add_argument("--per-category", type=int, default=2)
    ap.add_argument("--max-tokens", type=int, default=128)
    ap.add_argument("--temp", type=float, default=0.0)
    ap.add_argument("--repeat", type=int, default=2)
    args = ap.parse_args()
    family = load(fixture_path())
    prompts = first_per_category(read_prompts(PROMPTS), args.per_category)
    settings = SamplerSettings(temp=args.temp)
    lanes = [int(n) for n in args.lanes.split(",")]
    together(family, prompts[:2], 2, "treegraft", 16, settings, seed=0)   # warm-up
    print(f"{'strategy':<10} {'lanes':>5} {'tokens/s':>9} {'waits/s':>8} {'host ms/wait':>13} "
          f"{'device share':>13} {'tokens/s if host free':>22}")
    for _ in range(args.repeat):       # repeats alternate, so drift falls on every row alike
        for strategy in args.strategies.split(","):
            for n in lanes:
                r = profile(family, prompts, n, strategy, args.max_tokens, settings)
                host = r["wall"] - r["device"]
                print(f"{strategy:<10} {n:>5} {r['tokens'] / r['wall']:>9.1f} "
                      f"{r['waits'] / r['wall']:>8.1f} {1000 * host / r['waits']:>13.2f} "
                      f"{r['device'] / r['wall']:>13.0%} {r['tokens'] / r['device']:>22.1f}",
                      flush=True)
    curve_ceiling(family, max(lanes))


if __name__ == "__main__":
    main()
