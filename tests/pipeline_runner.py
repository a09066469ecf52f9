"""Run by tests/test_pipeline.py under `mlx.launch` (one process per rank): the bundled family
with its target split over the ranks. Modes: `generate` (rank 0 prints the token ids of every
case as one JSON line), `adaptive` (the same with per-step sizing on scripted step costs and
clock), `die` (rank 2 ends itself mid-generation), `hang` (rank 1 stops answering
mid-generation, its connections open), `idle` (rank 0 stops sending after one generation),
`nofit` (every host reports 1 MiB free), `disagree` (the ranks compare different values)."""

import itertools
import json
import os
import sys
import time

import treegraft_mlx  # first: it loads the system BLAS before mlx
import treegraft_mlx.device
import mlx.core as mx
from scripted import ScriptedClock, scripted_step_costs
from treegraft_mlx import fixture_path, generate, load, probe
from treegraft_mlx.pipeline import Link, PipelineError
from treegraft_mlx.session import Session

PROMPTS = ["import os\n\n\ndef walk(root):\n"]
CASES = [("ar", 0.0), ("ngram", 0.0), ("treegraft", 0.0), ("ar", 0.7), ("treegraft", 0.7)]


def cases(family) -> dict:
    """Token ids and rows verified per step for each (prompt, strategy, temperature),
    sampled with a fixed seed; and two turns of one session, the second reusing the first's
    cache (every rank's slice)."""
    out = {}
    for i, p in enumerate(PROMPTS):
        for s, t in CASES:
            res = generate(family, p, s, max_tokens=20, temp=t, top_p=0.95, seed=3)
            out[f"{i}|{s}|{t}"] = res.token_ids
            out[f"{i}|{s}|{t}|rows"] = [step.rows for step in res.step_stats]
    session = Session(family)
    first = generate(family, PROMPTS[0], "treegraft", max_tokens=12, session=session)
    second = generate(family, PROMPTS[0] + first.text + "\n\ndef size(path):\n", "treegraft",
                      max_tokens=12, session=session)
    out["session"] = [first.token_ids, second.token_ids]
    return out


def adaptive(family):
    """The family sizing every step on scripted step costs and clock, so that its
    decisions (and a sampled run's random stream) repeat exactly."""
    family.clock = ScriptedClock()
    return family


def after_sends(sends: int, then) -> None:
    """This rank sends `sends` messages, then calls `then()` instead of the next one."""
    real, count = Link.send, itertools.count()

    def send(self, *args, **kwargs):
        if next(count) >= sends:
            then()
        real(self, *args, **kwargs)

    Link.send = send


def main(mode: str) -> None:
    rank = mx.distributed.init(strict=True).rank()
    try:
        if mode == "disagree":
            Link(mx.distributed.init()).agree(f"value of rank {rank}", "a test value")
            return
        if mode == "die" and rank == 2:  # vanishes without a word mid-generation (exit code
            after_sends(5, lambda: os._exit(0))  # 0, so that mlx.launch does not end the others)
        if mode == "hang" and rank == 1:
            after_sends(5, lambda: time.sleep(3600))
        if mode == "nofit":
            treegraft_mlx.device.available_memory = lambda: 2**20
        if mode == "adaptive":
            probe.measure_step_costs = scripted_step_costs
        family = load(fixture_path(), pipeline=True, warmup=False,
                      autotune=mode == "adaptive")
        if family is None:
            return
        if mode in ("die", "hang"):
            generate(family, PROMPTS[0], "ar", max_tokens=100_000)
        if mode == "idle":
            generate(family, PROMPTS[0], "ar", max_tokens=4)
            time.sleep(3600)             # the other ranks' idle deadline ends them
        if mode == "adaptive":
            adaptive(family)
        print(json.dumps(cases(family)), flush=True)
    except PipelineError as e:
        print(f"PipelineError: {e}", flush=True)
        sys.exit(1)


if __name__ == "__main__":
    main(sys.argv[1])
