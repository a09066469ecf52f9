"""OpenAI-compatible HTTP server: /v1/models, /v1/completions, /v1/chat/completions, the
browser chat page at / (page.py), /treegraft/config and /treegraft/status for it, and
/health (no key) for a launcher waiting on the model.

Built on the standard library's ThreadingHTTPServer, like mlx_lm's own server: no extra
dependency, well kept with CPython, and enough for one local user or app. Connections are
served concurrently; generations run on one worker thread (one model, one device): up to
`max_batch` decoded together (batch.py: one forward a step for all of them; a request joins
at the next step and leaves at the step after it ends), and at most `max_queue` more wait
for a place (more get 503). Errors come back as
OpenAI-style JSON with the right status code; an oversized body is read and dropped (up to a
cap) so that even a client that sends all of it before reading gets its 413. A client that
goes away mid-stream ends its generation at the next step.
"""

from __future__ import annotations

import hmac
import ipaddress
import json
import math
import queue
import socket
import threading
import time
import traceback
import uuid
from collections import Counter
from contextlib import closing
from dataclasses import dataclass, field
from http import HTTPStatus
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from typing import Iterator, Optional
from urllib.parse import urlsplit

from .batch import Batch, lane
from .engine import stream_generate
from .packed import refusal
from .strategy import STRATEGY_NAMES, for_family, parse_strategy
from .family import Family
from .generate import Response, chat_prompt, summary
from .page import load_assets
from .sampling import SamplerSettings

DEFAULT_MAX_TOKENS = 256
RETRY_AFTER_S = 1            # what a 503 asks a client to wait before it tries again
DRAIN_CHUNK = 1 << 16        # bytes read at a time from a body that is dropped
LINGER_S = 2.0               # how long a connection closed on a client still sending drains
GENERATE_ROUTES = ("/v1/completions", "/v1/chat/completions")


@dataclass(frozen=True)
class ServerConfig:
    model_id: str = "tg-tiny"
    strategy: str = "treegraft"
    max_tokens_limit: int = 2048
    max_body_bytes: int = 1 << 20
    max_queue: int = 16                 # requests that may wait while others generate
    max_batch: int = 4                  # requests decoded together (one forward a step)
    timeout: float = 60.0               # seconds a connection may stall (request or reply)
    api_key: Optional[str] = None       # /v1/* and /treegraft/* need "Bearer <api_key>"
    drain_bytes: int = 64 << 20         # an oversized body up to this is read before the 413
    note: Optional[str] = None          # a line the page shows beside the model's name


class RequestError(Exception):
    def __init__(self, status: HTTPStatus, message: str, kind: str = "invalid_request_error",
                 headers: Optional[dict[str, str]] = None):
        super().__init__(message)
        self.status, self.message, self.kind = status, message, kind
        self.headers = headers or {}


@dataclass
class Served:
    """What the server has generated: each running generation's last response, and totals
    over the finished ones (`finished`: how many ended by each finish reason, "disconnected"
    where the client went away, "error" where generation failed), and what the forwards of
    requests decoded together ran."""

    live: dict = field(default_factory=dict)     # Job -> its last response (None: none yet)
    forwards: int = 0                            # target forwards of the batch
    rows: int = 0                                # rows they ran, all requests together
    steps: int = 0
    tokens: int = 0
    finished: Counter = field(default_factory=Counter)
    last: Optional[dict] = None          # the last finished generation's reason, tokens, steps


@dataclass(eq=False)     # a job is itself: Served.live keys on it
class Job:
    """One generation handed to the worker thread; its pieces come back on `out` (then an
    exception, if it failed, and END), and `cancelled` stops it at its next step."""

    prompt: str
    params: dict
    out: queue.SimpleQueue = field(default_factory=queue.SimpleQueue)
    cancelled: threading.Event = field(default_factory=threading.Event)


END = object()    # the last item of a Job's `out`


class Generator:
    """Validates requests and runs them on the family, up to `max_batch` together, on one
    worker thread, with at most `max_queue` more waiting for a place; counts what it served
    (status). With `max_batch` 1, or a target that cannot decode requests together (a
    pipeline), one at a time, each decoded alone (stream_generate).

    One long-lived thread generates because the compute libraries keep native state per
    calling thread: generating on the handler's thread (a new one per connection) grew the
    process by about 50 KB a request, measured; one thread does not grow."""

    def __init__(self, family: Family, config: ServerConfig):
        self.family, self.config = family, config
        self.jobs: queue.SimpleQueue = queue.SimpleQueue()   # Jobs, then None to stop
        self.changed = threading.Condition()    # guards the counts below; notified on change
        self.admitted = 0                       # jobs handed over and not finished
        self.served = Served()
        self.together = config.max_batch > 1 and refusal(family.target) is None
        self.stopping = threading.Event()       # close(): every generation ends at its next step
        self.worker = threading.Thread(target=self._work, name="treegraft-generate", daemon=True)
        self.worker.start()

    def parameters(self, body: dict) -> dict:
        model = body.get("model")
        if model is not None and model != self.config.model_id:
            raise RequestError(HTTPStatus.NOT_FOUND, f"model {model!r} not found; this server "
                               f"serves {self.config.model_id!r}", "model_not_found")
        limit = self.config.max_tokens_limit
        key = "max_tokens" if body.get("max_tokens") is not None else "max_completion_tokens"
        max_tokens = number(body, key, min(DEFAULT_MAX_TOKENS, limit), integer=True)
        if not 1 <= max_tokens <= limit:
            raise RequestError(HTTPStatus.BAD_REQUEST, f"{key!r} must be an integer in [1, {limit}]")
        stop = body.get("stop") or []
        stop = [stop] if isinstance(stop, str) else stop
        if not isinstance(stop, list) or not all(isinstance(s, str) and s for s in stop):
            raise RequestError(HTTPStatus.BAD_REQUEST, "'stop' must be a string or a list of strings")
        strategy = body.get("strategy", self.config.strategy)
        seed = number(body, "seed", None, integer=True)
        if seed is not None and seed < 0:
            raise RequestError(HTTPStatus.BAD_REQUEST, f"'seed' must be >= 0, got {seed}")
        defaults = SamplerSettings()
        temp = float(number(body, "temperature", defaults.temp))
        top_p = float(number(body, "top_p", defaults.top_p))
        top_k = number(body, "top_k", defaults.top_k, integer=True)
        min_p = float(number(body, "min_p", defaults.min_p))
        try:
            if not isinstance(strategy, str):
                raise ValueError(f"'strategy' must be a string, got {strategy!r}")
            parse_strategy(strategy)
            settings = SamplerSettings(temp, top_p, top_k, min_p)  # refused before it queues
        except ValueError as e:
            raise RequestError(HTTPStatus.BAD_REQUEST, str(e)) from None
        return dict(strategy=strategy, max_tokens=max_tokens, seed=seed, stop=stop,
                    settings=settings)

    def run(self, prompt: str, params: dict) -> Iterator[Response]:
        """Hand the generation to the worker and yield its pieces as they come. Closing this
        generator (the client went away) cancels it: the worker stops at its next step."""
        job = self._admit(prompt, params)
        try:
            while (item := job.out.get()) is not END:
                if isinstance(item, Exception):
                    raise item
                yield item
        except ValueError as e:  # e.g. a prompt past the context, bad sampler settings
            raise RequestError(HTTPStatus.BAD_REQUEST, str(e)) from None
        finally:
            job.cancelled.set()

    def _admit(self, prompt: str, params: dict) -> Job:
        """A job for the worker; refused (503 with Retry-After) when `max_batch` generations
        run and `max_queue` more already wait."""
        places = self.config.max_batch if self.together else 1
        with self.changed:
            if self.admitted >= places + self.config.max_queue:
                raise RequestError(
                    HTTPStatus.SERVICE_UNAVAILABLE, f"the server is busy: "
                    f"{self.admitted - places} requests already wait for the model; retry in "
                    f"{RETRY_AFTER_S} s", "server_error", {"Retry-After": str(RETRY_AFTER_S)})
            self.admitted += 1
            self.changed.notify_all()
        job = Job(prompt, params)
        self.jobs.put(job)
        return job

    @property
    def busy(self) -> bool:
        """Whether the worker is generating."""
        return bool(self.served.live)

    @property
    def loaded(self) -> bool:
        """Whether the model can take requests: its worker runs and is not stopping."""
        return self.worker.is_alive() and not self.stopping.is_set()

    def health(self) -> dict:
        """GET /health (no key needed): whether the model is loaded, for a launcher that
        waits until the server answers (TreegraftKit's TreegraftServer)."""
        return {"status": "ok" if self.loaded else "stopping", "loaded": self.loaded,
                "model": self.config.model_id}

    def close(self) -> None:
        """End every generation at its next step and wait for the worker to stop (a process
        that exits while the worker computes can abort in the compute library)."""
        self.stopping.set()
        self.jobs.put(None)
        self.worker.join()

    def _work(self) -> None:
        if self.together:
            return self._work_together()
        while (job := self.jobs.get()) is not None:
            self._generate(job)

    def _generate(self, job: Job) -> None:
        """Run one job to its end, or to the step after it was cancelled ("disconnected")."""
        reason, last = "disconnected", None
        self._progress(job, None)
        try:
            with closing(stream_generate(self.family, job.prompt, **job.params,
                                         provenance=True)) as pieces:
                for last in pieces:
                    self._progress(job, last)
                    job.out.put(last)
                    if job.cancelled.is_set() or self.stopping.is_set():
                        break
                else:
                    reason = last.finish_reason if last else "stop"
        except Exception as e:
            reason = "error"
            job.out.put(e)
        finally:
            self._finish(job, reason, last)

    def _work_together(self) -> None:
        """Decode the admitted jobs together (batch.py): jobs join between steps while there
        is a place, and each leaves at the step after it ends or its client goes away."""
        batch, stop = Batch(self.family), False
        while not stop or batch.lanes:
            stop = self._join(batch, stop)
            for one in batch.lanes:
                if one.tag.cancelled.is_set() or self.stopping.is_set():
                    one.cancelled = True
                    self._finish(one.tag, "disconnected", one.last)
            try:
                events = batch.step()
            except Exception as e:            # the shared forward failed: every job ends
                for one in batch.lanes:
                    one.tag.out.put(e)
                    self._finish(one.tag, "error", one.last)
                batch = Batch(self.family)
                continue
            self._ran(batch)
            for one, r in events:
                if isinstance(r, Exception):
                    one.tag.out.put(r)
                    self._finish(one.tag, "error", one.last)
                    continue
                self._progress(one.tag, r)
                one.tag.out.put(r)
                if r.finish_reason is not None:
                    self._finish(one.tag, r.finish_reason, r)

    def _join(self, batch: Batch, stop: bool) -> bool:
        """Admitted jobs join the batch while it has a place (waiting for one when nothing
        runs); returns whether the worker was told to stop."""
        while not stop and len(batch.lanes) < self.config.max_batch:
            try:
                job = self.jobs.get(block=not batch.lanes)
            except queue.Empty:
                break
            if job is None:
                return True
            self._progress(job, None)
            try:
                batch.add(lane(self.family, job.prompt, **job.params, provenance=True,
                               tag=job, pool=batch.pool))
            except Exception as e:            # e.g. a prompt past the context: this job's
                job.out.put(e)
                self._finish(job, "error", None)
        return stop

    def _ran(self, batch: Batch) -> None:
        with self.changed:
            self.served.forwards, self.served.rows = batch.forwards, batch.rows

    def _progress(self, job: Job, r: Optional[Response]) -> None:
        """`job` generates; `r` is its last piece so far."""
        with self.changed:
            self.served.live[job] = r
            self.changed.notify_all()

    def _finish(self, job: Job, reason: str, last: Optional[Response]) -> None:
        tokens, steps = (last.generation_tokens, last.steps) if last else (0, 0)
        with self.changed:
            served = self.served
            served.steps, served.tokens = served.steps + steps, served.tokens + tokens
            served.finished[reason] += 1
            served.last = {"finish_reason": reason, "tokens": tokens, "steps": steps}
            served.live.pop(job, None)
            self.admitted -= 1
            self.changed.notify_all()
        job.out.put(END)

    def status(self) -> dict:
        """GET /treegraft/status: how many generations run (`batch`) and wait, the steps and
        tokens served so far (the running generations' included, so they grow while they
        run), and the rows a forward of requests decoded together ran on average."""
        with self.changed:
            s = self.served
            live = [r for r in s.live.values() if r is not None]
            return {"busy": self.busy, "batch": len(s.live),
                    "queued": self.admitted - len(s.live),
                    "max_batch": self.config.max_batch if self.together else 1,
                    "steps": s.steps + sum(r.steps for r in live),
                    "tokens": s.tokens + sum(r.generation_tokens for r in live),
                    "rows_per_forward": round(s.rows / s.forwards, 2) if s.forwards else None,
                    "finished": dict(s.finished), "last": s.last}

    def runs(self, name: str) -> bool:
        """Whether this family has the drafters strategy `name` needs."""
        family = self.family
        strategy = for_family(parse_strategy(name), family.strong is not None,
                              family.mtp is not None)
        return ((family.strong is not None or not strategy.needs_strong) and
                (family.mtp is not None or not strategy.mtp_chain))

    def describe(self) -> dict:
        """GET /treegraft/config: what a client (the chat page) shows as the defaults."""
        cfg, defaults = self.config, SamplerSettings()
        names = [n for n in STRATEGY_NAMES if "<" not in n and self.runs(n)]
        if cfg.strategy not in names:
            names.insert(0, cfg.strategy)
        return {"model": cfg.model_id, "note": cfg.note, "strategy": cfg.strategy,
                "strategies": names,
                "max_tokens": min(DEFAULT_MAX_TOKENS, cfg.max_tokens_limit),
                "max_tokens_limit": cfg.max_tokens_limit, "temperature": defaults.temp,
                "top_p": defaults.top_p, "api_key_required": cfg.api_key is not None}


def number(body: dict, key: str, default, integer: bool = False):
    """A numeric field of a request (absent or null: the default). Booleans, strings, NaN and
    infinities are refused with a message naming the field (JSON's `true` is an int in Python)."""
    value = body.get(key)
    if value is None:
        return default
    kinds = int if integer else (int, float)
    if isinstance(value, bool) or not isinstance(value, kinds) or not math.isfinite(value):
        raise RequestError(HTTPStatus.BAD_REQUEST, f"{key!r} must be "
                           f"{'an integer' if integer else 'a finite number'}, got {value!r}")
    return value


def error_payload(e: RequestError) -> dict:
    return {"error": {"message": e.message, "type": e.kind, "code": int(e.status)}}


def internal_error(e: Exception) -> RequestError:
    """What the client sees of an unexpected failure (the traceback goes to stderr)."""
    traceback.print_exc()
    return RequestError(HTTPStatus.INTERNAL_SERVER_ERROR,
                        f"generation failed: {type(e).__name__}: {e}", "server_error")


def usage(last: Optional[Response], strategy: str) -> dict:
    """OpenAI's usage block, with the speculative figures beside it (generate.summary)."""
    figures = summary(last, strategy)
    prompt, completion = figures.pop("prompt_tokens"), figures.pop("generation_tokens")
    return {"prompt_tokens": prompt, "completion_tokens": completion,
            "total_tokens": prompt + completion, "speculative": figures}


def unauthorized() -> RequestError:
    return RequestError(HTTPStatus.UNAUTHORIZED, "missing or wrong API key: send "
                        "'Authorization: Bearer <key>'", "authentication_error",
                        {"WWW-Authenticate": "Bearer"})


def is_loopback(host: str) -> bool:
    """Whether binding `host` serves this machine only (a name other than localhost may
    resolve to anything, and "" or 0.0.0.0 is every interface)."""
    if host == "localhost":
        return True
    try:
        return ipaddress.ip_address(host).is_loopback
    except ValueError:
        return False


def linger_close(sock: socket.socket) -> None:
    """Half-close, then drop what the client still sends for a while before the socket is
    closed: closing with unread data resets the connection, and the reset can destroy the
    reply before a client that is still sending has read it."""
    try:
        sock.shutdown(socket.SHUT_WR)
        sock.settimeout(LINGER_S)
        deadline = time.monotonic() + LINGER_S
        while time.monotonic() < deadline and sock.recv(DRAIN_CHUNK):
            pass
    except OSError:    # the client is gone, or kept silent: nothing left to protect
        pass


def extension(r: Response) -> dict:
    """The `treegraft` field of a streamed chunk (OpenAI clients ignore unknown fields): its
    text's provenance as [text, source] runs, and the generation's tokens and target
    forwards so far."""
    return {"provenance": [list(run) for run in r.provenance],
            "tokens": r.generation_tokens, "steps": r.steps}


def make_handler(gen: Generator):
    config = gen.config
    assets = load_assets()

    class Handler(BaseHTTPRequestHandler):
        protocol_version = "HTTP/1.1"
        timeout = config.timeout        # a socket timeout: a stalled client is dropped
        linger = False                  # close lingering: a refused body is still arriving

        def log_message(self, fmt, *args):  # quiet by default; errors still reach the client
            pass

        def finish(self) -> None:
            super().finish()
            if self.linger:
                linger_close(self.connection)

        def _send(self, status: HTTPStatus, data: bytes, headers: dict[str, str]) -> None:
            self.send_response(status)
            for k, v in headers.items():
                self.send_header(k, v)
            self.send_header("Content-Length", str(len(data)))
            if self.close_connection:
                self.send_header("Connection", "close")
            self.end_headers()
            self.wfile.write(data)

        def _json(self, status: HTTPStatus, payload: dict,
                  headers: Optional[dict[str, str]] = None) -> None:
            self._send(status, json.dumps(payload).encode(),
                       {"Content-Type": "application/json", **(headers or {})})

        def _error(self, e: RequestError) -> None:
            self._json(e.status, error_payload(e), e.headers)

        def _route(self) -> str:
            return urlsplit(self.path).path.rstrip("/") or "/"

        def _authorized(self, route: str) -> bool:
            """With an API key, the API (not the page) needs it as a bearer token."""
            if config.api_key is None or not route.startswith(("/v1/", "/treegraft/")):
                return True
            given = self.headers.get("Authorization", "").encode()
            return hmac.compare_digest(given, f"Bearer {config.api_key}".encode())

        def do_GET(self):
            route = self._route()
            asset = assets.get(urlsplit(self.path).path)
            try:
                if asset is not None:
                    self._send(HTTPStatus.OK, asset.body, asset.headers())
                elif route == "/health":            # needs no key: says only "loaded"
                    self._json(HTTPStatus.OK, gen.health())
                elif not self._authorized(route):
                    raise unauthorized()
                elif route == "/v1/models":
                    self._json(HTTPStatus.OK, {"object": "list", "data": [
                        {"id": config.model_id, "object": "model", "created": int(time.time()),
                         "owned_by": "treegraft-mlx"}]})
                elif route == "/treegraft/config":
                    self._json(HTTPStatus.OK, gen.describe())
                elif route == "/treegraft/status":
                    self._json(HTTPStatus.OK, gen.status())
                else:
                    raise RequestError(HTTPStatus.NOT_FOUND, f"no route {self.path}", "not_found")
            except RequestError as e:
                self._error(e)

        def _length(self) -> int:
            try:
                length = int(self.headers.get("Content-Length") or 0)
            except ValueError:
                length = -1
            if length < 0:  # rfile.read(-1) would wait for the client to close
                self.close_connection = True
                raise RequestError(HTTPStatus.BAD_REQUEST, "bad Content-Length "
                                   f"{self.headers.get('Content-Length')!r}")
            return length

        def _read(self, length: int) -> bytes:
            try:
                return self.rfile.read(length)
            except TimeoutError:
                self.close_connection = True
                raise RequestError(HTTPStatus.REQUEST_TIMEOUT, "the request body stalled for "
                                   f"{config.timeout} s") from None

        def _skip_body(self, length: int) -> None:
            """Read and drop the body of a refused request, so that a client that sends all
            of it before reading gets the reply; the connection closes after the reply, so
            nothing unread is parsed as the next request. Past `drain_bytes` the reply goes
            out at once and the connection closes lingering (linger_close)."""
            self.close_connection = True
            if length > config.drain_bytes:
                self.linger = True
                return
            while length > 0 and (chunk := self._read(min(DRAIN_CHUNK, length))):
                length -= len(chunk)

        def _raw_body(self) -> bytes:
            length = self._length()
            if length > config.max_body_bytes:
                self._skip_body(length)
                raise RequestError(HTTPStatus.REQUEST_ENTITY_TOO_LARGE,
                                   f"request body of {length} bytes exceeds {config.max_body_bytes}")
            return self._read(length)

        def _body(self) -> dict:
            raw = self._raw_body()
            try:
                body = json.loads(raw)
            except (json.JSONDecodeError, UnicodeDecodeError) as e:
                raise RequestError(HTTPStatus.BAD_REQUEST, f"malformed JSON: {e}") from None
            if not isinstance(body, dict):
                raise RequestError(HTTPStatus.BAD_REQUEST, "the body must be a JSON object")
            return body

        def do_POST(self):
            route = self._route()
            try:
                if not self._authorized(route):
                    self._skip_body(self._length())
                    raise unauthorized()
                if route not in GENERATE_ROUTES:
                    self._raw_body()
                    raise RequestError(HTTPStatus.NOT_FOUND, f"no route {self.path}", "not_found")
                body = self._body()
                params = gen.parameters(body)
                chat = route.endswith("chat/completions")
                if chat:
                    try:
                        prompt = chat_prompt(gen.family.tokenizer, body.get("messages"))
                    except ValueError as e:
                        raise RequestError(HTTPStatus.BAD_REQUEST, str(e)) from None
                else:
                    prompt = body.get("prompt")
                    if not isinstance(prompt, str) or not prompt:
                        raise RequestError(HTTPStatus.BAD_REQUEST, "'prompt' must be a non-empty string")
                with closing(gen.run(prompt, params)) as pieces:  # closed: generation ends
                    reply = self._stream if body.get("stream") else self._complete
                    reply(pieces, chat, params["strategy"])
            except RequestError as e:
                self._error(e)
            except (ConnectionError, TimeoutError):  # the client is gone: nobody to tell
                self.close_connection = True
            except Exception as e:  # a failure before any reply was sent: JSON, not a hang-up
                self._error(internal_error(e))
        def _complete(self, pieces, chat: bool, strategy: str) -> None:
            text, last = "", None
            for r in pieces:
                text += r.text
                last = r
            choice = {"index": 0, "finish_reason": last.finish_reason if last else "length"}
            if chat:
                choice["message"] = {"role": "assistant", "content": text}
            else:
                choice["text"] = text
            self._json(HTTPStatus.OK, {
                "id": f"{'chatcmpl' if chat else 'cmpl'}-{uuid.uuid4().hex[:24]}",
                "object": "chat.completion" if chat else "text_completion",
                "created": int(time.time()), "model": config.model_id, "choices": [choice],
                "usage": usage(last, strategy)})

        def _stream(self, pieces, chat: bool, strategy: str) -> None:
            ident = f"{'chatcmpl' if chat else 'cmpl'}-{uuid.uuid4().hex[:24]}"
            obj = "chat.completion.chunk" if chat else "text_completion"
            started = False
            last = None
            try:
                for r in pieces:
                    if not started:
                        self.send_response(HTTPStatus.OK)
                        self.send_header("Content-Type", "text/event-stream")
                        self.send_header("Cache-Control", "no-cache")
                        self.send_header("Connection", "close")
                        self.end_headers()
                        started = True
                    last = r
                    choice = {"index": 0, "finish_reason": r.finish_reason}
                    if chat:
                        choice["delta"] = {"content": r.text}
                    else:
                        choice["text"] = r.text
                    chunk = {"id": ident, "object": obj, "created": int(time.time()),
                             "model": config.model_id, "choices": [choice],
                             "treegraft": extension(r)}
                    if r.finish_reason:
                        chunk["usage"] = usage(last, strategy)
                    self.wfile.write(f"data: {json.dumps(chunk)}\n\n".encode())
                    self.wfile.flush()
            except Exception as e:
                if not started:  # nothing sent yet: an ordinary JSON error reply
                    raise
                self.close_connection = True
                if not isinstance(e, (ConnectionError, TimeoutError)):  # the client is still there
                    # Headers are gone: end the stream with an error event (no [DONE]).
                    self._stream_error(e if isinstance(e, RequestError) else internal_error(e))
                return
            if not started:
                raise RequestError(HTTPStatus.INTERNAL_SERVER_ERROR, "no output")
            self.wfile.write(b"data: [DONE]\n\n")
            self.wfile.flush()
            self.close_connection = True

        def _stream_error(self, e: RequestError) -> None:
            try:
                self.wfile.write(f"data: {json.dumps(error_payload(e))}\n\n".encode())
                self.wfile.flush()
            except OSError:  # the client is gone: nobody to tell
                pass

    return Handler


class Server(ThreadingHTTPServer):
    """The HTTP server, and the Generator behind it (its counts; its worker ends with it)."""

    daemon_threads = True

    def __init__(self, address: tuple[str, int], gen: Generator):
        super().__init__(address, make_handler(gen))
        self.generator = gen

    def server_close(self) -> None:
        super().server_close()
        self.generator.close()


def stop_when_closed(server: Server, stream) -> threading.Thread:
    """Shut `server` down once `stream` (serve's standard input, held open by the app that
    launched it) ends: the app exited or died, so its helper server does not outlive it."""
    def watch() -> None:
        try:
            while stream.read(DRAIN_CHUNK):
                pass
        except (OSError, ValueError):    # closed under us: the same as its end
            pass
        server.shutdown()

    thread = threading.Thread(target=watch, name="treegraft-stdin-watch", daemon=True)
    thread.start()
    return thread


def make_server(family: Family, host: str = "127.0.0.1", port: int = 8080,
                config: Optional[ServerConfig] = None) -> Server:
    """A ready server (call serve_forever); port 0 picks a free port."""
    return Server((host, port), Generator(family, config or ServerConfig()))
