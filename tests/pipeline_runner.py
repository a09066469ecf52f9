"""Run by tests/test_pipeline.py under `mlx.launch` (one process per rank): the bundled family
with its target split over the ranks. Modes: `generate` (rank 0 prints the token ids of every
case as one JSON line), `die` (rank 2 ends itself mid-generation), `hang` (rank 1 stops
answering mid-generation, its connections open), `nofit` (every host reports 1 MiB free),
`disagree` (the ranks compare different values)."""

import itertools
import json
import os
import sys
import threading
import time

import treegraft_mlx  # first: it loads the system BLAS before mlx
import treegraft_mlx.device
import mlx.core as mx
from treegraft_mlx import fixture_path, generate, load
from treegraft_mlx.pipeline import Link, PipelineError

PROMPTS = ["import os\n\n\ndef walk(root):\n"]
CASES = [("ar", 0.0), ("ngram", 0.0), ("treegraft", 0.0), ("ar", 0.7), ("treegraft", 0.7)]


def cases(family) -> dict:
    """Token ids per (prompt, strategy, temperature); sampled with a fixed seed."""
    return {f"{i}|{s}|{t}": generate(family, p, s, max_tokens=20, temp=t, top_p=0.95,
                                     seed=3).token_ids
            for i, p in enumerate(PROMPTS) for s, t in CASES}


def hang_after(sends: int) -> None:
    """This rank sends `sends` messages, then waits forever without a word."""
    real, count = Link.send, itertools.count()

    def send(self, *args, **kwargs):
        if next(count) >= sends:
            time.sleep(3600)
        real(self, *args, **kwargs)

    Link.send = send


def main(mode: str) -> None:
    rank = mx.distributed.init(strict=True).rank()
    try:
        if mode == "disagree":
            Link(mx.distributed.init()).agree(f"value of rank {rank}", "a test value")
            return
        if mode == "die" and rank == 2:  # vanishes without a word (exit code 0, so that
            threading.Timer(6.0, os._exit, [0]).start()  # mlx.launch does not end the others)
        if mode == "hang" and rank == 1:
            hang_after(sends=5)
        if mode == "nofit":
            treegraft_mlx.device.available_memory = lambda: 2**20
        family = load(fixture_path(), pipeline=True, warmup=False, autotune=False)
        if family is None:
            return
        if mode in ("die", "hang"):
            generate(family, PROMPTS[0], "ar", max_tokens=100_000)
        print(json.dumps(cases(family)), flush=True)
    except PipelineError as e:
        print(f"PipelineError: {e}", flush=True)
        sys.exit(1)


if __name__ == "__main__":
    main(sys.argv[1])
