"""The OpenAI-compatible server, exercised over real HTTP on 127.0.0.1; stop strings through
`generate.stream`, the library and the server; the chat page's files and the server's
hardening (oversized bodies, disconnects, the queue bound, timeouts, the API key)."""

import http.client
import json
import random
import re
import string
import threading
import time
from typing import Iterator, Optional

import pytest
from scripted import deterministic
from serving import (IdleServer, events, open_stream, post, read_events, reply_to, request,
                     running, status_of, streamed)
from click.testing import CliRunner

from treegraft_mlx import fixture_path, generate, load
from treegraft_mlx import server as server_mod
from treegraft_mlx.cli import main
from treegraft_mlx.generate import chat_prompt, encode_prompt, stream
from treegraft_mlx.server import is_loopback

PROMPT = "def parse_header(line):\n    \"\"\"Split a header line into name and value.\"\"\"\n"
REPETITIVE = "a = 1\nb = 2\n" * 8   # the n-gram drafter accepts several tokens per step here
LIMIT = 64                            # the test server's max_tokens_limit


@pytest.fixture(scope="module")
def family():
    return deterministic(load(fixture_path()))   # step counts repeat: no load-driven choices


@pytest.fixture(scope="module")
def server(family):
    with running(family, max_tokens_limit=LIMIT, max_body_bytes=4096) as srv:
        yield srv


def text_of(reply: dict) -> str:
    choice = reply["choices"][0]
    return choice["message"]["content"] if "message" in choice else choice["text"]


def test_models(server):
    status, _, payload = request(server, "GET", "/v1/models")
    assert status == 200 and json.loads(payload)["data"][0]["id"] == "tg-tiny"


def test_completion_equals_library_and_cli(server, family):
    body = {"model": "tg-tiny", "prompt": PROMPT, "max_tokens": 40, "temperature": 0}
    status, _, payload = request(server, "POST", "/v1/completions", body)
    assert status == 200
    out = json.loads(payload)
    text = out["choices"][0]["text"]
    ref = generate(family, PROMPT, "treegraft", max_tokens=40)
    assert text == ref.text and out["usage"]["completion_tokens"] == len(ref.token_ids)
    assert out["usage"]["speculative"]["strategy"] == "treegraft"
    cli = CliRunner().invoke(main, ["generate", "--prompt", PROMPT, "--max-tokens", "40", "--json"])
    assert cli.exit_code == 0, cli.output
    assert json.loads(cli.stdout)["text"] == text


def test_streaming_matches_non_streaming(server):
    body = {"prompt": PROMPT, "max_tokens": 30}
    _, plain = post(server, body)
    text, chunks = streamed(server, body)
    assert text == text_of(plain)
    assert chunks[-1]["choices"][0]["finish_reason"] in ("length", "stop")
    assert chunks[-1]["usage"]["completion_tokens"] == 30 or chunks[-1]["choices"][0]["finish_reason"] == "stop"


def test_usage_counts_the_generated_tokens_and_steps(server, family):
    """Usage must report the tokens and target steps of the generation itself (a tree strategy
    on a repetitive prompt commits several tokens per step), not e.g. steps as tokens."""
    body = {"prompt": REPETITIVE, "max_tokens": 24, "strategy": "ngram"}
    status, out = post(server, body)
    assert status == 200
    ref = generate(family, REPETITIVE, "ngram", max_tokens=24)
    use, spec = out["usage"], out["usage"]["speculative"]
    assert use["completion_tokens"] == len(ref.token_ids) == 24
    assert use["prompt_tokens"] == len(encode_prompt(family.tokenizer, REPETITIVE))
    assert use["total_tokens"] == use["prompt_tokens"] + use["completion_tokens"]
    assert spec["steps"] == ref.steps < use["completion_tokens"]
    assert spec["mean_accepted"] == (use["completion_tokens"] - 1) / spec["steps"]
    assert spec["drafter_calls"] == 0  # ngram: no model drafter ran


def test_chat_completions_apply_the_template_stream_and_plain(server, family):
    """The chat reply is `generate` on the chat-templated prompt (not the raw content), and
    the streamed deltas add up to it."""
    messages = [{"role": "user", "content": "write a function"}]
    body = {"messages": messages, "max_tokens": 20}
    status, out = post(server, body, "/v1/chat/completions")
    assert status == 200
    msg = out["choices"][0]["message"]
    templated = chat_prompt(family.tokenizer, messages)
    assert msg["role"] == "assistant"
    assert msg["content"] == generate(family, templated, "treegraft", max_tokens=20).text
    prompt_tokens = out["usage"]["prompt_tokens"]
    assert prompt_tokens == len(encode_prompt(family.tokenizer, templated))
    assert prompt_tokens > len(encode_prompt(family.tokenizer, messages[0]["content"]))
    assert streamed(server, body, "/v1/chat/completions")[0] == msg["content"]


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


# --- request validation -------------------------------------------------------------------

@pytest.mark.parametrize("field, message", [
    ({"temperature": -1}, "temperature must be >= 0"),
    ({"temperature": "hot"}, "'temperature' must be a finite number"),
    ({"temperature": float("nan")}, "'temperature' must be a finite number"),
    ({"top_p": 0}, "top_p must be in (0, 1]"),
    ({"top_k": 2.5}, "'top_k' must be an integer"),
    ({"max_tokens": True}, "'max_tokens' must be an integer"),
    ({"max_tokens": 0}, "'max_tokens' must be an integer in [1, 64]"),
    ({"max_completion_tokens": LIMIT + 1}, "'max_completion_tokens' must be an integer in [1, 64]"),
    ({"seed": "7"}, "'seed' must be an integer"),
    ({"seed": -1}, "'seed' must be >= 0"),
    ({"stop": 5}, "'stop' must be a string or a list of strings"),
    ({"stop": ["ok", ""]}, "'stop' must be a string or a list of strings"),
    ({"stop": ["ok", 3]}, "'stop' must be a string or a list of strings"),
    ({"strategy": 7}, "'strategy' must be a string"),
])
def test_bad_parameters_are_400_naming_the_field(server, field, message):
    """Each bad value is refused up front with a message naming it: none is silently coerced
    (JSON `true` is an int in Python, float("nan") passes a `< 0` check)."""
    for stream_it in (False, True):
        status, out = post(server, {"prompt": "x", **field, "stream": stream_it})
        assert status == 400, (field, out)
        assert message in out["error"]["message"], (field, out)


def test_max_completion_tokens_and_the_default_limit(server, family):
    """max_completion_tokens bounds the reply like max_tokens; a request naming neither gets
    the server's limit when it is below the default, not a 400."""
    status, out = post(server, {"prompt": PROMPT, "max_completion_tokens": 5})
    assert status == 200, out
    assert out["usage"]["completion_tokens"] == 5 and out["choices"][0]["finish_reason"] == "length"
    assert text_of(out) == generate(family, PROMPT, "treegraft", max_tokens=5).text
    status, out = post(server, {"prompt": PROMPT, "strategy": "ngram"})
    assert status == 200, out
    assert (out["usage"]["completion_tokens"] == LIMIT
            or out["choices"][0]["finish_reason"] == "stop")


def dense_prompt(chars: int = 3000) -> str:
    """Punctuation the tokenizer barely merges: past the 2048-token context in a small body."""
    alphabet = [c for c in string.punctuation if c not in "\"\\"]
    return "".join(random.Random(0).choice(alphabet) for _ in range(chars))


def test_prompt_past_the_context_is_400(server, family):
    """A prompt longer than the context is refused with a message saying so (plain and
    streamed), not a 500 or a dropped connection."""
    prompt = dense_prompt()
    assert len(encode_prompt(family.tokenizer, prompt)) > family.target.args.max_position_embeddings
    for stream_it in (False, True):
        status, out = post(server, {"prompt": prompt, "max_tokens": 4, "stream": stream_it})
        assert status == 400, out
        assert "context" in out["error"]["message"] and "shorten the prompt" in out["error"]["message"]


@pytest.mark.parametrize("raw, message", [(b"[1, 2]", "JSON object"), (b'"hi"', "JSON object"),
                                          (b"{not json", "malformed JSON")])
def test_body_that_is_not_a_json_object_is_400(server, raw, message):
    """Valid JSON that is not an object (a list, a string) must not reach `body.get`."""
    status, _, payload = request(server, "POST", "/v1/completions", raw=raw)
    assert status == 400 and message in json.loads(payload)["error"]["message"]


@pytest.mark.parametrize("length", ["abc", "-5"])
def test_bad_content_length_is_400_without_waiting(server, length):
    """A Content-Length that is not a count is refused at once; "-5" must not make the server
    read until the client hangs up (rfile.read(-5) reads to EOF)."""
    conn = http.client.HTTPConnection("127.0.0.1", server.server_port, timeout=10)
    conn.putrequest("POST", "/v1/completions")
    conn.putheader("Content-Length", length)
    conn.endheaders()
    resp = conn.getresponse()
    payload = json.loads(resp.read())
    conn.close()
    assert resp.status == 400 and "bad Content-Length" in payload["error"]["message"]


# --- sampling -----------------------------------------------------------------------------

def test_seeded_sampling_is_reproducible_and_sampled(server, family):
    """Same seed -> same text (plain and streamed) and the library's; the temperature and the
    seed both reach the sampler (another seed, or greedy, gives another text)."""
    body = {"prompt": PROMPT, "max_tokens": 16, "temperature": 0.9, "seed": 3, "strategy": "ngram"}
    texts = [text_of(post(server, body)[1]) for _ in range(2)]
    assert texts[0] == texts[1] == streamed(server, body)[0]
    assert texts[0] == generate(family, PROMPT, "ngram", max_tokens=16, temp=0.9, seed=3).text
    assert texts[0] != text_of(post(server, {**body, "seed": 4})[1])
    assert texts[0] != text_of(post(server, {**body, "temperature": 0})[1])


# --- stop strings -------------------------------------------------------------------------

@pytest.fixture(scope="module")
def reference(family) -> str:
    """The greedy continuation of PROMPT (40 tokens, no EOS)."""
    return generate(family, PROMPT, "ar", max_tokens=40).text


def fresh_substring(text: str, start: int, width: int = 3,
                    seen_chars: bool = False) -> tuple[str, int]:
    """A substring of `text` whose first occurrence begins at or after `start`, and where
    (with `seen_chars`: one whose every character occurs before it)."""
    for i in range(start, len(text) - width):
        sub = text[i:i + width]
        if text.find(sub) == i and not (seen_chars and max(map(text.find, sub)) >= i):
            return sub, i
    raise AssertionError(f"no fresh substring after {start} in {text!r}")


def tied_stops(text: str) -> tuple[list[str], int]:
    """Stop strings for `text`: one occurring late, then two that complete on the same
    character (stops are checked token by token, so only those can tie), the one starting
    later listed first; and where the text must end."""
    short, j = fresh_substring(text, 16)
    start = j - 6
    late, _ = fresh_substring(text, j + 8)
    return [late, short, text[start:j + 3]], start


def test_stop_strings_earliest_in_the_text_wins(server, family, reference):
    """Several stops: the reply ends before the one that occurs first in the text, not the
    first one listed; the library, the server (plain and streamed) and the CLI agree."""
    stops, at = tied_stops(reference)
    expected = reference[:at]
    lib = generate(family, PROMPT, "treegraft", max_tokens=40, stop=stops)
    assert lib.text == expected and lib.finish_reason == "stop"
    body = {"prompt": PROMPT, "max_tokens": 40, "stop": stops}
    status, out = post(server, body)
    assert status == 200 and text_of(out) == expected
    assert out["choices"][0]["finish_reason"] == "stop"
    text, chunks = streamed(server, body)
    assert text == expected and chunks[-1]["choices"][0]["finish_reason"] == "stop"
    cli = CliRunner().invoke(main, ["generate", "--prompt", PROMPT, "--max-tokens", "40", "--json",
                                    *(a for s in stops for a in ("--stop", s))])
    assert cli.exit_code == 0, cli.output
    assert json.loads(cli.stdout)["text"] == expected


def test_one_stop_string_is_not_split_into_characters(family, reference):
    """`stop="ab"` is one stop string: stopping at "a" or "b" alone would be a bug."""
    stop, at = fresh_substring(reference, 8, seen_chars=True)
    assert generate(family, PROMPT, "ar", max_tokens=40, stop=stop).text == reference[:at]
    with pytest.raises(ValueError, match="non-empty"):
        generate(family, PROMPT, "ar", max_tokens=4, stop=[""])


LINES = "a = 1\nb = 2\nc = 3\n"


def scripted(tokenizer, tokens: list[int], per_block: int, max_tokens: int,
             stops: list[str]) -> tuple[str, Optional[str]]:
    """Text and finish reason of `stream` over `tokens` committed `per_block` at a time."""
    blocks: Iterator[list[int]] = iter([[]] + [tokens[i:i + per_block]
                                              for i in range(0, len(tokens), per_block)])
    out = list(stream(tokenizer, blocks, 1, max_tokens, stops))
    return "".join(r.text for r in out), out[-1].finish_reason


def first_token_showing(tokenizer, ids: list[int], needle: str) -> int:
    """How many tokens of `ids` it takes for their text to contain `needle`."""
    return next(k for k in range(1, len(ids) + 1) if needle in tokenizer.decode(ids[:k]))


def stop_cases(tokenizer) -> list[tuple[str, list[int], int, list[str], str, str]]:
    """(case, tokens, max_tokens, stops, text, finish): stops in the block that also ends the
    generation by EOS or max_tokens; what autoregressive decoding would give."""
    ids = tokenizer.encode(LINES, add_special_tokens=False)
    eos = next(iter(tokenizer.eos_token_ids))
    k = first_token_showing(tokenizer, ids, "2")
    upto_k = tokenizer.decode(ids[:k])
    return [
        ("stops before eos, earliest wins", ids + [eos] + ids, 99, ["c =", "b ="], "a = 1\n", "stop"),
        ("stop completes on the last allowed token", ids, k, ["2"], upto_k[:upto_k.index("2")], "stop"),
        ("stop just past max_tokens", ids, k - 1, ["2"], tokenizer.decode(ids[:k - 1]), "length"),
        ("two stops complete on one token, the earlier start wins", ids, 99, ["= 2", " 1\nb = 2"],
         "a =", "stop"),
        ("held-back prefix released at eos", ids + [eos] + ids, 99, ["3\nzz"], LINES, "stop"),
        ("held-back prefix released at max_tokens", ids, len(ids), ["3\nzz"], LINES, "length"),
    ]


def test_stop_in_the_same_block_as_eos_or_max_tokens(family):
    """Whatever the block size (one token per step, or everything in one verified block), the
    text and the finish reason are those of token-by-token decoding."""
    tok = family.tokenizer
    for case, tokens, max_tokens, stops, text, finish in stop_cases(tok):
        for per_block in (1, len(tokens)):
            got = scripted(tok, tokens, per_block, max_tokens, stops)
            assert got == (text, finish), (case, per_block, got)


# --- failures during a generation ---------------------------------------------------------

def fail_after(monkeypatch, pieces: int, error: Exception) -> None:
    """Generations yield `pieces` real pieces, then raise `error`: one decoded alone
    (stream_generate) or in the batch (its lane's responses)."""
    real_stream, real_lane = server_mod.stream_generate, server_mod.lane

    def failing(responses):
        for i, r in enumerate(responses):
            if i == pieces:
                raise error
            yield r

    def failing_lane(*args, **kwargs):
        one = real_lane(*args, **kwargs)
        one.responses = failing(one.responses)
        return one

    monkeypatch.setattr(server_mod, "stream_generate",
                        lambda *args, **kwargs: failing(real_stream(*args, **kwargs)))
    monkeypatch.setattr(server_mod, "lane", failing_lane)


@pytest.mark.parametrize("error, code", [(RuntimeError("device lost"), 500),
                                         (ValueError("device lost"), 400)])
def test_error_mid_stream_ends_it_with_an_error_event(server, monkeypatch, error, code):
    """An exception after the stream started ends it with an error event (no [DONE]) instead
    of a silent hang-up; the generation lock is released for the next request."""
    fail_after(monkeypatch, 2, error)
    body = {"prompt": PROMPT, "max_tokens": 30, "strategy": "ar", "stream": True}
    status, _, payload = request(server, "POST", "/v1/completions", body, timeout=30)
    assert status == 200
    data = events(payload)
    assert len(data) == 3 and "[DONE]" not in data
    assert all("choices" in json.loads(e) for e in data[:2])
    err = json.loads(data[-1])["error"]
    assert "device lost" in err["message"] and err["code"] == code
    monkeypatch.undo()
    assert post(server, {"prompt": "x", "max_tokens": 2}, timeout=30)[0] == 200


@pytest.mark.parametrize("stream_it", [False, True])
def test_error_before_any_output_is_a_json_500(server, monkeypatch, stream_it):
    """An unexpected exception before anything was sent is a JSON 500 naming it, not a
    dropped connection."""
    fail_after(monkeypatch, 0, RuntimeError("boom"))
    status, out = post(server, {"prompt": PROMPT, "max_tokens": 8, "stream": stream_it}, timeout=30)
    assert status == 500 and "RuntimeError: boom" in out["error"]["message"]


# --- the stream's provenance extension ----------------------------------------------------

@pytest.mark.parametrize("path", ["/v1/completions", "/v1/chat/completions"])
def test_streamed_chunks_carry_their_texts_provenance(server, path):
    """Each chunk's `treegraft.provenance` runs make up exactly its text; on repetitive text
    the n-gram drafter's accepted drafts are named; the running counts grow and end at the
    usage's (the OpenAI fields of every chunk are as before: the earlier tests)."""
    chat = path.endswith("chat/completions")
    body = {"max_tokens": 24, "strategy": "ngram", **(
        {"messages": [{"role": "user", "content": REPETITIVE}]} if chat else {"prompt": REPETITIVE})}
    _, chunks = streamed(server, body, path)
    for c in chunks:
        piece = c["choices"][0]["delta"]["content"] if chat else c["choices"][0]["text"]
        assert "".join(t for t, _ in c["treegraft"]["provenance"]) == piece
    sources = {src for c in chunks for _, src in c["treegraft"]["provenance"]}
    assert {"ngram", "target"} <= sources <= {"ngram", "target"}
    tokens = [c["treegraft"]["tokens"] for c in chunks]
    assert tokens == sorted(tokens) and tokens[-1] == chunks[-1]["usage"]["completion_tokens"]
    assert chunks[-1]["treegraft"]["steps"] == chunks[-1]["usage"]["speculative"]["steps"]


# --- the chat page ------------------------------------------------------------------------

def test_the_chat_page_and_its_files_are_served_strictly(server):
    """/ is the page with a strict Content-Security-Policy; it uses no inline script, style
    or handler and only files under /static/, each served with its content type; our own
    files point nowhere outside the server; nothing else is served (no path escapes)."""
    status, ctype, page, resp = request(server, "GET", "/", full=True)
    assert status == 200 and ctype == "text/html; charset=utf-8"
    csp = resp.getheader("Content-Security-Policy")
    assert "default-src 'none'" in csp and "script-src 'self';" in csp and "unsafe" not in csp
    assert "img-src 'self' data:;" in csp and resp.getheader("X-Content-Type-Options") == "nosniff"
    html = page.decode()
    assert not re.search(r"<script(?![^>]*\bsrc=)|<style|\sstyle=|\son\w+=", html)
    refs = [r for r in re.findall(r'(?:src|href)="([^"]+)"', html) if r != "data:,"]
    types = {".js": "text/javascript; charset=utf-8", ".css": "text/css; charset=utf-8"}
    assert len(refs) == 6
    for ref in refs:
        status, ctype, payload = request(server, "GET", ref)
        assert ref.startswith("/static/") and status == 200 and payload, ref
        assert ctype == types[ref[ref.rfind("."):]], ref
    assert request(server, "GET", "/static/index.html")[2] == page
    for own in ("/", "/static/app.js", "/static/style.css"):
        assert not re.search(rb"https?://", request(server, "GET", own)[2]), own
    assert request(server, "GET", "/static/vendor/purify.LICENSE")[1] == "text/plain; charset=utf-8"
    for path in ("/static/nothing.js", "/static/../server.py", "/static/%2e%2e/server.py",
                 "/static/vendor", "/index.html"):
        assert request(server, "GET", path)[0] == 404, path


def test_config_reports_the_servers_defaults_and_strategies(server):
    """GET /treegraft/config: what the page shows as defaults, and strategies it can pick,
    each of which the server runs."""
    status, _, payload = request(server, "GET", "/treegraft/config")
    assert status == 200 and json.loads(payload) == {
        "model": "tg-tiny", "note": None, "strategy": "treegraft",
        "strategies": ["ar", "chain", "ngram", "draft", "treegraft", "treegraft-learned"],
        "max_tokens": LIMIT, "max_tokens_limit": LIMIT, "temperature": 0.0, "top_p": 1.0,
        "api_key_required": False}
    for strategy in json.loads(payload)["strategies"]:
        assert post(server, {"prompt": "x", "max_tokens": 2, "strategy": strategy})[0] == 200


# --- hardening ----------------------------------------------------------------------------

@pytest.mark.parametrize("size", [5 << 20, 24 << 20])
def test_an_oversized_body_gets_a_413_the_client_reads(server, size):
    """A client that sends its whole body before reading (http.client does) gets the 413,
    not a broken pipe: the server reads and drops the body (up to the drain cap)."""
    status, ctype, payload = request(server, "POST", "/v1/completions", raw=b"x" * size, timeout=60)
    assert status == 413 and ctype == "application/json"
    assert f"{size} bytes exceeds 4096" in json.loads(payload)["error"]["message"]


def test_a_body_past_the_drain_cap_is_answered_then_closed_cleanly(family):
    """Past the drain cap the 413 goes out at once and the connection closes lingering, so
    a client still sending its body reads the reply instead of a reset."""
    with running(family, max_body_bytes=4096, drain_bytes=1 << 20) as srv:
        status, _, payload = request(srv, "POST", "/v1/completions", raw=b"x" * (8 << 20),
                                     timeout=60)
    assert status == 413 and "8388608 bytes" in json.loads(payload)["error"]["message"]


def test_a_client_that_disconnects_mid_stream_ends_its_generation(family):
    """The generation of a client that goes away after two chunks ends at the next step, far
    short of its max_tokens, and is counted as disconnected; the next request is served
    once that step is done (it waits for the lock); after it nothing runs (steps stay put)."""
    limit = 1024
    with running(family, max_tokens_limit=limit) as srv:
        sock = open_stream(srv.server_port, {"prompt": PROMPT, "max_tokens": limit,
                                             "strategy": "ar"})
        read_events(sock, 2)
        sock.close()
        status, out = post(srv, {"prompt": "x", "max_tokens": 2}, timeout=60)
        after = status_of(srv)
        assert status_of(srv) == after
    assert status == 200 and out["usage"]["completion_tokens"] == 2
    assert after["finished"] == {"disconnected": 1, "length": 1} and not after["busy"]
    aborted = after["tokens"] - 2
    assert 2 <= aborted < limit // 4, aborted


@pytest.mark.parametrize("max_batch, max_queue", [(1, 2), (2, 1)])
def test_requests_past_the_queue_bound_get_503_with_retry_after(family, monkeypatch, max_batch,
                                                                max_queue):
    """With max_batch generations running (the first held at a gate: decoded alone, or
    joining the batch) and max_queue requests waiting, one more is refused at once, streamed
    or not: 503, Retry-After and an OpenAI-style error; the others are served once the gate
    opens."""
    gate, real_stream, real_lane = threading.Event(), server_mod.stream_generate, server_mod.lane

    def gated(*args, **kwargs):
        gate.wait(timeout=60)
        yield from real_stream(*args, **kwargs)

    def gated_lane(*args, **kwargs):
        gate.wait(timeout=60)
        return real_lane(*args, **kwargs)

    monkeypatch.setattr(server_mod, "stream_generate", gated)
    monkeypatch.setattr(server_mod, "lane", gated_lane)
    body = {"prompt": PROMPT, "max_tokens": 3}
    results: dict[int, tuple] = {}
    with running(family, max_tokens_limit=LIMIT, max_queue=max_queue,
                 max_batch=max_batch) as srv:
        gen = srv.generator
        clients = [threading.Thread(target=lambda i=i: results.update({i: post(srv, body)}))
                   for i in range(3)]
        for t in clients:
            t.start()
        with gen.changed:
            assert gen.changed.wait_for(lambda: gen.busy and gen.admitted == 3, timeout=60)
        assert status_of(srv)["queued"] == 2 and status_of(srv)["busy"]
        for stream_it in (False, True):
            status, ctype, payload, resp = request(srv, "POST", "/v1/completions",
                                                   {**body, "stream": stream_it},
                                                   timeout=10, full=True)
            assert status == 503 and ctype == "application/json"
            assert resp.getheader("Retry-After") == "1"
            err = json.loads(payload)["error"]
            waiting = 3 - max_batch
            assert f"busy: {waiting} requests already wait" in err["message"]
            assert err["code"] == 503
        gate.set()
        for t in clients:
            t.join(timeout=120)
    assert [results[i][0] for i in range(3)] == [200] * 3


def test_a_stalled_client_is_dropped_after_the_timeout(family):
    """--timeout: a connection that sends nothing or half its headers is dropped; one whose
    body stalls gets a 408 first; the server serves others all the while."""
    with running(family, timeout=0.5) as srv:
        assert reply_to(srv.server_port, b"") == b""
        assert reply_to(srv.server_port, b"POST /v1/completions HTTP/1.1\r\nContent-Le") == b""
        stalled = reply_to(srv.server_port, b"POST /v1/completions HTTP/1.1\r\n"
                           b"Content-Length: 100\r\n\r\n{\"prompt\"")
        assert stalled.startswith(b"HTTP/1.1 408") and b"stalled for 0.5 s" in stalled
        assert request(srv, "GET", "/v1/models")[0] == 200


def test_an_api_key_guards_the_api_but_not_the_page(family):
    """--api-key: /v1/* and /treegraft/* answer 401 (JSON, WWW-Authenticate) without the
    bearer key or with a wrong one, and as usual with it; the page loads without it."""
    key = {"Authorization": "Bearer sekret"}
    with running(family, max_tokens_limit=LIMIT, api_key="sekret") as srv:
        assert request(srv, "GET", "/")[0] == 200 and request(srv, "GET", "/static/app.js")[0] == 200
        for method, path, body in [("GET", "/v1/models", None), ("GET", "/treegraft/status", None),
                                   ("GET", "/treegraft/config", None),
                                   ("POST", "/v1/completions", {"prompt": "x", "max_tokens": 2})]:
            for headers in (None, {"Authorization": "Bearer wrong"}, {"Authorization": "sekret"}):
                status, _, payload, resp = request(srv, method, path, body, headers=headers,
                                                   full=True)
                assert status == 401 and resp.getheader("WWW-Authenticate") == "Bearer", path
                assert json.loads(payload)["error"]["type"] == "authentication_error"
            assert request(srv, method, path, body, headers=key)[0] == 200, path
        assert json.loads(request(srv, "GET", "/treegraft/config", headers=key)[2])[
            "api_key_required"] is True


def test_serve_flags_and_the_warning_without_a_key_off_loopback(monkeypatch):
    """`serve` passes --max-queue, --timeout and --api-key (or TREEGRAFT_API_KEY) to the
    server, and warns that there is no authentication only when it binds beyond loopback
    without a key."""
    made = []
    monkeypatch.setattr(server_mod, "make_server",
                        lambda family, host, port, config: made.append(config) or IdleServer())
    monkeypatch.delenv("TREEGRAFT_API_KEY", raising=False)

    def serve(*args, env=None) -> str:
        out = CliRunner().invoke(main, ["serve", "--no-autotune", *args], env=env)
        assert out.exit_code == 0, out.output
        return out.output

    assert "no authentication" in serve("--host", "0.0.0.0", "--max-queue", "3", "--timeout", "7")
    assert (made[-1].max_queue, made[-1].timeout, made[-1].api_key) == (3, 7.0, None)
    assert "no authentication" not in serve("--host", "0.0.0.0", env={"TREEGRAFT_API_KEY": "k"})
    assert made[-1].api_key == "k"
    assert "no authentication" not in serve("--host", "127.0.0.1")
    assert "no authentication" not in serve("--host", "::", "--api-key", "k2")
    assert made[-1].api_key == "k2"
    assert [is_loopback(h) for h in ("127.0.0.1", "127.3.0.1", "::1", "localhost")] == [True] * 4
    assert not any(is_loopback(h) for h in ("0.0.0.0", "", "::", "192.168.1.2", "example.com"))


def test_the_official_openai_client_streams_and_completes_as_the_api_does(server, family):
    """The `openai` package against our server: chat and text completions, streamed and not,
    give the library's greedy text; the provenance extension rides along where the client
    keeps unknown fields (`model_extra`) and changes nothing it parses; the API key path
    (a bearer token) is the client's own."""
    openai = pytest.importorskip("openai")
    client = openai.OpenAI(base_url=f"http://127.0.0.1:{server.server_port}/v1",
                           api_key="unused", max_retries=0)
    want = generate(family, PROMPT, "treegraft", max_tokens=24).text
    done = client.completions.create(model="tg-tiny", prompt=PROMPT, max_tokens=24,
                                     temperature=0)
    assert done.choices[0].text == want and done.usage.completion_tokens == 24
    pieces = list(client.completions.create(model="tg-tiny", prompt=PROMPT, max_tokens=24,
                                            temperature=0, stream=True))
    assert "".join(p.choices[0].text for p in pieces) == want
    runs = [run for p in pieces for run in p.model_extra["treegraft"]["provenance"]]
    assert "".join(text for text, _ in runs) == want
    messages = [{"role": "user", "content": "def add(a, b):"}]
    chat = chat_prompt(family.tokenizer, messages)
    want_chat = generate(family, chat, "treegraft", max_tokens=16).text
    reply = client.chat.completions.create(model="tg-tiny", messages=messages, max_tokens=16,
                                           temperature=0)
    assert reply.choices[0].message.content == want_chat
    chunks = client.chat.completions.create(model="tg-tiny", messages=messages, max_tokens=16,
                                            temperature=0, stream=True)
    assert "".join(c.choices[0].delta.content or "" for c in chunks) == want_chat
    with pytest.raises(openai.NotFoundError):
        client.completions.create(model="other", prompt=PROMPT, max_tokens=4)


def test_serve_with_draft_model_none_answers_with_the_default_strategy(monkeypatch):
    """`serve --draft-model none` (the default strategy, `treegraft`): the family it loads
    answers as `ar` does, with no drafter call, and one stderr line says the n-gram
    drafter serves alone."""
    made = []
    monkeypatch.setattr(server_mod, "make_server", lambda family, host, port, config:
                        made.append((family, config)) or IdleServer())
    out = CliRunner().invoke(main, ["serve", "--model", str(fixture_path() / "target"),
                                    "--draft-model", "none"])
    assert out.exit_code == 0, out.output
    assert [line for line in out.stderr.splitlines() if "n-gram" in line] == [
        "drafter: none (--draft-model none); the n-gram drafter alone serves"]
    family, config = made[-1]
    assert config.strategy == "treegraft"
    with running(family, strategy=config.strategy, model_id=config.model_id) as srv:
        status, reply = post(srv, {"prompt": PROMPT, "max_tokens": 16, "temperature": 0})
        assert status == 200, reply
        assert "treegraft" in json.loads(request(srv, "GET", "/treegraft/config")[2])[
            "strategies"]
    assert reply["choices"][0]["text"] == generate(family, PROMPT, "ar", max_tokens=16).text
    assert reply["usage"]["speculative"]["drafter_calls"] == 0


def test_the_page_config_says_the_bundled_family_is_a_test_model(monkeypatch):
    """`serve` on the bundled family hands the page (GET /treegraft/config) the line its
    stderr shows: a small test model, and the command that serves a real one."""
    made = []
    monkeypatch.setattr(server_mod, "make_server", lambda family, host, port, config:
                        made.append((family, config)) or IdleServer())
    out = CliRunner().invoke(main, ["serve", "--no-autotune"])
    assert out.exit_code == 0, out.output
    family, config = made[-1]
    with running(family, **vars(config)) as srv:
        note = json.loads(request(srv, "GET", "/treegraft/config")[2])["note"]
    assert note in out.stderr.splitlines() and "test model" in note
    assert "treegraft serve --model mlx-community/Qwen3-8B-4bit" in note


# --- requests decoded together ------------------------------------------------------------

def test_eight_streaming_clients_are_answered_as_serial_runs(family):
    """8 streaming clients at once into a batch of 4: six answered exactly as `generate`
    alone answers them (strategies, max_tokens and a stop string differ), one that goes away
    mid-stream is counted as disconnected, one bad request gets its 400; nobody stalls the
    batch, and the status shows requests decoded together."""
    prompts = [p for p in (PROMPT, REPETITIVE, "class Stack:\n    def push(self, item):\n",
                           "import os\n", "x = [", "def main():\n")]
    bodies = [{"prompt": p, "max_tokens": 12 + 6 * i, "strategy": s}
              for i, (p, s) in enumerate(zip(prompts, ["treegraft", "ngram", "ar", "treegraft",
                                                        "draft", "ngram"]))]
    bodies[0]["stop"] = ["\n\n"]
    results, seen = {}, []
    with running(family, max_tokens_limit=1024, max_batch=4) as srv:
        def call(i):
            results[i] = streamed(srv, bodies[i])

        def leave():
            sock = open_stream(srv.server_port, {"prompt": PROMPT, "max_tokens": 1024,
                                                 "strategy": "ar"})
            read_events(sock, 2)
            sock.close()

        def bad():
            results["bad"] = post(srv, {"prompt": PROMPT, "temperature": "hot"})

        def watch():
            while len(results) < 7:
                seen.append(status_of(srv)["batch"])
                time.sleep(0.005)

        threads = ([threading.Thread(target=call, args=(i,)) for i in range(6)]
                   + [threading.Thread(target=f) for f in (leave, bad, watch)])
        for t in threads:
            t.start()
        for t in threads:
            t.join(timeout=300)
        assert not any(t.is_alive() for t in threads)
        with srv.generator.changed:
            assert srv.generator.changed.wait_for(lambda: not srv.generator.busy, timeout=60)
        status = status_of(srv)
    assert results["bad"][0] == 400 and "temperature" in results["bad"][1]["error"]["message"]
    for i, body in enumerate(bodies):
        ref = generate(family, body["prompt"], body["strategy"], max_tokens=body["max_tokens"],
                       stop=body.get("stop", ()))
        text, chunks = results[i]
        assert text == ref.text, body
        assert chunks[-1]["choices"][0]["finish_reason"] == ref.finish_reason
        assert chunks[-1]["usage"]["completion_tokens"] == len(ref.token_ids)
    assert status["finished"].get("disconnected") == 1 and sum(status["finished"].values()) == 7
    assert max(seen) >= 2 and status["max_batch"] == 4 and status["rows_per_forward"] > 1
    assert status["batch"] == 0 and status["queued"] == 0
