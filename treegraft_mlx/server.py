"""OpenAI-compatible HTTP server: /v1/models, /v1/completions, /v1/chat/completions.

Built on the standard library's ThreadingHTTPServer, like mlx_lm's own server: no extra
dependency, well kept with CPython, and enough for one local user or app. Connections are
served concurrently; generations queue on one lock (one model, one device). Errors come back
as OpenAI-style JSON with the right status code.
"""

from __future__ import annotations

import json
import threading
import time
import uuid
from dataclasses import dataclass
from http import HTTPStatus
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from typing import Optional

from .engine import parse_strategy, stream_generate
from .family import Family
from .generate import Response, chat_prompt


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
        max_tokens = body.get("max_tokens", body.get("max_completion_tokens", 256))
        if not isinstance(max_tokens, int) or not 1 <= max_tokens <= self.config.max_tokens_limit:
            raise RequestError(HTTPStatus.BAD_REQUEST, f"max_tokens must be an integer in "
                               f"[1, {self.config.max_tokens_limit}]")
        stop = body.get("stop") or []
        stop = [stop] if isinstance(stop, str) else stop
        if not isinstance(stop, list) or not all(isinstance(s, str) and s for s in stop):
            raise RequestError(HTTPStatus.BAD_REQUEST, "'stop' must be a string or a list of strings")
        strategy = body.get("strategy", self.config.strategy)
        try:
            parse_strategy(strategy)
            params = dict(strategy=strategy, max_tokens=max_tokens,
                          temp=float(body.get("temperature", 0.0)),
                          top_p=float(body.get("top_p", 1.0)), top_k=int(body.get("top_k", 0)),
                          min_p=float(body.get("min_p", 0.0)), seed=body.get("seed"), stop=stop)
        except (TypeError, ValueError) as e:
            raise RequestError(HTTPStatus.BAD_REQUEST, str(e)) from None
        return params

    def run(self, prompt: str, params: dict):
        """Yield Response pieces; the lock is held for the whole generation (a queue)."""
        decoders: list = []
        with self.lock:
            try:
                for r in stream_generate(self.family, prompt, decoder_out=decoders, **params):
                    yield r, decoders[0]
            except ValueError as e:  # e.g. a prompt past the context, bad sampler settings
                raise RequestError(HTTPStatus.BAD_REQUEST, str(e)) from None


def usage(last: Optional[Response], decoder, strategy: str) -> dict:
    prompt = last.prompt_tokens if last else 0
    completion = last.generation_tokens if last else 0
    return {"prompt_tokens": prompt, "completion_tokens": completion,
            "total_tokens": prompt + completion,
            "speculative": {"strategy": strategy, "steps": last.steps if last else 0,
                            "mean_accepted": completion / last.steps if last and last.steps else 0.0,
                            "drafter_calls": decoder.drafter_calls if decoder else 0,
                            "tokens_per_sec": last.generation_tps if last else 0.0}}


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
            self.end_headers()
            self.wfile.write(data)

        def _error(self, e: RequestError) -> None:
            self._json(e.status, {"error": {"message": e.message, "type": e.kind,
                                            "code": int(e.status)}})

        def do_GET(self):
            if self.path.rstrip("/") == "/v1/models":
                self._json(HTTPStatus.OK, {"object": "list", "data": [
                    {"id": config.model_id, "object": "model", "created": int(time.time()),
                     "owned_by": "treegraft-mlx"}]})
            else:
                self._error(RequestError(HTTPStatus.NOT_FOUND, f"no route {self.path}", "not_found"))

        def _body(self) -> dict:
            try:
                length = int(self.headers.get("Content-Length", "0"))
            except ValueError:
                raise RequestError(HTTPStatus.BAD_REQUEST, "bad Content-Length") from None
            if length > config.max_body_bytes:
                raise RequestError(HTTPStatus.REQUEST_ENTITY_TOO_LARGE,
                                   f"request body of {length} bytes exceeds {config.max_body_bytes}")
            raw = self.rfile.read(length)
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
                    self.rfile.read(int(self.headers.get("Content-Length", "0") or 0))
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

        def _complete(self, pieces, chat: bool, strategy: str) -> None:
            text, last, decoder = "", None, None
            for r, decoder in pieces:
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
                "usage": usage(last, decoder, strategy)})

        def _stream(self, pieces, chat: bool, strategy: str) -> None:
            ident = f"{'chatcmpl' if chat else 'cmpl'}-{uuid.uuid4().hex[:24]}"
            obj = "chat.completion.chunk" if chat else "text_completion"
            started = False
            last, decoder = None, None
            try:
                for r, decoder in pieces:
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
                        chunk["usage"] = usage(last, decoder, strategy)
                    self.wfile.write(f"data: {json.dumps(chunk)}\n\n".encode())
                    self.wfile.flush()
            except RequestError:
                if started:  # headers are gone: end the stream; the client sees no [DONE]
                    self.close_connection = True
                    return
                raise
            if not started:
                raise RequestError(HTTPStatus.INTERNAL_SERVER_ERROR, "no output")
            self.wfile.write(b"data: [DONE]\n\n")
            self.wfile.flush()
            self.close_connection = True

    return Handler


def make_server(family: Family, host: str = "127.0.0.1", port: int = 8080,
                config: Optional[ServerConfig] = None) -> ThreadingHTTPServer:
    """A ready server (call serve_forever); port 0 picks a free port."""
    gen = Generator(family, config or ServerConfig())
    server = ThreadingHTTPServer((host, port), make_handler(gen))
    server.daemon_threads = True
    return server
