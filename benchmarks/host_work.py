"""Host work per verification step against the vocabulary size: the acceptance code on
synthetic logits, at tg-tiny's 8,192 tokens and the 151,936 of every Qwen target.

A step of 11 verified rows (an 8-node tree with a chain of 3) is accepted by the runtime's
code (verify.queue_verdict, read_back, verify.walk), greedy and sampled with top-p 0.9, a
sampled chain's q included, in both placements of the verdict: on the device (a GPU's; run
here by MLX's CPU kernels) and on the host (this CPU's: the rows read back whole, numpy).
Host time is what Python spends building the verdict's graph, finishing it and walking the
tree; the wait (the device computing, on this CPU the CPU itself) is reported beside it, as
is the step before the one-readback change, which read each visited node's row back and
worked on it in numpy (sampling.host_probs and an inverse-CDF draw).

With `--model`, a third case runs at that model's vocabulary on its own logits: the rows
of one forward over a code prompt's last tokens, each node's first child the row's argmax,
the sampled chain's q the model's processed distribution (real logits are peaked; the
synthetic ones are not, which changes what top-p keeps).

    python benchmarks/host_work.py [--repeat 50] [--model DIR]
"""

from __future__ import annotations

import argparse
import time

import mlx.core as mx
import numpy as np

import treegraft_mlx  # noqa: F401  (loads the system OpenBLAS first)
from treegraft_mlx.readback import read_back
from treegraft_mlx.sampling import SamplerSettings, host_probs
from treegraft_mlx.tree import STRONG, DraftTree
from treegraft_mlx import verify
from treegraft_mlx.verify import SampledDrafts, queue_verdict, walk

VOCABS = (8_192, 151_936)
REGIMES = {"greedy": SamplerSettings(), "sampled, top-p 0.9": SamplerSettings(temp=0.8, top_p=0.9)}


def case(vocab: int, rng: np.random.Generator):
    """An 8-node tree (root, a chain of 3 n-gram drafts with siblings), a sampled chain of 3
    from the root, and logits that mostly agree with the drafts."""
    tree = DraftTree.rooted_at(1)
    tokens = rng.integers(2, vocab, 16).tolist()
    a = tree.add(0, tokens[0], 0.0)
    b = tree.add(a, tokens[1], 0.0)
    tree.add(b, tokens[2], 0.0)
    for t in tokens[3:7]:
        tree.add(0, t, 0.0)
    n_tree, chain = len(tree), tokens[7:10]
    tree.append_chain(chain, STRONG, drawn=True)
    logits = rng.normal(0.0, 2.0, (len(tree), vocab)).astype(np.float32)
    for node in range(len(tree)):              # each row favours its first child's token
        kids = tree.children_of(node)
        if kids:
            logits[node, tree.token[kids[0]]] += 12.0
    q = rng.dirichlet(np.full(vocab, 0.05), 3).astype(np.float32)
    q[np.arange(3), chain] += 0.5
    q /= q.sum(1, keepdims=True)
    drafts = SampledDrafts([0] + list(range(n_tree, n_tree + 2)), mx.array(chain), mx.array(q))
    return tree, mx.array(logits), drafts


def model_case(path: str, rng: np.random.Generator):
    """`case`'s tree on a real model's logits (module docstring)."""
    from treegraft_mlx import load_model

    model, tok = load_model(path)
    ids = tok.encode("def quicksort(arr):\n    if len(arr) <= 1:\n        return arr\n"
                     "    pivot = arr[len(arr) // 2]\n    left = [x for x in arr if x < pivot]\n")
    logits = model(mx.array([ids]))[0, -11:].astype(mx.float32)
    best = np.array(logits.argmax(-1)).tolist()
    tree = DraftTree.rooted_at(ids[-11])
    a = tree.add(0, best[0], 0.0)
    b = tree.add(a, best[1], 0.0)
    tree.add(b, best[2], 0.0)
    for t in rng.integers(2, logits.shape[-1], 4).tolist():
        tree.add(0, int(t), 0.0)
    n_tree, chain = len(tree), best[:3]
    tree.append_chain(chain, STRONG, drawn=True)
    q = mx.softmax(logits[:3] / 0.8, axis=-1)
    drafts = SampledDrafts([0] + list(range(n_tree, n_tree + 2)), mx.array(chain), q)
    return tree, logits[:len(tree)], drafts


def one_readback(tree, logits, drafts, settings, seed) -> tuple[float, float, int]:
    """Host ms (building the verdict's graph, finishing and walking it), wait ms, nodes
    visited, for the placement verify.on_gpu picks."""
    t0 = time.perf_counter()
    verdict = queue_verdict(logits, settings, seed, None if settings.greedy else drafts)
    t1 = time.perf_counter()
    got = read_back(*verdict.parts)
    t2 = time.perf_counter()
    walked = walk(tree, verdict.finish(got), settings)
    t3 = time.perf_counter()
    return 1000 * (t1 - t0 + t3 - t2), 1000 * (t2 - t1), len(walked.acceptance.path)


def row_per_node(tree, logits, settings, rng) -> tuple[float, int]:
    """The step before: every visited node's row read back and processed on the host."""
    mx.eval(logits)
    t0 = time.perf_counter()
    node, visited = 0, 1
    while True:
        p = host_probs(np.array(logits[node].astype(mx.float32)), settings)
        c = np.cumsum(p)
        y = int(min(np.searchsorted(c, rng.random() * c[-1], side="right"), len(p) - 1))
        nxt = tree.child(node, y)
        if nxt < 0:
            return 1000 * (time.perf_counter() - t0), visited
        node, visited = nxt, visited + 1


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--repeat", type=int, default=50)
    parser.add_argument("--model", default=None, help="add a case on this model's logits")
    args = parser.parse_args()
    rng = np.random.default_rng(0)
    cases = [(f"{v:,}", *case(v, rng)) for v in VOCABS]
    if args.model:
        tree, logits, drafts = model_case(args.model, rng)
        cases.append((f"{logits.shape[-1]:,} (real logits)", tree, logits, drafts))
    print("| vocabulary | regime | verdict placement | host ms a step | wait ms a step "
          "| nodes visited | before: host ms a step (a row per visited node) |")
    print("|---|---|---|---|---|---|---|")
    for vocab, tree, logits, drafts in cases:
        mx.eval(logits, drafts.q)
        for name, settings in REGIMES.items():
            old = [row_per_node(tree, logits, settings, rng) for _ in range(args.repeat + 3)]
            before, old_visited = np.median(np.array(old[3:]), axis=0)
            for placement, gpu in (("device (a GPU's)", True), ("host (this CPU's)", False)):
                verify.on_gpu = lambda: gpu
                new = [one_readback(tree, logits, drafts, settings, i)
                       for i in range(args.repeat + 3)][3:]   # warm-up: first graphs
                host, wait, visited = np.median(np.array(new), axis=0)
                print(f"| {vocab} | {name} | {placement} | {host:.3f} | {wait:.2f} "
                      f"| {visited:.0f} | {before:.2f} ({old_visited:.0f} nodes) |")


if __name__ == "__main__":
    main()
