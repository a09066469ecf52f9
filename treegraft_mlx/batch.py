"""Several requests decoded together: one target forward and one readback a step for all of
them, each request accepting, committing and streaming its own tokens.

Each request is a Lane: its own Session (cache, history, drafters), its Decoder run
`together` (decoder.py) and its stream (generate.stream: EOS, stop strings, max_tokens). A
step sizes the lanes' trees together (pricing.plan_jointly), runs every lane's rows (a
prefill chunk, an AR row, a tree) in one packed forward (packed.py), reads every lane's
verdict back in one wait, hands each lane its values, and streams what each committed. A lane
alone in the batch decodes exactly as a request alone (pipelined), and switches at the step
another joins. A lane leaves at the step after its stream ends or its caller cancels it; a
lane whose decoding fails leaves with its error, and the others go on (docs/design.md §23).
"""

from __future__ import annotations

import dataclasses
import time
from collections import deque
from dataclasses import dataclass, field
from typing import Any, Iterator, Optional, Sequence

from .decoder import Decoder
from .engine import origin_of, prepare
from .family import Family, TreeConfig
from .generate import Prompt, Response, stream
from .kernels import backend
from .packed import refusal, run_together
from .parts import Read, RequestBlock, run_alone
from .pricing import Candidate, Company, plan_jointly
from .readback import read_back
from .sampling import SamplerSettings
from .session import Session
from .slots import SlotCache, SlotPool


PACE_EMA = 0.1    # how fast a lane's tokens a step and the batch's step time follow change


class Inbox:
    """The committed blocks a lane's stream reads, handed over one step at a time."""

    def __init__(self):
        self.blocks: deque = deque()

    def __iter__(self) -> "Inbox":
        return self

    def __next__(self) -> list[int]:
        return self.blocks.popleft()


@dataclass
class Lane:
    """One request in a batch: its decoder, what its decoding wants now (a tree offered to
    the joint plan, a RequestBlock, a Read or a committed block), and its stream."""

    decoder: Decoder
    wants: Iterator[Any]                 # decoder.steps(ids), decoding together
    responses: Iterator[Response]        # its stream, fed from `inbox`
    inbox: Inbox
    want: Any = None
    last: Optional[Response] = None      # the last response streamed
    error: Optional[Exception] = None    # why its decoding failed, if it did
    cancelled: bool = False
    tag: Any = None                      # the caller's (the server's job)
    pace: float = 1.0                    # tokens it commits a step (a moving average)
    streamed: bool = False               # its block streamed this step: it goes on next step

    @property
    def done(self) -> bool:
        return (self.cancelled or self.error is not None or
                (self.last is not None and self.last.finish_reason is not None))

    def send(self, value: Any) -> None:
        """Hand the decoding what it asked for; keep what it asks next (or its error)."""
        try:
            self.want = self.wants.send(value)
        except Exception as e:     # this request's failure, not the batch's
            self.error = e

    def close(self) -> None:
        self.wants.close()
        self.responses.close()


def lane(family: Family, prompt: Prompt, strategy: str = "treegraft", max_tokens: int = 256,
         seed: Optional[int] = None, stop: Sequence[str] = (),
         settings: Optional[SamplerSettings] = None, provenance: bool = False,
         tree: Optional[TreeConfig] = None, tag: Any = None,
         pool: Optional[SlotPool] = None) -> Lane:
    """A request for a batch, as stream_generate takes it (a fresh session of its own, its
    cache a slot of `pool` where given: the slot is given back if the request is refused)."""
    session = Session(family, tree, pool)
    try:
        decoder, ids, max_tokens = prepare(family, prompt, strategy, max_tokens, seed, tree,
                                           session, None, None, settings, SamplerSettings(),
                                           together=True)
    except Exception:
        if pool is not None:
            pool.give(session.cache)
        raise
    inbox = Inbox()
    responses = stream(family.tokenizer, inbox, len(ids), max_tokens, stop, time.perf_counter(),
                       origin=origin_of(decoder, provenance))
    new = Lane(decoder, decoder.steps(ids), responses, inbox, tag=tag)
    new.send(None)
    return new


@dataclass
class Batch:
    """The lanes decoding together on `family`'s target, and what their forwards ran."""

    family: Family
    lanes: list[Lane] = field(default_factory=list)
    pooled: Optional[bool] = None     # lanes' caches slots of one pool (None: on a GPU)
    pool: Optional[SlotPool] = field(default=None, init=False)   # the lanes' caches (slots.py)
    forwards: int = 0          # target forwards this batch ran
    rows: int = 0              # rows they ran, all lanes together
    lanes_run: int = 0         # lanes they ran, summed over forwards
    step_ms: float = 0.0       # wall time a step (a moving average; 0 before a second step)
    _began: Optional[float] = None    # when the last step began

    def __post_init__(self):
        why = refusal(self.family.target)
        if why:
            raise ValueError(f"this target cannot decode requests together: {why}")
        # On a GPU the pool saves a dispatch per request and layer (one write, one attention
        # call); on this CPU it measured slower than a cache per request (RESULTS.md).
        pooled = backend() != "cpu" if self.pooled is None else self.pooled
        self.pool = self.family.target.slot_pool() if pooled else None

    def add(self, new: Lane) -> None:
        """A lane joins (made by `lane` with this batch's `pool`, so that its rows attend
        together with the others')."""
        self.lanes.append(new)

    def step(self) -> list[tuple[Lane, Any]]:
        """One forward for every lane that wants one, one readback; returns each lane's new
        response, or the exception its decoding raised (a cancelled lane returns nothing),
        and drops the lanes that are done. A failure of the shared forward is raised.

        A lane alone in the batch decodes as a request alone does (pipelined: its generator
        runs its own forwards and yields committed blocks); with company, together. A lane
        whose block streamed goes on to its next want at the start of the next step, not at
        the end of this one: alone, that want is its next token, read after a forward, and
        the block just committed would reach the caller a forward late."""
        self._drop()
        self._clock()
        for one in self.lanes:
            one.decoder.together = len(self.lanes) > 1
        for one in [one for one in self.lanes if one.streamed]:
            one.streamed = False          # on to its next want, planned knowing its company
            one.decoder.company = self._company(one)
            one.send(None)
        self._size()
        if any(isinstance(one.want, RequestBlock) for one in self.lanes):
            self._forward()
        if any(isinstance(one.want, Read) for one in self.lanes):
            self._read()
        out = []
        for one in self.lanes:
            if isinstance(one.want, list) and not one.done:
                one.pace += PACE_EMA * (len(one.want) - one.pace)
                one.inbox.blocks.append(one.want)
                r = self._response(one)
                if r is not None:
                    one.last = r
                    out.append((one, r))
                one.streamed = not one.done
        out += [(one, one.error) for one in self.lanes if one.error is not None]
        self._drop()
        return out

    def _clock(self) -> None:
        """The step time's moving average, from one step's start to the next's."""
        now = time.perf_counter()
        if self._began is not None:
            ms = 1000 * (now - self._began)
            self.step_ms = ms if self.step_ms == 0 else self.step_ms + PACE_EMA * (
                ms - self.step_ms)
        self._began = now

    def _company(self, one: Lane) -> Optional[Company]:
        """What `one` shares its forward with: the other lanes' tokens a step, the step's
        time (None before a step was timed: the lane then plans as alone would)."""
        if self.step_ms == 0:
            return None
        return Company(sum(o.pace for o in self.lanes if o is not one), self.step_ms)

    def _size(self) -> None:
        """The trees the lanes offer, sized together around the other lanes' blocks
        (pricing.plan_jointly)."""
        offers = [one for one in self.lanes if isinstance(one.want, Candidate)]
        if not offers:
            return
        fixed = sum(one.want.rows for one in self.lanes if isinstance(one.want, RequestBlock))
        for one, plan in zip(offers, plan_jointly([one.want for one in offers], fixed)):
            one.send(plan)

    def _forward(self) -> None:
        lanes = [one for one in self.lanes if isinstance(one.want, RequestBlock)]
        blocks = [one.want for one in lanes]
        target = self.family.target
        ran = ([run_alone(target, blocks[0])] if len(blocks) == 1
               else run_together(target, blocks))
        self.forwards, self.lanes_run = self.forwards + 1, self.lanes_run + len(blocks)
        self.rows += sum(b.rows for b in blocks)
        for one, r in zip(lanes, ran):
            one.send(r)

    def _read(self) -> None:
        """Every lane's Read in one wait (a lane between prefill chunks reads nothing)."""
        reading = [one for one in self.lanes if isinstance(one.want, Read) and not one.done]
        parts = [p for one in reading for p in one.want.parts]
        got = read_back(*parts) if parts else []
        at = 0
        for one in reading:
            n = len(one.want.parts)
            one.send(got[at:at + n])
            at += n

    def _response(self, one: Lane) -> Optional[Response]:
        try:
            r = next(one.responses)
        except Exception as e:
            one.error = e
            return None
        return dataclasses.replace(r, step_stats=one.decoder.stats,
                                   drafter_calls=one.decoder.drafter_calls)

    def _drop(self) -> None:
        for one in [one for one in self.lanes if one.done]:
            one.close()
            cache = one.decoder.session.cache
            if isinstance(cache, SlotCache) and cache.pool is self.pool:
                self.pool.give(cache)        # its slot is free for the next request
        self.lanes = [one for one in self.lanes if not one.done]


def decode_together(family: Family, requests: Sequence[dict],
                    starts: Optional[Sequence[int]] = None,
                    pooled: Optional[bool] = None) -> list[list[Response]]:
    """Each request (`lane`'s keyword arguments) decoded in one batch (`pooled` as Batch
    takes it), request i joining at step starts[i] (default: all at once); returns each
    request's responses."""
    starts = list(starts) if starts is not None else [0] * len(requests)
    if len(starts) != len(requests):
        raise ValueError("give one start step per request")
    batch = Batch(family, pooled=pooled)
    waiting = sorted(range(len(requests)), key=lambda i: starts[i])
    out: list[list[Response]] = [[] for _ in requests]
    step = 0
    while waiting or batch.lanes:
        while waiting and starts[waiting[0]] <= step:
            i = waiting.pop(0)
            batch.add(lane(family, **requests[i], tag=i, pool=batch.pool))
        for one, r in batch.step():
            if isinstance(r, Exception):
                raise r
            out[one.tag].append(r)
        step += 1
    return out
