"""The OpenAI-compatible server, exercised over real HTTP on 127.0.0.1; stop strings through
`generate.stream`, the library and the server."""

import http.client
import json
import random
import string
import threading
from typing import Iterator, Optional

import pytest
from scripted import deterministic
from click.testing import CliRunner

from treegraft_mlx import fixture_path, generate, load
from treegraft_mlx import server as server_mod
from treegraft_mlx.cli import main
from treegraft_mlx.generate import chat_prompt, encode_prompt, stream
from treegraft_mlx.server import ServerConfig, make_server

PROMPT = "def parse_header(line):\n    \"\"\"Split a header line into name and value.\"\"\"\n"
REPETITIVE = "a = 1\nb = 2\n" * 8   # the n-gram drafter accepts several tokens per step here
LIMIT = 64                            # the test server's max_tokens_limit


@pytest.fixture(scope="module")
def family():
    return deterministic(load(fixture_path()))   # step counts repeat: no load-driven choices


@pytest.fixture(scope="module")
def server(family):
    srv = make_server(family, "127.0.0.1", 0, ServerConfig(max_tokens_limit=LIMIT, max_body_bytes=4096))
    thread = threading.Thread(target=srv.serve_forever, daemon=True)
    thread.start()
    yield srv
    srv.shutdown()
    srv.server_close()


def request(server, method, path, body=None, raw=None, timeout: float = 120):
    conn = http.client.HTTPConnection("127.0.0.1", server.server_port, timeout=timeout)
    data = raw if raw is not None else (json.dumps(body).encode() if body is not None else None)
    conn.request(method, path, body=data, headers={"Content-Type": "application/json"})
    resp = conn.getresponse()
    payload = resp.read()
    conn.close()
    return resp.status, resp.getheader("Content-Type"), payload


def post(server, body: dict, path: str = "/v1/completions", timeout: float = 120) -> tuple[int, dict]:
    """Status and JSON reply of a non-streamed request."""
    status, _, payload = request(server, "POST", path, body, timeout=timeout)
    return status, json.loads(payload)


def events(payload: bytes) -> list[str]:
    """The `data:` fields of a server-sent event stream."""
    return [e[6:] for e in payload.decode().split("\n\n") if e.startswith("data: ")]


def streamed(server, body: dict, path: str = "/v1/completions") -> tuple[str, list[dict]]:
    """Concatenated text of a streamed request (ending in [DONE]) and its chunks."""
    status, ctype, payload = request(server, "POST", path, {**body, "stream": True})
    assert status == 200 and ctype.startswith("text/event-stream"), payload
    data = events(payload)
    assert data[-1] == "[DONE]"
    chunks = [json.loads(e) for e in data[:-1]]
    chat = path.endswith("chat/completions")
    text = "".join(c["choices"][0]["delta"]["content"] if chat else c["choices"][0]["text"]
                   for c in chunks)
    return text, chunks


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
    assert json.loads(cli.output)["text"] == text


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

def failing_after(pieces: int, error: Exception):
    """A stream_generate that yields `pieces` real pieces, then raises `error`."""
    real = server_mod.stream_generate

    def fake(*args, **kwargs):
        for i, r in enumerate(real(*args, **kwargs)):
            if i == pieces:
                raise error
            yield r
    return fake


@pytest.mark.parametrize("error, code", [(RuntimeError("device lost"), 500),
                                         (ValueError("device lost"), 400)])
def test_error_mid_stream_ends_it_with_an_error_event(server, monkeypatch, error, code):
    """An exception after the stream started ends it with an error event (no [DONE]) instead
    of a silent hang-up; the generation lock is released for the next request."""
    monkeypatch.setattr(server_mod, "stream_generate", failing_after(2, error))
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
    monkeypatch.setattr(server_mod, "stream_generate", failing_after(0, RuntimeError("boom")))
    status, out = post(server, {"prompt": PROMPT, "max_tokens": 8, "stream": stream_it}, timeout=30)
    assert status == 500 and "RuntimeError: boom" in out["error"]["message"]
