"""Concurrent requests benchmarked: N requests arrive at once, served one at a time (the serial
server), decoded together (our batch, what `treegraft serve` runs), and by `mlx_lm`'s
BatchGenerator (what its server batches with) on the same weights.

The prompts are split into waves of N; a wave's requests all arrive when the wave starts and
the next wave starts when it is done. Per engine and concurrency: aggregate generation tokens
per second (every wave's tokens over the waves' wall time), tokens per second of each
request (its tokens after the first over the time from its first token to its last) and
time to first token (from the wave's start: a request served serially waits for the ones
before it). In process, without HTTP, so the figures are the engines'. Under greedy decoding
every engine's tokens are checked against our serial `ar`.
"""

from __future__ import annotations

import time
from dataclasses import asdict, dataclass
from typing import Callable, Optional

import mlx.core as mx

from .batch import Batch, lane
from .engine import stream_generate
from .family import Family
from .sampling import SamplerSettings

ENGINES = ("serial", "batch", "mlx_lm_batch")


@dataclass
class Served:
    """One request's output and times (seconds from its wave's start)."""

    engine: str
    strategy: str
    concurrency: int
    repeat: int
    wave: int
    prompt_id: str
    tokens: list[int]     # its tokens (over HTTP: none, the server counts them)
    first: float          # its first token
    last: float           # its last token
    text: Optional[str] = None     # over HTTP: what it streamed
    count: Optional[int] = None    # over HTTP: its tokens, as the server's usage counts them

    @property
    def generated(self) -> int:
        return self.count if self.count is not None else len(self.tokens)

    @property
    def tokens_per_sec(self) -> Optional[float]:
        """None for a request that ended at its first token (nothing to time)."""
        if self.generated < 2 or self.last <= self.first:
            return None
        return (self.generated - 1) / (self.last - self.first)


def serial(family: Family, prompts: list[dict], strategy: str, max_tokens: int,
           settings: SamplerSettings, seed: int) -> list[tuple[list[int], float, float]]:
    """One wave served one request at a time: (tokens, first, last) each."""
    t0, out = time.perf_counter(), []
    for p in prompts:
        tokens, first = [], None
        for r in stream_generate(family, p["prompt"], strategy, max_tokens=max_tokens,
                                 settings=settings, seed=seed):
            first = first or time.perf_counter() - t0
            tokens += r.tokens
        out.append((tokens, first, time.perf_counter() - t0))
    return out


def together(family: Family, prompts: list[dict], strategy: str, max_tokens: int,
             settings: SamplerSettings, seed: int) -> list[tuple[list[int], float, float]]:
    """One wave decoded together in one batch."""
    t0, batch = time.perf_counter(), Batch(family)
    got = [[[], None, None] for _ in prompts]
    for i, p in enumerate(prompts):
        batch.add(lane(family, p["prompt"], strategy, max_tokens, seed, settings=settings,
                       tag=i, pool=batch.pool))
    while batch.lanes:
        for one, r in batch.step():
            if isinstance(r, Exception):
                raise r
            row, now = got[one.tag], time.perf_counter() - t0
            row[0] += r.tokens
            row[1], row[2] = row[1] or now, now
    return [tuple(row) for row in got]


def mlx_lm_batch(family: Family) -> Callable:
    """A wave through `mlx_lm`'s BatchGenerator on the family's target weights, in the same
    compute dtype; the strategy is ignored (it decodes plainly)."""
    import mlx_lm
    from mlx_lm.generate import BatchGenerator
    from mlx_lm.sample_utils import make_sampler

    model, _ = mlx_lm.load(str(family.model_paths["target"]))
    model.set_dtype(family.target.model.norm.weight.dtype)

    def run(family: Family, prompts: list[dict], strategy: str, max_tokens: int,
            settings: SamplerSettings, seed: int):
        mx.random.seed(seed)
        sampler = make_sampler(temp=settings.temp, top_p=settings.top_p, min_p=settings.min_p,
                               top_k=settings.top_k)
        eos = family.tokenizer.eos_token_ids
        gen = BatchGenerator(model, max_tokens=max_tokens, sampler=sampler,
                             stop_tokens=[[t] for t in eos])
        t0 = time.perf_counter()
        uids = gen.insert([family.tokenizer.encode(p["prompt"]) for p in prompts],
                          [max_tokens] * len(prompts))
        got = {u: [[], None, None] for u in uids}
        while responses := gen.next_generated():
            now = time.perf_counter() - t0
            for r in responses:
                row = got[r.uid]
                if r.finish_reason != "stop":      # a stop's token is the EOS
                    row[0].append(r.token)
                row[1], row[2] = row[1] or now, now
        gen.close()
        return [tuple(got[u]) for u in uids]

    return run


def run_concurrency(family: Family, prompts: list[dict], strategies: list[str],
                    levels: list[int], max_tokens: int, repeat: int = 1,
                    settings: SamplerSettings = SamplerSettings(), seed: int = 0,
                    engines: tuple = ENGINES,
                    progress: Optional[Callable[[int], None]] = None) -> list[Served]:
    """Every (repeat, concurrency, engine, strategy) over all prompts, in waves: each wave
    runs on every engine before the next, in an order that flips from wave to wave. `mlx_lm_batch` runs once per concurrency (plain
    decoding has no strategy). A first wave warms every engine up unmeasured."""
    runners = {"serial": serial, "batch": together}
    if "mlx_lm_batch" in engines:
        runners["mlx_lm_batch"] = mlx_lm_batch(family)
    jobs = [(e, s) for e in engines for s in (strategies if e != "mlx_lm_batch" else ["ar"])]
    for e, s in jobs:
        runners[e](family, prompts[:2], s, 8, settings, seed)
    out: list[Served] = []
    for r in range(repeat):
        for n in levels:
            for w in range(0, len(prompts), n):     # every engine on a wave, then the next:
                wave = prompts[w:w + n]              # drift over a run spreads evenly
                flip = (r + w // n) % 2
                for e, s in (jobs[::-1] if flip else jobs):
                    for p, (tokens, first, last) in zip(
                            wave, runners[e](family, wave, s, max_tokens, settings, seed)):
                        out.append(Served(e, s, n, r, w // n, p["id"], tokens, first, last))
            if progress:
                progress(len(jobs))
    return out


def summarize(served: list[Served], levels: list[int]) -> list[dict]:
    """Per (engine, strategy, concurrency): aggregate tokens/s, mean per-request tokens/s (of
    the requests that made more than one token) and mean time to first token, over all
    repeats."""
    rows = []
    keys = sorted({(s.engine, s.strategy) for s in served})
    for e, strat in keys:
        for n in levels:
            mine = [s for s in served if (s.engine, s.strategy, s.concurrency) == (e, strat, n)]
            if not mine:
                continue
            waves: dict = {}
            for s in mine:      # a wave's wall time is its last request's last token
                waves[s.repeat, s.wave] = max(waves.get((s.repeat, s.wave), 0.0), s.last)
            tokens = sum(s.generated for s in mine)
            rates = [s.tokens_per_sec for s in mine if s.tokens_per_sec is not None]
            rows.append({"engine": e, "strategy": strat, "concurrency": n,
                         "aggregate_tps": tokens / sum(waves.values()),
                         "request_tps": sum(rates) / max(1, len(rates)),
                         "ttft_s": sum(s.first for s in mine) / len(mine),
                         "requests": len(mine)})
    return rows


def check_greedy(served: list[Served], engines=("serial", "batch")) -> list[str]:
    """Every run of `engines` must equal serial `ar`'s tokens for the same prompt (mlx_lm's
    padded batches round differently: its differences are counted, not failed)."""
    ref = {s.prompt_id: s.tokens for s in served if (s.engine, s.strategy) == ("serial", "ar")}
    return [f"{s.engine} {s.strategy} x{s.concurrency} on {s.prompt_id}" for s in served
            if s.engine in engines and s.prompt_id in ref and s.tokens != ref[s.prompt_id]]


def as_json(served: list[Served]) -> list[dict]:
    return [{**asdict(s), "tokens_per_sec": s.tokens_per_sec} for s in served]
