"""HTTP helpers for the server tests: a server running from a thread, one request, a
streamed one, and the status endpoint."""

import http.client
import json
import socket
import threading
from contextlib import contextmanager
from typing import Iterator, Optional

from treegraft_mlx.server import ServerConfig, make_server


class IdleServer:
    """What `serve` gets from make_server where a test only runs the command: returns at once."""

    server_port = 8080

    def serve_forever(self) -> None:
        pass

    def server_close(self) -> None:
        pass


@contextmanager
def running(family, **config) -> Iterator:
    """A server with this ServerConfig, serving from a thread on a free loopback port."""
    srv = make_server(family, "127.0.0.1", 0, ServerConfig(**config))
    thread = threading.Thread(target=srv.serve_forever, daemon=True)
    thread.start()
    try:
        yield srv
    finally:
        srv.shutdown()
        srv.server_close()


def request(server, method, path, body=None, raw=None, timeout: float = 120,
            headers: Optional[dict] = None, full: bool = False):
    """Status, content type and payload of one request (with `full`, the response too)."""
    conn = http.client.HTTPConnection("127.0.0.1", server.server_port, timeout=timeout)
    data = raw if raw is not None else (json.dumps(body).encode() if body is not None else None)
    conn.request(method, path, body=data,
                 headers={"Content-Type": "application/json", **(headers or {})})
    resp = conn.getresponse()
    payload = resp.read()
    conn.close()
    out = resp.status, resp.getheader("Content-Type"), payload
    return out + (resp,) if full else out


def post(server, body: dict, path: str = "/v1/completions", timeout: float = 120) -> tuple[int, dict]:
    """Status and JSON reply of a non-streamed request."""
    status, _, payload = request(server, "POST", path, body, timeout=timeout)
    return status, json.loads(payload)


def events(payload: bytes) -> list[str]:
    """The `data:` fields of a server-sent event stream."""
    return [e[6:] for e in payload.decode().split("\n\n") if e.startswith("data: ")]


def chunks_of(payload: bytes, chat: bool = False) -> tuple[str, list[dict]]:
    """Concatenated text and JSON chunks of a streamed reply, which must end in [DONE]."""
    data = events(payload)
    assert data[-1] == "[DONE]"
    chunks = [json.loads(e) for e in data[:-1]]
    text = "".join(c["choices"][0]["delta"]["content"] if chat else c["choices"][0]["text"]
                   for c in chunks)
    return text, chunks


def streamed(server, body: dict, path: str = "/v1/completions") -> tuple[str, list[dict]]:
    """Concatenated text of a streamed request (ending in [DONE]) and its chunks."""
    status, ctype, payload = request(server, "POST", path, {**body, "stream": True})
    assert status == 200 and ctype.startswith("text/event-stream"), payload
    return chunks_of(payload, path.endswith("chat/completions"))


def open_stream(port: int, body: dict) -> socket.socket:
    """A socket that has sent a streamed completion request."""
    sock = socket.create_connection(("127.0.0.1", port), timeout=60)
    data = json.dumps({**body, "stream": True}).encode()
    sock.sendall(b"POST /v1/completions HTTP/1.1\r\nHost: test\r\nContent-Type: application/json"
                 + f"\r\nContent-Length: {len(data)}\r\n\r\n".encode() + data)
    return sock


def read_events(sock: socket.socket, n: int) -> bytes:
    """Read until `n` server-sent events have arrived."""
    got = b""
    while got.count(b"data: ") < n:
        chunk = sock.recv(1 << 16)
        assert chunk, got
        got += chunk
    return got


def status_of(server, headers: Optional[dict] = None) -> dict:
    status, _, payload = request(server, "GET", "/treegraft/status", headers=headers)
    assert status == 200, payload
    return json.loads(payload)


def reply_to(port: int, data: bytes) -> bytes:
    """Everything the server sends on a connection that sent `data`, until it closes it."""
    with socket.create_connection(("127.0.0.1", port), timeout=10) as sock:
        sock.sendall(data)
        got = b""
        while chunk := sock.recv(1 << 16):
            got += chunk
        return got
