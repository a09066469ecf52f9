"""Verification latency of a small mixture of experts against a dense model of equal active size.

A tree's rows route to different experts, so verifying n rows reads up to n x top_k experts'
weights where a dense model reads its one MLP: the MoE's cost grows faster with the block.
Both models here have random weights and the same attention; the MoE has E experts of half
the dense MLP's width, 2 active per token (equal active parameters). Prints the latency per
block size and its ratio to one row, as the step-cost probe measures it for tree sizing:

    python examples/moe_latency.py [--experts 8] [--hidden 512] [--layers 4]
"""

from __future__ import annotations

import treegraft_mlx  # noqa: F401  first: it loads the system BLAS before mlx (blas.py)

import click
import mlx.core as mx
from treegraft_mlx.models import build_model, model_args
from treegraft_mlx.timing import verification_latency

SIZES = (1, 2, 4, 8, 16, 32)


def model(config: dict):
    m = build_model(model_args(config))
    mx.eval(m.parameters())
    return m


@click.command()
@click.option("--experts", default=8, show_default=True)
@click.option("--hidden", default=512, show_default=True)
@click.option("--layers", default=4, show_default=True)
@click.option("--repeats", default=7, show_default=True)
def main(experts: int, hidden: int, layers: int, repeats: int) -> None:
    base = dict(hidden_size=hidden, num_hidden_layers=layers, num_attention_heads=8,
                num_key_value_heads=2, vocab_size=8192, max_position_embeddings=2048,
                tie_word_embeddings=True)
    dense = model({**base, "model_type": "qwen3", "intermediate_size": 3 * hidden})
    moe = model({**base, "model_type": "qwen3_moe", "intermediate_size": 3 * hidden,
                 "moe_intermediate_size": 3 * hidden // 2, "num_experts": experts,
                 "num_experts_per_tok": 2})
    curves = {name: verification_latency(m, sizes=SIZES, repeats=repeats)
              for name, m in (("dense", dense), (f"moe-{experts}x2", moe))}
    print("| rows | " + " | ".join(f"{n} ms | {n} / 1 row" for n in curves) + " |")
    print("|---|" + "---|---|" * len(curves))
    for n in SIZES:
        cells = " | ".join(f"{c[n]:.1f} | {c[n] / c[1]:.2f}x" for c in curves.values())
        print(f"| {n} | {cells} |")


if __name__ == "__main__":
    main()
