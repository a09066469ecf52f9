"""What an app that launches `treegraft serve` relies on (TreegraftKit's TreegraftServer):
the ready line with the real port, /health without a key, and the server's exit when its
standard input closes (--exit-on-stdin-close)."""

import json
import os
import re
import subprocess
import sys
import threading
import urllib.request

import pytest
from click.testing import CliRunner
from scripted import deterministic
from serving import IdleServer, request, running

from treegraft_mlx import fixture_path, load
from treegraft_mlx import server as server_mod
from treegraft_mlx.cli import main
from treegraft_mlx.server import make_server, stop_when_closed

READY = re.compile(r"serving (\S+) \((\S+)\) on (http://127\.0\.0\.1:(\d+))$")


@pytest.fixture(scope="module")
def family():
    return deterministic(load(fixture_path()))


def test_health_needs_no_key_and_says_whether_the_model_is_loaded(family):
    """With an API key, /health answers without it (and only says the model is loaded);
    the API still refuses; once the generator is closed, health says it is not loaded."""
    with running(family, api_key="k") as srv:
        status, ctype, payload = request(srv, "GET", "/health")
        assert (status, ctype) == (200, "application/json")
        assert json.loads(payload) == {"status": "ok", "loaded": True, "model": "tg-tiny"}
        assert request(srv, "GET", "/treegraft/status")[0] == 401
    assert srv.generator.health() == {"status": "stopping", "loaded": False, "model": "tg-tiny"}


def test_stop_when_closed_ends_serving_when_the_stream_ends(family):
    """The server keeps serving while its stream is open (bytes read are dropped), and
    serve_forever returns once the stream's writer closes."""
    srv = make_server(family, "127.0.0.1", 0)
    read_fd, write_fd = os.pipe()
    thread = threading.Thread(target=srv.serve_forever, daemon=True)
    thread.start()
    try:
        with os.fdopen(read_fd, "rb") as reader:
            watcher = stop_when_closed(srv, reader)
            os.write(write_fd, b"anything\n")
            thread.join(0.5)
            assert thread.is_alive() and request(srv, "GET", "/health")[0] == 200
            os.close(write_fd)
            thread.join(30)
            watcher.join(30)
            assert not thread.is_alive() and not watcher.is_alive()
    finally:
        srv.server_close()


def test_serve_watches_stdin_only_with_the_flag(monkeypatch):
    """`serve` hands its standard input to stop_when_closed only under
    --exit-on-stdin-close (a server started from a terminal ignores stdin)."""
    watched = []
    monkeypatch.setattr(server_mod, "make_server", lambda *a: IdleServer())
    monkeypatch.setattr(server_mod, "stop_when_closed", lambda srv, stream: watched.append(srv))
    for args, expected in (([], 0), (["--exit-on-stdin-close"], 1)):
        out = CliRunner().invoke(main, ["serve", "--no-autotune", *args])
        assert out.exit_code == 0, out.output
        assert len(watched) == expected, args


def test_serve_reports_its_port_and_exits_when_stdin_closes():
    """A real `serve --port 0 --exit-on-stdin-close` process: its ready line names the port
    it listens on, /health answers there, and closing its stdin ends it with status 0."""
    command = [sys.executable, "-c", "from treegraft_mlx.cli import main; main()", "serve",
               "--no-autotune", "--port", "0", "--exit-on-stdin-close", "--api-key", "k"]
    proc = subprocess.Popen(command, stdin=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    try:
        ready = None
        for line in proc.stderr:
            if ready := READY.match(line.strip()):
                break
        assert ready, "serve ended without its ready line"
        assert ready.group(1, 2) == ("tg-tiny", "treegraft")
        with urllib.request.urlopen(f"{ready.group(3)}/health", timeout=30) as reply:
            assert json.loads(reply.read())["loaded"] is True
        proc.stdin.close()
        assert proc.wait(timeout=60) == 0
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()
        proc.stderr.close()
