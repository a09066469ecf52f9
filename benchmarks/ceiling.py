"""How far `treegraft` is from what its own drafts allow: an oracle replay of each step.

The oracle keeps every step's drafts and their drafting time as they ran, but verifies
exactly the path the target accepted (its rows priced by this device's measured step-cost
curve, probe.step_costs, at the step's context), and runs a step that accepted nothing as a
pipelined AR step. Its tokens per second over `ar`'s is the ceiling of what choosing the
verified subtree can reach with these drafts; `treegraft`'s measured speed over `ar`'s is
reported as a share of it. The small LM's chain forwards are not charged to the oracle (they
run queued beside the verification), so the ceiling is a little optimistic where chains are
accepted. Greedy only: the accepted path of a sampled step depends on the draws.

    python benchmarks/ceiling.py --prompts benchmarks/prompts/public.jsonl [--repeat 2] [--model DIR]
"""

from __future__ import annotations

import argparse

import numpy as np

import treegraft_mlx  # noqa: F401  (loads the system OpenBLAS first)
from treegraft_mlx import fixture_path, generate, load, probe
from treegraft_mlx.bench import first_per_category, read_prompts


def oracle_seconds(steps, costs, context: int) -> float:
    """The replay's time: each step's drafting as it ran, then the accepted path's rows (or
    an AR step where nothing was accepted)."""
    total = 0.0
    for st in steps:
        if st.accepted:
            total += st.t_draft + costs.step_ms(context)[st.accepted] / 1000
        else:
            total += costs.ar_ms / 1000
        context += st.accepted + 1
    return total


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--prompts", default="benchmarks/prompts/public.jsonl")
    parser.add_argument("--per-category", type=int, default=2)
    parser.add_argument("--max-tokens", type=int, default=128)
    parser.add_argument("--repeat", type=int, default=2)
    parser.add_argument("--strategy", default="treegraft")
    parser.add_argument("--model", default=None,
                        help="Bundle or model directory (default: the bundled tg-tiny family).")
    args = parser.parse_args()
    family = load(args.model or fixture_path())
    costs = probe.step_costs(family, family.tree)
    prompts = first_per_category(read_prompts(args.prompts), args.per_category)
    for p in prompts[:1]:                                   # warm-up
        generate(family, p["prompt"], args.strategy, max_tokens=16)
    seconds = {"ar": 0.0, args.strategy: 0.0, "oracle": 0.0}
    tokens = 0
    for _ in range(args.repeat):
        for p in prompts:
            ar = generate(family, p["prompt"], "ar", max_tokens=args.max_tokens)
            tg = generate(family, p["prompt"], args.strategy, max_tokens=args.max_tokens)
            assert tg.token_ids == ar.token_ids, p["id"]
            n = len(tg.token_ids)
            if not (ar.tokens_per_sec and tg.tokens_per_sec):
                continue                    # ended at its first token: no decoding to time
            tokens += n
            seconds["ar"] += n / ar.tokens_per_sec
            seconds[args.strategy] += n / tg.tokens_per_sec
            seconds["oracle"] += oracle_seconds(tg.step_stats, costs,
                                                tg.prompt_tokens + 1)
    speed = {k: tokens / v for k, v in seconds.items()}
    over = {k: v / speed["ar"] for k, v in speed.items()}
    print(f"{args.prompts}: ar {speed['ar']:.1f} tok/s; {args.strategy} {over[args.strategy]:.2f}x "
          f"ar; oracle ceiling {over['oracle']:.2f}x ar; share of the ceiling's gain "
          f"{(over[args.strategy] - 1) / max(over['oracle'] - 1, 1e-9):.0%}, of its speed "
          f"{over[args.strategy] / over['oracle']:.0%}")


if __name__ == "__main__":
    main()
