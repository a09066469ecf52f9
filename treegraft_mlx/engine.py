"""The public API: load a family (measuring this device's costs once), then stream or
generate with any strategy (decoder.py); output is exactly the target's.

Mean accepted length := generated tokens after the first / target forwards (tokens per step).
"""

from __future__ import annotations

import contextlib
import dataclasses
import os
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Callable, Iterator, Optional, Sequence, Union

import numpy as np

from . import device, probe
from .decoder import Decoder
from .step import StepStats
from .strategy import Strategy, for_family, needs_costs, needs_timing, parse_strategy
from .family import Family, TreeConfig, drafters_off, load_family
from .generate import Prompt, Response, check_context, encode_prompt, stream, summary
from .pairing import choose_models, model_dir
from .sampling import SamplerSettings
from .scheduler import Schedule
from .session import Session
from .waits import Waits

@dataclass
class GenerationResult:
    """A finished generation: its text and tokens, and what its decoding did (generate.summary
    figures, the finish reason, every step's statistics)."""

    text: str
    token_ids: list[int]
    prompt_tokens: int
    steps: int
    mean_accepted: float
    tokens_per_sec: float
    strategy: str
    drafter_calls: int
    finish_reason: Optional[str]
    step_stats: list[StepStats] = field(default_factory=list)
    time_to_first_token: float = 0.0      # seconds from the call to the first token

    @property
    def generation_tokens(self) -> int:
        return len(self.token_ids)


def stream_generate(family: Family, prompt: Prompt, strategy: str = "treegraft",
                    max_tokens: int = 256, temp: float = 0.0, top_p: float = 1.0,
                    top_k: int = 0, min_p: float = 0.0, seed: Optional[int] = None,
                    stop: Sequence[str] = (), tree: Optional[TreeConfig] = None,
                    session: Optional[Session] = None, schedule: Optional[Schedule] = None,
                    trace: Optional[bool] = None,
                    settings: Optional[SamplerSettings] = None,
                    provenance: bool = False) -> Iterator[Response]:
    """Stream a generation with any strategy; output is exactly the target's.

    `prompt` is a raw string (no chat template) or token ids. Sampling: `temp`, `top_p`,
    `top_k`, `min_p`, or all of them as one `settings` (then leave those at their defaults).
    `session` keeps the caches between calls (chat turns reuse the shared prefix). `schedule` replaces the strategy's
    layer schedule (tree strategies). `trace` (default: the TREEGRAFT_TRACE environment
    variable) prints every step's decisions to stderr. Each response carries the running
    step statistics and strong-drafter calls; with `provenance`, also where each character
    of its text came from (Decoder.sources; the chat page's colours). Off by default: the
    per-character bookkeeping cost our `ar` 2.7% in an A/B in one process.
    """
    device.warn_if_slow_blas()
    tracer = tracing(trace)
    decoder, ids, max_tokens = prepare(family, prompt, strategy, max_tokens, seed, tree,
                                       session, schedule, tracer, settings,
                                       SamplerSettings(temp, top_p, top_k, min_p))
    t0 = time.perf_counter()
    with device.wired_limit(), (tracer.waits if tracer else contextlib.nullcontext()):
        for r in stream(family.tokenizer, decoder.steps(ids), len(ids), max_tokens, stop, t0,
                        origin=origin_of(decoder, provenance)):
            yield dataclasses.replace(r, step_stats=decoder.stats,
                                      drafter_calls=decoder.drafter_calls)


def prepare(family: Family, prompt: Prompt, strategy: str, max_tokens: int,
            seed: Optional[int], tree: Optional[TreeConfig], session: Optional[Session],
            schedule: Optional[Schedule], trace: Optional[Callable[[str], None]],
            settings: Optional[SamplerSettings], loose: SamplerSettings,
            together: bool = False) -> tuple[Decoder, list[int], int]:
    """A generation's decoder, prompt ids and max_tokens (held to the context), as
    stream_generate takes them (`loose`: the sampler settings given one by one); decoding
    `together` for a batch (batch.py)."""
    if settings is not None and loose != SamplerSettings():
        raise ValueError("give the sampling settings either as `settings` or one by one, not both")
    settings = settings or loose
    session = session or Session(family, tree)
    strat = parse_strategy(strategy, session.tree.depth)
    ids = encode_prompt(family.tokenizer, prompt)
    context = family.target.args.max_position_embeddings
    # Drafts are verified past the last token: leave room for one full tree path.
    max_tokens = check_context(len(ids), max_tokens, context - session.tree.depth - 1)
    decoder = make_decoder(session, strat, settings, np.random.default_rng(seed), schedule,
                           trace, together)
    return decoder, ids, max_tokens


def origin_of(decoder: Decoder, provenance: bool) -> Optional[Callable[[int], str]]:
    """Where the i-th token came from, for stream's `origin`, with `provenance`."""
    return (lambda i: decoder.sources[i]) if provenance else None


def make_decoder(session: Session, strategy: Strategy, settings: SamplerSettings,
                 rng: np.random.Generator, schedule: Optional[Schedule] = None,
                 trace: Optional[Callable[[str], None]] = None,
                 together: bool = False) -> Decoder:
    """A decoder with what this device measured that the strategy needs (probe.py)."""
    family, tree = session.family, session.tree
    strategy = for_family(strategy, session.strong is not None, session.mtp is not None)
    costs = probe.step_costs(family, tree) if needs_costs(strategy, tree) else None
    timing = (probe.scheduler_timing(family, tree)
              if needs_timing(strategy, session, settings, schedule) else None)
    return Decoder(session, strategy, settings, rng, schedule, costs, timing, trace, together)


class StepTrace:
    """Trace lines on stderr, each with the host's waits on the device and the bytes they
    read back since the line before (one step's, for a step's line): counted while `waits`
    is active, which stream_generate keeps on while tracing."""

    def __init__(self):
        self.waits = Waits()
        self._last = (0, 0)

    def __call__(self, line: str) -> None:
        count, nbytes = self.waits.snapshot()
        print(f"{line} | waits {count - self._last[0]}, read {nbytes - self._last[1]} B",
              file=sys.stderr)
        self._last = (count, nbytes)


def tracing(trace: Optional[bool]) -> Optional[StepTrace]:
    """Where trace lines go: stderr when asked (or TREEGRAFT_TRACE=1), else nowhere."""
    on = os.environ.get("TREEGRAFT_TRACE", "") not in ("", "0") if trace is None else trace
    return StepTrace() if on else None


def generate(family: Family, prompt: Prompt, strategy: str = "treegraft", **kwargs) -> GenerationResult:
    """Whole generation with statistics (see stream_generate for the arguments)."""
    text, ids, last = "", [], None
    for r in stream_generate(family, prompt, strategy, **kwargs):
        text += r.text
        ids += r.tokens
        last = r
    figures = summary(last, strategy)
    del figures["generation_tokens"]                  # len(token_ids)
    return GenerationResult(
        text=text, token_ids=ids, **figures, finish_reason=last.finish_reason if last else None,
        step_stats=last.step_stats if last else [],
        time_to_first_token=last.prompt_tokens / last.prompt_tps if last else 0.0)


def load(target_path_or_bundle: Union[str, Path], drafters: Union[Sequence, str] = (),
         tree: Optional[TreeConfig] = None, warmup: bool = True, autotune: bool = True,
         pipeline: bool = False, revision: Optional[str] = None,
         **model_kwargs) -> Optional[Family]:
    """Load a family (family.load_family) and, with `warmup`, measure what this device's steps
    cost (and, with a strong drafter, what a call of it costs) unless cached, so the first
    generation does not pay for it: seconds, once per model pair and device. Without
    `autotune` nothing is measured: steps verify the bundle's fixed tree (budget, pad).
    With `pipeline` (under mlx.launch) the target is split over the ranks (pipeline.py); on
    ranks other than 0 this serves rank 0 until it stops and returns None. A Hub repo id is
    downloaded on first use (`revision` pins it), a GGUF converted once (pairing.model_dir);
    drafters="auto" picks the strong drafter
    (pairing.py) and prints one line on what it picked; drafters="none" loads none, a
    bundle's own included (the n-gram drafter alone serves)."""
    if drafters == "auto":
        models = choose_models(target_path_or_bundle, (), revision,
                               log=lambda line: print(line, file=sys.stderr))
        target_path_or_bundle, drafters = models.target, models.drafters
    else:
        target_path_or_bundle = model_dir(target_path_or_bundle, revision)
        if not isinstance(drafters, str) and not drafters_off(drafters):
            drafters = [model_dir(d) for d in drafters]
    if pipeline:
        from .pipeline import start

        family = start(target_path_or_bundle, drafters, tree, **model_kwargs)
        if family is None:
            return None
    else:
        family = load_family(target_path_or_bundle, drafters, tree, **model_kwargs)
    if not autotune:
        family.tree = dataclasses.replace(family.tree, adaptive=False)
    elif warmup:
        warm_up(family)
    return family


def warm_up(family: Family) -> None:
    """Measure what this device's steps cost (and, with a strong drafter, what a call of it
    costs) unless cached: what `load` does with `warmup`, for a caller that first checks the
    family (a command refuses a strategy the family cannot run before seconds of
    measuring)."""
    probe.step_costs(family, family.tree)
    if family.strong is not None:
        probe.scheduler_timing(family, family.tree)

