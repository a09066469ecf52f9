"""Concurrent requests benchmarked: N clients, each sending its next request when its last is
answered, served one at a time (the serial server), decoded together (our batch, what
`treegraft serve` runs), and by `mlx_lm`'s BatchGenerator (what its server batches with) on the
same weights.

A closed loop: N requests start at once and each finished request's client sends the next
prompt, so a batch engine keeps N requests in flight until the prompts run out (a request
that ends early is replaced at once, as with real clients, instead of leaving its batch short
until the slowest request of a wave ends). Per engine and N: aggregate generation tokens per
second (all tokens over the run's wall time), tokens per second of each request (its tokens
after the first over the time from its first token to its last) and time to first token
(from the moment its client sent it: a request served serially waits for the ones before
it). In process, without HTTP, so the figures are the engines'. Under greedy decoding every
engine's tokens are checked against our serial `ar`.
"""

from __future__ import annotations

import time
from collections import deque
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
    """One request's output and times (seconds from its run's start)."""

    engine: str
    strategy: str
    concurrency: int
    repeat: int
    prompt_id: str
    tokens: list[int]     # its tokens (over HTTP: none, the server counts them)
    sent: float           # its client sent it
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


Timed = tuple   # (tokens, sent, first, last) of one request, seconds from the run's start


def serial(family: Family, prompts: list[dict], clients: int, strategy: str, max_tokens: int,
           settings: SamplerSettings, seed: int) -> list[Timed]:
    """The prompts served one at a time, in order, to `clients` clients: request i is sent
    when request i - clients is answered (at the start for the first `clients`)."""
    t0, out = time.perf_counter(), []
    for i, p in enumerate(prompts):
        sent = out[i - clients][3] if i >= clients else 0.0
        tokens, first = [], None
        for r in stream_generate(family, p["prompt"], strategy, max_tokens=max_tokens,
                                 settings=settings, seed=seed):
            first = first or time.perf_counter() - t0
            tokens += r.tokens
        out.append((tokens, sent, first, time.perf_counter() - t0))
    return out


def together(family: Family, prompts: list[dict], clients: int, strategy: str,
             max_tokens: int, settings: SamplerSettings, seed: int) -> list[Timed]:
    """The prompts decoded in one batch of at most `clients` lanes: each lane that ends is
    replaced by the next prompt at once."""
    t0, batch = time.perf_counter(), Batch(family)
    waiting, got = deque(enumerate(prompts)), {}

    def admit() -> None:
        while waiting and len(batch.lanes) < clients:
            i, p = waiting.popleft()
            got[i] = [[], time.perf_counter() - t0, None, None]
            batch.add(lane(family, p["prompt"], strategy, max_tokens, seed, settings=settings,
                           tag=i, pool=batch.pool))

    admit()
    while batch.lanes:
        for one, r in batch.step():
            if isinstance(r, Exception):
                raise r
            row, now = got[one.tag], time.perf_counter() - t0
            row[0] += r.tokens
            row[2], row[3] = row[2] or now, now
        admit()
    return [tuple(got[i]) for i in range(len(prompts))]


def mlx_lm_batch(family: Family) -> Callable:
    """A run through `mlx_lm`'s BatchGenerator on the family's target weights, in the same
    compute dtype, each finished request replaced by the next prompt at once (as `together`);
    the strategy is ignored (it decodes plainly)."""
    import mlx_lm
    from mlx_lm.generate import BatchGenerator
    from mlx_lm.sample_utils import make_sampler

    model, _ = mlx_lm.load(str(family.model_paths["target"]))
    model.set_dtype(family.target.model.norm.weight.dtype)

    def run(family: Family, prompts: list[dict], clients: int, strategy: str,
            max_tokens: int, settings: SamplerSettings, seed: int) -> list[Timed]:
        mx.random.seed(seed)
        sampler = make_sampler(temp=settings.temp, top_p=settings.top_p, min_p=settings.min_p,
                               top_k=settings.top_k)
        eos = family.tokenizer.eos_token_ids
        gen = BatchGenerator(model, max_tokens=max_tokens, sampler=sampler,
                             stop_tokens=[[t] for t in eos])
        t0, waiting, got, of = time.perf_counter(), deque(enumerate(prompts)), {}, {}
        finished = 0                              # requests that ended

        def admit() -> None:
            while waiting and len(got) - finished < clients:
                i, p = waiting.popleft()
                got[i] = [[], time.perf_counter() - t0, None, None]
                uid, = gen.insert([family.tokenizer.encode(p["prompt"])], [max_tokens])
                of[uid] = i

        admit()
        while responses := gen.next_generated():
            now = time.perf_counter() - t0
            for r in responses:
                row = got[of[r.uid]]
                if r.finish_reason != "stop":      # a stop's token is the EOS
                    row[0].append(r.token)
                row[2], row[3] = row[2] or now, now
                finished += r.finish_reason is not None
            admit()
        gen.close()
        return [tuple(got[i]) for i in range(len(prompts))]

    return run


def run_concurrency(family: Family, prompts: list[dict], strategies: list[str],
                    levels: list[int], max_tokens: int, repeat: int = 1,
                    settings: SamplerSettings = SamplerSettings(), seed: int = 0,
                    engines: tuple = ENGINES,
                    progress: Optional[Callable[[int], None]] = None) -> list[Served]:
    """Every (repeat, concurrency, engine, strategy) over all prompts, as `levels` clients
    send them; the engines' order flips from one (repeat, concurrency) to the next, so drift
    spreads evenly. `mlx_lm_batch` runs once per concurrency (plain decoding has no
    strategy). A first short run warms every engine up unmeasured."""
    runners = {"serial": serial, "batch": together}
    if "mlx_lm_batch" in engines:
        runners["mlx_lm_batch"] = mlx_lm_batch(family)
    jobs = [(e, s) for e in engines for s in (strategies if e != "mlx_lm_batch" else ["ar"])]
    for e, s in jobs:
        runners[e](family, prompts[:2], 2, s, 8, settings, seed)
    out: list[Served] = []
    for r in range(repeat):
        for k, n in enumerate(levels):
            for e, s in (jobs[::-1] if (r + k) % 2 else jobs):
                for p, (tokens, sent, first, last) in zip(
                        prompts, runners[e](family, prompts, n, s, max_tokens, settings, seed)):
                    out.append(Served(e, s, n, r, p["id"], tokens, sent, first, last))
            if progress:
                progress(len(jobs))
    return out


def summarize(served: list[Served], levels: list[int]) -> list[dict]:
    """Per (engine, strategy, concurrency): aggregate tokens/s (every run's tokens over the
    runs' wall times, a run ending at its last token), mean per-request tokens/s (of the
    requests that made more than one token) and mean time to first token (from sending),
    over all repeats."""
    rows = []
    keys = sorted({(s.engine, s.strategy) for s in served})
    for e, strat in keys:
        for n in levels:
            mine = [s for s in served if (s.engine, s.strategy, s.concurrency) == (e, strat, n)]
            if not mine:
                continue
            runs: dict = {}
            for s in mine:
                runs[s.repeat] = max(runs.get(s.repeat, 0.0), s.last)
            tokens = sum(s.generated for s in mine)
            rates = [s.tokens_per_sec for s in mine if s.tokens_per_sec is not None]
            rows.append({"engine": e, "strategy": strat, "concurrency": n,
                         "aggregate_tps": tokens / sum(runs.values()),
                         "request_tps": sum(rates) / max(1, len(rates)),
                         "ttft_s": sum(s.first - s.sent for s in mine) / len(mine),
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
