"""Prompt in, text out: prompt encoding, context checks and the detokenized stream.

A decoding strategy is a generator of committed token blocks (one block per target forward),
preceded by one empty block that marks the end of the prefill (so that generation speed
excludes prompt processing for every strategy alike).
`stream` turns any such generator into text segments and stops exactly where autoregressive
decoding would: at EOS, at a stop string, or at `max_tokens`, even inside a block.
"""

from __future__ import annotations

import time
import warnings
from itertools import groupby
from dataclasses import dataclass, field
from typing import Callable, Iterator, Optional, Sequence, Union

Prompt = Union[str, Sequence[int]]


def encode_prompt(tokenizer, prompt: Prompt) -> list[int]:
    """Token ids of a raw prompt string (no chat template, as in mlx_lm.generate) or ids."""
    if isinstance(prompt, str):
        bos = tokenizer.bos_token
        add_special = bos is None or not prompt.startswith(bos)
        ids = tokenizer.encode(prompt, add_special_tokens=add_special)
    else:
        ids = [int(t) for t in prompt]
    if not ids:
        raise ValueError("the prompt is empty")
    return ids


def chat_prompt(tokenizer, messages: list) -> str:
    """The tokenizer's chat template, or a plain 'role: content' transcript when it has none."""
    if not isinstance(messages, list) or not messages or not all(
            isinstance(m, dict) and isinstance(m.get("content"), str) and m.get("role")
            for m in messages):
        raise ValueError("'messages' must be a non-empty list of {role, content} objects")
    if getattr(tokenizer, "chat_template", None):
        return tokenizer.apply_chat_template(messages, tokenize=False, add_generation_prompt=True)
    return "".join(f"{m['role']}: {m['content']}\n" for m in messages) + "assistant: "


def check_context(prompt_len: int, max_tokens: int, context: int) -> int:
    """Refuse prompts past the context; shorten max_tokens to what still fits."""
    if prompt_len >= context:
        raise ValueError(f"the prompt has {prompt_len} tokens but the model's context is "
                         f"{context}: shorten the prompt")
    if prompt_len + max_tokens > context:
        fit = context - prompt_len
        warnings.warn(f"max_tokens {max_tokens} shortened to {fit} to fit the {context}-token context")
        return fit
    return max_tokens


@dataclass
class Response:
    """One streamed piece: new text, the tokens behind it, and running statistics."""
    text: str
    tokens: list[int]
    prompt_tokens: int
    generation_tokens: int
    steps: int
    prompt_tps: float
    generation_tps: float
    finish_reason: Optional[str] = None
    step_sizes: list[int] = field(default_factory=list)
    step_stats: list = field(default_factory=list)    # step.StepStats per step so far
    drafter_calls: int = 0                            # strong-drafter forwards so far
    # (text, source) runs that make up `text`: where its tokens came from (stream's `origin`)
    provenance: list[tuple[str, str]] = field(default_factory=list)

    @property
    def mean_accepted(self) -> float:
        return tokens_per_step(self.generation_tokens, self.steps)


def summary(last: Optional[Response], strategy: str) -> dict:
    """What a finished generation reports, from its last response: one set of figures for
    `engine.generate`'s result, `treegraft generate --json` and the server's usage."""
    return {"prompt_tokens": last.prompt_tokens if last else 0,
            "generation_tokens": last.generation_tokens if last else 0,
            "steps": last.steps if last else 0,
            "mean_accepted": last.mean_accepted if last else 0.0,
            "tokens_per_sec": last.generation_tps if last else 0.0,
            "drafter_calls": last.drafter_calls if last else 0, "strategy": strategy}


def tokens_per_step(tokens: int, steps: int) -> float:
    """Mean accepted length: the tokens after the prefill's first one, per target forward
    (exactly 1.0 for `ar`)."""
    return (tokens - 1) / steps if steps else 0.0


def stream(tokenizer, steps: Iterator[list[int]], prompt_len: int, max_tokens: int,
           stop_strings: Sequence[str] = (), t_start: Optional[float] = None,
           origin: Optional[Callable[[int], str]] = None) -> Iterator[Response]:
    """Detokenize committed blocks; stop at EOS / stop string / max_tokens inside a block.
    The first block is the prefill's token (its arrival is the time to first token); each
    later one is a step (`Response.steps`).

    Text that could still become the start of a stop string is held back until it cannot,
    so nothing from a stop string onwards is ever emitted. One string is one stop string (not
    one per character); an empty one would stop before any text and is refused.

    `origin(i)` names where the i-th token of the blocks came from (Decoder.sources); each
    response then carries its text's `provenance`, cut exactly where its text is.
    """
    t_start = t_start if t_start is not None else time.perf_counter()
    stop_strings = [stop_strings] if isinstance(stop_strings, str) else list(stop_strings)
    if not all(isinstance(s, str) and s for s in stop_strings):
        raise ValueError(f"stop strings must be non-empty strings, got {stop_strings!r}")
    eos = set(tokenizer.eos_token_ids)
    holdback = max((len(s) for s in stop_strings), default=1) - 1
    detok = tokenizer.detokenizer
    detok.reset()
    produced: list[int] = []
    sizes: list[int] = []
    text = _SourcedText(origin is not None)
    emitted, t_first, finish = 0, None, None
    if max_tokens <= 0:
        return

    def source() -> Optional[str]:
        """Where the last token produced came from (what its text is attributed to)."""
        return origin(len(produced) - 1) if origin is not None and produced else None

    def flush() -> None:
        """Text after the detokenizer's last bytes, cut at a stop string if one appeared."""
        detok.finalize()
        text.add(detok.last_segment, source())
        text.cut(_first_stop(text.chars, stop_strings, emitted))

    def response(upto: int, tokens: list[int], reason: Optional[str]) -> Response:
        return Response(
            text=text.chars[emitted:upto], tokens=tokens, prompt_tokens=prompt_len,
            generation_tokens=len(produced), steps=len(sizes),
            prompt_tps=prompt_len / max(t_first - t_start, 1e-9),
            generation_tps=len(produced) / max(time.perf_counter() - t_first, 1e-9),
            finish_reason=reason, step_sizes=list(sizes), provenance=text.runs(emitted, upto))

    for block in steps:
        if t_first is None:             # the prefill's token: the first token, not a step
            t_first = time.perf_counter()
        else:
            sizes.append(len(block))
        new_tokens: list[int] = []
        for tok in block:
            if tok in eos:
                finish = "stop"
                break
            detok.add_token(tok)
            produced.append(tok)
            new_tokens.append(tok)
            text.add(detok.last_segment, source())
            cut = _first_stop(text.chars, stop_strings, emitted)
            if cut is not None:
                text.cut(cut)
                finish = "stop"
                break
            if len(produced) >= max_tokens:
                finish = "length"
                break
        if finish is not None:
            flush()
        upto = len(text.chars) if finish else max(emitted, len(text.chars) - holdback)
        r = response(upto, new_tokens, finish)
        emitted = upto
        yield r
        if finish is not None:
            return
    # The steps ran out (a finite source): emit what was held back for stop strings.
    flush()
    if t_first is not None and len(text.chars) > emitted:
        yield response(len(text.chars), [], "stop")


class _SourcedText:
    """The text detokenized so far and, when tracked, the source of each of its characters
    (the token whose arrival released it), so that provenance is cut where the text is."""

    def __init__(self, tracked: bool):
        self.chars, self.tracked, self.owners = "", tracked, []

    def add(self, segment: str, source: Optional[str]) -> None:
        self.chars += segment
        if self.tracked:
            self.owners += [source] * len(segment)

    def cut(self, at: Optional[int]) -> None:
        """Drop everything from `at` on (None: nothing)."""
        if at is not None:
            self.chars, self.owners = self.chars[:at], self.owners[:at]

    def runs(self, lo: int, hi: int) -> list[tuple[str, str]]:
        """(text, source) runs of characters [lo, hi); empty when not tracked."""
        out: list[tuple[str, str]] = []
        if self.tracked:
            for src, group in groupby(self.owners[lo:hi]):
                n = len(list(group))
                out.append((self.chars[lo:lo + n], src))
                lo += n
        return out


def _first_stop(text: str, stops: Sequence[str], search_from: int) -> Optional[int]:
    """Where the earliest stop string starting at or after `search_from` begins."""
    hits = [i for i in (text.find(s, search_from) for s in stops) if i != -1]
    return min(hits) if hits else None
