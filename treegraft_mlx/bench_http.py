"""Concurrent requests benchmarked over HTTP: `treegraft serve` one request at a time
(`--max-batch 1`), `treegraft serve` batching (its default) and `mlx_lm.server` (which batches
plain decoding), each its own process on loopback, on the same weights.

The in-process bench (bench_concurrency.py) times the engines; this one times what a client
sees: the HTTP handling, the JSON and the server-sent events of every token are in it, and so
is the server's scheduling (admission, the queue). N client threads each send their next
streaming completion when their last is answered (bench_concurrency's closed loop); the
servers take turns, the order flipping from one (repeat, concurrency) to the next, so drift
spreads evenly. All three servers are started first and wait idle while another is timed. A
request's tokens are its server's usage count; its text is what greedy runs are checked on
(against the one-at-a-time server's `ar`).
"""

from __future__ import annotations

import http.client
import json
import shutil
import socket
import subprocess
import sys
import tempfile
import threading
import time
from concurrent.futures import ThreadPoolExecutor
from contextlib import ExitStack, contextmanager
from pathlib import Path
from typing import Iterator, Optional

import mlx.core as mx

from .bench_concurrency import Served
from .sampling import SamplerSettings

HTTP_ENGINES = ("serial_http", "batch_http", "mlx_lm_server")
READY_S = 300          # a server loads its model (and measures its costs on first use)


# `mlx_lm.server` with the BLAS ours gets (blas.py: on Linux MLX's wheel otherwise runs its
# bundled reference BLAS, several times slower), so the two servers run the same arithmetic.
MLX_LM_SERVER = ("from treegraft_mlx import blas; blas.preload_openblas(); import sys; "
                 "sys.argv[0] = 'mlx_lm.server'; from mlx_lm.server import main; main()")


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def in_dtype(target: Path, dtype, dest: Path) -> Path:
    """`target` with its floating weights cast to `dtype` in `dest` (everything else copied),
    for `mlx_lm.server`, which computes in the stored dtype: ours casts to this device's
    compute dtype (fp32 on a CPU), and the two must run the same arithmetic. `target` itself
    where it is stored in `dtype` already."""
    files = sorted(target.glob("*.safetensors"))
    weights = {f: mx.load(str(f)) for f in files}
    if all(w.dtype == dtype for ws in weights.values() for w in ws.values()
           if mx.issubdtype(w.dtype, mx.floating)):
        return target
    for f in target.iterdir():
        if f.is_file() and f.suffix != ".safetensors":
            shutil.copy2(f, dest / f.name)
    for f, ws in weights.items():
        mx.save_safetensors(str(dest / f.name), {
            k: v.astype(dtype) if mx.issubdtype(v.dtype, mx.floating) else v
            for k, v in ws.items()}, metadata={"format": "mlx"})
    return dest


def commands(model: Optional[str], target: Path, port: int) -> dict:
    """The command line of each engine's server on `port`. `mlx_lm.server` keeps no prompt
    cache (size 0): the bench sends every prompt at every concurrency, and ours reuses nothing
    across requests, so a cache would time its prefills on the second pass only."""
    ours = [sys.executable, "-c", "from treegraft_mlx.cli import main; main()", "serve",
            "--port", str(port), "--max-queue", "64"] + (["--model", model] if model else [])
    return {"serial_http": ours + ["--max-batch", "1"], "batch_http": ours,
            "mlx_lm_server": [sys.executable, "-c", MLX_LM_SERVER, "--model", str(target),
                              "--port", str(port), "--log-level", "WARNING",
                              "--prompt-cache-size", "0"]}


@contextmanager
def server(command: list[str], port: int) -> Iterator[int]:
    """A server process, ready (its /v1/models answers), stopped on exit; yields its port."""
    log = tempfile.TemporaryFile()      # not a pipe: a chatty server would fill it and block
    proc = subprocess.Popen(command, stdout=subprocess.DEVNULL, stderr=log)
    try:
        deadline = time.monotonic() + READY_S
        while not answers(port):
            if proc.poll() is not None:
                log.seek(0)
                raise RuntimeError(f"{' '.join(command)} exited: "
                                   f"{log.read().decode(errors='replace')[-2000:]}")
            if time.monotonic() > deadline:
                raise RuntimeError(f"{' '.join(command)} not ready after {READY_S} s")
            time.sleep(0.2)
        yield port
    finally:
        proc.terminate()
        try:
            proc.wait(timeout=30)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait()
        log.close()


def answers(port: int) -> bool:
    try:
        conn = http.client.HTTPConnection("127.0.0.1", port, timeout=2)
        conn.request("GET", "/v1/models")
        ok = conn.getresponse().status == 200
        conn.close()
        return ok
    except OSError:
        return False


def completion(port: int, body: dict, t0: float) -> tuple[str, int, float, float]:
    """One streamed completion: its text, its token count (the final usage), and the times
    (seconds from `t0`) of its first text and its last event."""
    conn = http.client.HTTPConnection("127.0.0.1", port, timeout=600)
    conn.request("POST", "/v1/completions", json.dumps(body),
                 {"Content-Type": "application/json"})
    resp = conn.getresponse()
    if resp.status != 200:
        raise RuntimeError(f"HTTP {resp.status}: {resp.read()[:500]!r}")
    text, count, first, last = [], 0, None, None
    for line in resp:
        if not line.startswith(b"data: ") or line.strip() == b"data: [DONE]":
            continue
        event, now = json.loads(line[6:]), time.perf_counter() - t0
        piece = "".join(c.get("text") or "" for c in event.get("choices", []))
        if piece:
            text.append(piece)
            first = first if first is not None else now
        if event.get("usage"):
            count = event["usage"]["completion_tokens"]
        last = now
    conn.close()
    return "".join(text), count, first if first is not None else last, last


def clients(port: int, prompts: list[dict], n: int, body: dict
            ) -> list[tuple[str, int, float, float, float]]:
    """The prompts sent by `n` client threads, each sending the next unsent prompt when its
    last is answered: per prompt, its text, token count, and when it was sent, its first text
    and its last event (seconds from the start)."""
    t0, lock, todo = time.perf_counter(), threading.Lock(), iter(range(len(prompts)))
    out: list = [None] * len(prompts)

    def client() -> None:
        while True:
            with lock:
                i = next(todo, None)
            if i is None:
                return
            sent = time.perf_counter() - t0
            text, count, first, last = completion(
                port, {**body, "prompt": prompts[i]["prompt"]}, t0)
            out[i] = (text, count, sent, first, last)

    with ThreadPoolExecutor(n) as pool:
        for f in [pool.submit(client) for _ in range(n)]:
            f.result()          # a failed request fails the bench
    return out


def body_for(engine: str, strategy: str, max_tokens: int, settings: SamplerSettings,
             seed: int) -> dict:
    """The request: streamed, with usage; our servers get the strategy and a seed (a seed
    makes `mlx_lm.server` decode that request alone, so it gets none)."""
    body = {"max_tokens": max_tokens, "temperature": settings.temp, "top_p": settings.top_p,
            "stream": True, "stream_options": {"include_usage": True}}
    if settings.top_k:
        body["top_k"] = settings.top_k
    if settings.min_p:
        body["min_p"] = settings.min_p
    if engine != "mlx_lm_server":
        body.update(strategy=strategy, seed=seed)
    return body


def run_http(model: Optional[str], target: Path, dtype, prompts: list[dict],
             strategies: list[str], levels: list[int], max_tokens: int, repeat: int = 1,
             settings: SamplerSettings = SamplerSettings(), seed: int = 0,
             progress=None) -> list[Served]:
    """Every (repeat, concurrency, engine, strategy) over all prompts, as
    bench_concurrency.run_concurrency, over HTTP; `mlx_lm.server` runs the target's weights
    in our compute `dtype`. A first short run warms every server up."""
    jobs = [(e, s) for e in HTTP_ENGINES for s in (strategies if e != "mlx_lm_server" else ["ar"])]
    with ExitStack() as stack:
        copy = Path(stack.enter_context(tempfile.TemporaryDirectory(prefix="treegraft-http-")))
        weights, ports = in_dtype(target, dtype, copy), {}
        for e in HTTP_ENGINES:
            port = free_port()
            ports[e] = stack.enter_context(server(commands(model, weights, port)[e], port))
        for e, s in jobs:
            clients(ports[e], prompts[:2], 2, body_for(e, s, 8, settings, seed))
        out: list[Served] = []
        for r in range(repeat):
            for k, n in enumerate(levels):
                for e, s in (jobs[::-1] if (r + k) % 2 else jobs):
                    body = body_for(e, s, max_tokens, settings, seed)
                    for p, (text, count, sent, first, last) in zip(
                            prompts, clients(ports[e], prompts, n, body)):
                        out.append(Served(e, s, n, r, p["id"], [], sent, first, last, text,
                                          count))
                if progress:
                    progress(len(jobs))
    return out


def check_greedy_text(served: list[Served], engines=("serial_http", "batch_http")
                      ) -> list[str]:
    """The texts of `engines` must equal the one-at-a-time server's `ar` for the same prompt
    (`mlx_lm.server`'s are counted, not failed: its padded batches round differently)."""
    ref = {s.prompt_id: s.text for s in served
           if (s.engine, s.strategy) == ("serial_http", "ar")}
    return [f"{s.engine} {s.strategy} x{s.concurrency} on {s.prompt_id}" for s in served
            if s.engine in engines and s.prompt_id in ref and s.text != ref[s.prompt_id]]
