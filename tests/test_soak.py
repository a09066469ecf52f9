"""A server soak on loopback, bounded in count and time: concurrent clients mixing streamed,
plain, disconnecting and oversized requests against a small queue bound. Every request is
answered, refused with 503 or ended by its own client; greedy answers equal the serial ones;
the process's memory after the soak stays within a bound of what it was before."""

import http.client
import json
import threading
import time
from collections import Counter

import pytest
from scripted import deterministic
from serving import chunks_of, request, running, status_of, streamed

from treegraft_mlx import fixture_path, generate, load

CLIENTS, ROUNDS = 8, 10
MAX_TOKENS = 12
MAX_QUEUE = 4                 # small: with eight clients some requests find the queue full
RSS_BOUND_MB = 64             # growth allowed over the soak, after one warm-up generation
OVERSIZED = b"x" * (5 << 20)  # past the server's 4096-byte body limit (one buffer for all)
PROMPTS = ["def parse_header(line):\n", "class Stack:\n    def push(self, item):\n",
           "a = 1\nb = 2\n" * 4, "import os\n\n\ndef main():\n"]
KINDS = ("plain", "stream", "disconnect", "oversized")


@pytest.fixture(scope="module")
def family():
    return deterministic(load(fixture_path()))


def rss_mb() -> float:
    """This process's resident memory (the server runs in it)."""
    with open("/proc/self/status") as f:
        line = next(line for line in f if line.startswith("VmRSS:"))
    return int(line.split()[1]) / 1024


def refused(status: int, resp) -> bool:
    return status == 503 and resp.getheader("Retry-After") == "1"


def one(srv, kind: str, prompt: str, serial: dict) -> str:
    """Run one request of `kind`; its outcome: "answered", "refused" or "ended by client"."""
    body = {"prompt": prompt, "max_tokens": MAX_TOKENS}
    if kind == "oversized":
        status, _, _ = request(srv, "POST", "/v1/completions", raw=OVERSIZED, timeout=120)
        assert status == 413
        return "answered"
    if kind == "disconnect":       # reads the first event, then hangs up
        conn = http.client.HTTPConnection("127.0.0.1", srv.server_port, timeout=120)
        conn.request("POST", "/v1/completions", json.dumps({**body, "stream": True}),
                     {"Content-Type": "application/json"})
        resp = conn.getresponse()
        status, payload = resp.status, resp.fp.readline() if resp.status == 200 else resp.read()
        resp.close()
        conn.close()
        if status == 200:
            assert payload.startswith(b"data: ")
            return "ended by client"
    if kind == "stream":
        status, ctype, payload, resp = request(srv, "POST", "/v1/completions",
                                               {**body, "stream": True}, full=True)
        if status == 200:
            assert chunks_of(payload)[0] == serial[prompt]
            return "answered"
    else:
        status, _, payload, resp = request(srv, "POST", "/v1/completions", body, full=True)
        if status == 200:
            assert json.loads(payload)["choices"][0]["text"] == serial[prompt]
            return "answered"
    assert refused(status, resp), (status, payload)
    return "refused"


def test_soak(family):
    serial = {p: generate(family, p, "treegraft", max_tokens=MAX_TOKENS).text for p in PROMPTS}
    outcomes: Counter = Counter()
    failures: list[BaseException] = []
    with running(family, max_tokens_limit=64, max_body_bytes=4096, max_queue=MAX_QUEUE) as srv:
        assert streamed(srv, {"prompt": PROMPTS[0], "max_tokens": MAX_TOKENS})[0] == serial[PROMPTS[0]]
        before, t0 = rss_mb(), time.perf_counter()

        def client(c: int) -> None:
            try:
                for r in range(ROUNDS):
                    kind = KINDS[(c + r) % len(KINDS)]
                    outcome = one(srv, kind, PROMPTS[(c * ROUNDS + r) % len(PROMPTS)], serial)
                    outcomes[(kind, outcome)] += 1
            except BaseException as e:  # the test thread re-raises it
                failures.append(e)

        threads = [threading.Thread(target=client, args=(c,)) for c in range(CLIENTS)]
        for t in threads:
            t.start()
        for t in threads:
            t.join(timeout=600)           # a hang guard: the soak takes seconds
        gen = srv.generator
        with gen.changed:                     # a hung-up client's generation ends its step
            assert gen.changed.wait_for(lambda: gen.admitted == 0, timeout=120)
        wall, after = time.perf_counter() - t0, rss_mb()
        status = status_of(srv)
    if failures:
        raise failures[0]
    assert not any(t.is_alive() for t in threads)
    assert sum(outcomes.values()) == CLIENTS * ROUNDS
    generated = sum(n for (kind, outcome), n in outcomes.items()
                    if kind != "oversized" and outcome != "refused")
    assert sum(status["finished"].values()) == generated + 1      # the warm-up's too
    assert not status["busy"] and status["queued"] == 0
    print(f"\nsoak: {CLIENTS} clients x {ROUNDS} requests in {wall:.1f} s: "
          f"{dict(sorted(outcomes.items()))}; server finish reasons {status['finished']}; "
          f"RSS {before:.0f} MB before, {after:.0f} MB after")
    assert after - before < RSS_BOUND_MB, (before, after)
