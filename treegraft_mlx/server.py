"""OpenAI-compatible HTTP server: /v1/models, /v1/completions, /v1/chat/completions.

Built on the standard library's ThreadingHTTPServer, like mlx_lm's own server: no extra
dependency, well kept with CPython, and enough for one local user or app. Connections are
served concurrently; generations queue on one lock (one model, one device). Errors come back
as OpenAI-style JSON with the right status code.
"""

from __future__ import annotations

import json
import math
import threading
import time
import traceback
import uuid
from dataclasses import dataclass
from http import HTTPStatus
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from typing import Optional

from .decoder import parse_strategy
from .engine import stream_generate
from .family import Family
from .generate import Response, chat_prompt, summary
from .sampling import SamplerSettings

DEFAULT_MAX_TOKENS = 256


@dataclass(frozen=True)
class ServerConfig:
    model_id: str = "tg-tiny"
    strategy: str = "treegraft"
    max_tokens_limit: int = 2048
    max_body_bytes: int = 1 << 20


class RequestError(Exception):
    def __init__(self, status: HTTPStatus, message: str, kind: str = "invalid_request_error"):
        super().__init__(message)
        self.status, self.message, self.kind = status, message, kind


class Generator:
    """Validates a request and runs it on the family, one generation at a time."""

    def __init__(self, family: Family, config: ServerConfig):
        self.family, self.config = family, config
        self.lock = threading.Lock()

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
        temp = float(number(body, "temperature", 0.0))
        top_p = float(number(body, "top_p", 1.0))
        top_k = number(body, "top_k", 0, integer=True)
        min_p = float(number(body, "min_p", 0.0))
        try:
            if not isinstance(strategy, str):
                raise ValueError(f"'strategy' must be a string, got {strategy!r}")
            parse_strategy(strategy)
            settings = SamplerSettings(temp, top_p, top_k, min_p)  # refused before it queues
        except ValueError as e:
            raise RequestError(HTTPStatus.BAD_REQUEST, str(e)) from None
        return dict(strategy=strategy, max_tokens=max_tokens, seed=seed, stop=stop,
                    settings=settings)

    def run(self, prompt: str, params: dict):
        """Yield Response pieces; the lock is held for the whole generation (a queue)."""
        with self.lock:
            try:
                yield from stream_generate(self.family, prompt, **params)
            except ValueError as e:  # e.g. a prompt past the context, bad sampler settings
                raise RequestError(HTTPStatus.BAD_REQUEST, str(e)) from None


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


def make_handler(gen: Generator):
    config = gen.config

    class Handler(BaseHTTPRequestHandler):
        protocol_version = "HTTP/1.1"

        def log_message(self, fmt, *args):  # quiet by default; errors still reach the client
            pass

        def _json(self, status: HTTPStatus, payload: dict) -> None:
            data = json.dumps(payload).encode()
            self.send_response(status)
            self.send_header("Content-Type", "application/json")
            self.send_header("Content-Length", str(len(data)))
            if self.close_connection:
                self.send_header("Connection", "close")
            self.end_headers()
            self.wfile.write(data)

        def _error(self, e: RequestError) -> None:
            self._json(e.status, error_payload(e))

        def do_GET(self):
            if self.path.rstrip("/") == "/v1/models":
                self._json(HTTPStatus.OK, {"object": "list", "data": [
                    {"id": config.model_id, "object": "model", "created": int(time.time()),
                     "owned_by": "treegraft-mlx"}]})
            else:
                self._error(RequestError(HTTPStatus.NOT_FOUND, f"no route {self.path}", "not_found"))

        def _raw_body(self) -> bytes:
            """The request body; a body left unread (refused) closes the connection after
            the reply, so that it is never parsed as the next request."""
            try:
                length = int(self.headers.get("Content-Length") or 0)
            except ValueError:
                length = -1
            if length < 0:  # rfile.read(-1) would wait for the client to close
                self.close_connection = True
                raise RequestError(HTTPStatus.BAD_REQUEST, "bad Content-Length "
                                   f"{self.headers.get('Content-Length')!r}")
            if length > config.max_body_bytes:
                self.close_connection = True
                raise RequestError(HTTPStatus.REQUEST_ENTITY_TOO_LARGE,
                                   f"request body of {length} bytes exceeds {config.max_body_bytes}")
            return self.rfile.read(length)

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
            route = self.path.rstrip("/")
            try:
                if route not in ("/v1/completions", "/v1/chat/completions"):
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
                if body.get("stream"):
                    self._stream(gen.run(prompt, params), chat, params["strategy"])
                else:
                    self._complete(gen.run(prompt, params), chat, params["strategy"])
            except RequestError as e:
                self._error(e)
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
                             "model": config.model_id, "choices": [choice]}
                    if r.finish_reason:
                        chunk["usage"] = usage(last, strategy)
                    self.wfile.write(f"data: {json.dumps(chunk)}\n\n".encode())
                    self.wfile.flush()
            except Exception as e:
                if not started:  # nothing sent yet: an ordinary JSON error reply
                    raise
                self.close_connection = True
                if not isinstance(e, (BrokenPipeError, ConnectionResetError)):  # client still there
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


def make_server(family: Family, host: str = "127.0.0.1", port: int = 8080,
                config: Optional[ServerConfig] = None) -> ThreadingHTTPServer:
    """A ready server (call serve_forever); port 0 picks a free port."""
    gen = Generator(family, config or ServerConfig())
    server = ThreadingHTTPServer((host, port), make_handler(gen))
    server.daemon_threads = True
    return server
