"""The OpenAI-compatible server, exercised over real HTTP on 127.0.0.1."""

import http.client
import json
import threading

import pytest
from click.testing import CliRunner

from treegraft_mlx import fixture_path, generate, load
from treegraft_mlx.cli import main
from treegraft_mlx.server import ServerConfig, make_server

PROMPT = "def parse_header(line):\n    \"\"\"Split a header line into name and value.\"\"\"\n"


@pytest.fixture(scope="module")
def family():
    return load(fixture_path())


@pytest.fixture(scope="module")
def server(family):
    srv = make_server(family, "127.0.0.1", 0, ServerConfig(max_tokens_limit=64, max_body_bytes=4096))
    thread = threading.Thread(target=srv.serve_forever, daemon=True)
    thread.start()
    yield srv
    srv.shutdown()
    srv.server_close()


def request(server, method, path, body=None, raw=None):
    conn = http.client.HTTPConnection("127.0.0.1", server.server_port, timeout=120)
    data = raw if raw is not None else (json.dumps(body).encode() if body is not None else None)
    conn.request(method, path, body=data, headers={"Content-Type": "application/json"})
    resp = conn.getresponse()
    payload = resp.read()
    conn.close()
    return resp.status, resp.getheader("Content-Type"), payload


def test_models(server):
    status, _, payload = request(server, "GET", "/v1/models")
    assert status == 200 and json.loads(payload)["data"][0]["id"] == "tg-tiny"


def test_completion_equals_library_and_cli(server, family):
    body = {"model": "tg-tiny", "prompt": PROMPT, "max_tokens": 40, "temperature": 0}
    status, _, payload = request(server, "POST", "/v1/completions", body)
    assert status == 200
    out = json.loads(payload)
    text = out["choices"][0]["text"]
    assert text == generate(family, PROMPT, "treegraft", max_tokens=40).text
    spec = out["usage"]["speculative"]
    assert out["usage"]["completion_tokens"] > 0 and spec["steps"] > 0
    assert spec["strategy"] == "treegraft" and spec["mean_accepted"] >= 1.0
    cli = CliRunner().invoke(main, ["generate", "--prompt", PROMPT, "--max-tokens", "40", "--json"])
    assert cli.exit_code == 0, cli.output
    assert json.loads(cli.output)["text"] == text


def test_streaming_matches_non_streaming(server):
    body = {"prompt": PROMPT, "max_tokens": 30}
    _, _, plain = request(server, "POST", "/v1/completions", body)
    status, ctype, payload = request(server, "POST", "/v1/completions", {**body, "stream": True})
    assert status == 200 and ctype.startswith("text/event-stream")
    events = [line[6:] for line in payload.decode().split("\n\n") if line.startswith("data: ")]
    assert events[-1] == "[DONE]"
    chunks = [json.loads(e) for e in events[:-1]]
    assert "".join(c["choices"][0]["text"] for c in chunks) == json.loads(plain)["choices"][0]["text"]
    assert chunks[-1]["choices"][0]["finish_reason"] in ("length", "stop")
    assert chunks[-1]["usage"]["completion_tokens"] == 30 or chunks[-1]["choices"][0]["finish_reason"] == "stop"


def test_chat_completions_stream_and_plain(server):
    body = {"messages": [{"role": "user", "content": "write a function"}], "max_tokens": 20}
    status, _, payload = request(server, "POST", "/v1/chat/completions", body)
    assert status == 200
    msg = json.loads(payload)["choices"][0]["message"]
    assert msg["role"] == "assistant" and isinstance(msg["content"], str)
    _, _, streamed = request(server, "POST", "/v1/chat/completions", {**body, "stream": True})
    events = [e[6:] for e in streamed.decode().split("\n\n") if e.startswith("data: ")]
    deltas = "".join(json.loads(e)["choices"][0]["delta"]["content"] for e in events[:-1])
    assert deltas == msg["content"]


def test_two_concurrent_requests(server, family):
    prompts = [PROMPT, "class Stack:\n    def push(self, item):\n"]
    results = {}

    def call(i):
        results[i] = request(server, "POST", "/v1/completions",
                             {"prompt": prompts[i], "max_tokens": 24})

    threads = [threading.Thread(target=call, args=(i,)) for i in range(2)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(timeout=300)
    for i in range(2):
        status, _, payload = results[i]
        assert status == 200
        assert (json.loads(payload)["choices"][0]["text"]
                == generate(family, prompts[i], "treegraft", max_tokens=24).text)


def test_errors_are_json_with_status_codes(server):
    cases = [
        ("POST", "/v1/completions", None, b"{not json", 400),
        ("POST", "/v1/completions", None, json.dumps({"prompt": "x" * 5000}).encode(), 413),
        ("POST", "/v1/completions", {"model": "gpt-9", "prompt": "x"}, None, 404),
        ("POST", "/v1/completions", {"prompt": "x", "max_tokens": 10_000}, None, 400),
        ("POST", "/v1/completions", {"prompt": ""}, None, 400),
        ("POST", "/v1/chat/completions", {"messages": "hi"}, None, 400),
        ("POST", "/v1/completions", {"prompt": "x", "strategy": "warp"}, None, 400),
        ("GET", "/v2/nothing", None, None, 404),
    ]
    for method, path, body, raw, code in cases:
        status, ctype, payload = request(server, method, path, body, raw)
        assert status == code, (path, body, raw, payload)
        assert ctype == "application/json" and "message" in json.loads(payload)["error"]
