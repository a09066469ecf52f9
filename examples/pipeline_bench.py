"""treegraft vs ar vs chain with the target split over local ranks, and what the same steps
would cost over real links (computed, not measured).

    mlx.launch -n 2 --backend ring -- python examples/pipeline_bench.py [--prompts 4] [--tokens 64]

Rank 0 prints, per strategy: tokens/s, target forwards (steps) per token, and its time inside
exchanges (which includes waiting for the other ranks' layers). A ping-pong of a hidden-state
sized message measures one hop on this link. A step's forward crosses `ranks` hops in sequence
(rank 0 -> ... -> last -> rank 0), so at a per-hop latency L a strategy's time per token
becomes: measured time per token + steps per token x ranks x (L - measured hop). The figures
at 0.05-0.1 ms (Thunderbolt-like) and 0.3-1 ms (Ethernet-like) are computed that way.
"""

from __future__ import annotations

import treegraft_mlx  # noqa: F401  first: it loads the system BLAS before mlx (blas.py)

import time

import click
import mlx.core as mx

from treegraft_mlx import fixture_path, generate, load
from treegraft_mlx.bench import first_per_category, read_prompts

SUITE = "benchmarks/prompts/public.jsonl"
HOPS_MS = (0.05, 0.1, 0.3, 1.0)


def hop_ms(hidden: int, rounds: int = 50) -> float:
    """One hop's latency for a one-row hidden state, from a ping-pong between ranks 0 and 1
    (run by every rank before the family loads; other ranks return at once)."""
    group = mx.distributed.init(strict=True)
    x = mx.zeros((1, 1, hidden))
    t0 = time.perf_counter()
    for _ in range(rounds):
        if group.rank() == 0:
            mx.eval(mx.distributed.send(x, 1))
            mx.eval(mx.distributed.recv(x.shape, x.dtype, 1))
        elif group.rank() == 1:
            mx.eval(mx.distributed.recv(x.shape, x.dtype, 0))
            mx.eval(mx.distributed.send(x, 0))
    return (time.perf_counter() - t0) * 1000 / (2 * rounds)


@click.command()
@click.option("--prompts", default=4, show_default=True)
@click.option("--tokens", default=64, show_default=True)
@click.option("--strategies", default="ar,chain,treegraft", show_default=True)
def main(prompts: int, tokens: int, strategies: str) -> None:
    hop = hop_ms(hidden=384)  # tg-tiny's hidden size
    family = load(fixture_path(), pipeline=True)
    if family is None:
        return
    link, ranks = family.target.link, family.target.link.size

    suite = first_per_category(read_prompts(SUITE), max(1, prompts // 4))[:prompts]
    rows = {}
    for strategy in strategies.split(","):
        generate(family, suite[0]["prompt"], strategy, max_tokens=8)  # warm-up
        wall = comm = 0.0
        made = steps = 0
        for p in suite:
            before = link.comm_s
            t0 = time.perf_counter()
            r = generate(family, p["prompt"], strategy, max_tokens=tokens)
            wall += time.perf_counter() - t0
            comm += link.comm_s - before
            made += len(r.token_ids)
            steps += r.steps
        rows[strategy] = (wall / made * 1000, steps / made, comm / made * 1000)
    print(f"{ranks} ranks on one machine, one hop {hop:.3f} ms (measured, loopback)")
    print("| strategy | ms/token | steps/token | exchange ms/token | "
          + " | ".join(f"ms/token at {h} ms/hop" for h in HOPS_MS) + " |")
    print("|---" * (4 + len(HOPS_MS)) + "|")
    for s, (ms, per, ex) in rows.items():
        computed = [ms + per * ranks * (h - hop) for h in HOPS_MS]
        print(f"| {s} | {ms:.1f} | {per:.2f} | {ex:.1f} | "
              + " | ".join(f"{c:.1f}" for c in computed) + " |")
    base = rows.get("ar")
    if base:
        for s, (ms, per, _) in rows.items():
            ratios = [(base[0] + base[1] * ranks * (h - hop)) / (ms + per * ranks * (h - hop))
                      for h in HOPS_MS]
            print(f"{s} vs ar: measured {base[0] / ms:.2f}x; computed "
                  + ", ".join(f"{r:.2f}x at {h} ms" for r, h in zip(ratios, HOPS_MS)))


if __name__ == "__main__":
    main()
