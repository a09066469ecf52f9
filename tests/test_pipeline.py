"""The target split over local processes: mlx.launch, ring backend over 127.0.0.1."""

import json
import os
import shutil
import socket
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest

from treegraft_mlx import fixture_path, generate, load
from treegraft_mlx.pipeline import (CAUSAL, CONTROL, NO_MASK, TREE, Frame, PipelineError,
                                    plan_stages)

RUNNER = Path(__file__).parent / "pipeline_runner.py"
needs_launch = pytest.mark.skipif(shutil.which("mlx.launch") is None, reason="no mlx.launch")


def launch(ranks: int, mode: str, timeout: float = 600, **env: str) -> subprocess.CompletedProcess:
    """The ranks share this machine's cores, and MLX's ring backend polls while it waits:
    one BLAS thread per rank keeps them from starving each other."""
    return subprocess.run(["mlx.launch", "-n", str(ranks), "--backend", "ring", "--",
                           sys.executable, str(RUNNER), mode],
                          capture_output=True, text=True, timeout=timeout,
                          env={**os.environ, "OPENBLAS_NUM_THREADS": "1", **env})


def json_line(text: str) -> dict:
    lines = [line for line in text.splitlines() if line.startswith("{")]
    assert len(lines) == 1, text[-2000:]
    return json.loads(lines[0])


@pytest.mark.parametrize("frame", [
    Frame(cache=2, rows=3, context=40, mask_kind=TREE, ops=[2, 2, 41, 3, 2, 2, 0, 1],
          positions=[40, 41, 41], mask_bits=np.array([[1], [3], [5]], dtype=np.uint32),
          logits_rows=[0, 2]),
    Frame(cache=1, rows=5, context=0, mask_kind=CAUSAL, ops=[1, 1, 0]),
    Frame(rows=1, context=7, mask_kind=NO_MASK, logits_rows=[]),
])
def test_a_frame_reads_back_as_it_was_packed(frame):
    """What a rank sends is what the next one reads: control words that size the payload,
    the payload, then the hidden states' bytes."""
    import mlx.core as mx

    hidden = mx.arange(frame.rows * 4, dtype=mx.float32).reshape(1, frame.rows, 4)
    wire = np.array(frame.pack(hidden)).tolist()
    control = wire[:CONTROL]
    n = Frame.sizes(control)
    back = Frame.read(control, wire[CONTROL:CONTROL + n])
    assert back.control() == frame.control() and back.payload() == frame.payload()
    assert (back.ops, back.positions, back.logits_rows) == (frame.ops, frame.positions,
                                                            frame.logits_rows)
    got = mx.array(wire[CONTROL + n:], dtype=mx.int32).view(mx.float32)
    assert got.tolist() == hidden.reshape(-1).tolist()
    if frame.mask_kind == TREE:
        assert (back.mask().bits == frame.mask_bits).all() and back.mask().context == 40


@pytest.fixture(scope="module")
def runner():
    sys.path.insert(0, str(RUNNER.parent))
    import pipeline_runner

    return pipeline_runner


@pytest.fixture(scope="module")
def one_process(runner) -> dict:
    return runner.cases(load(fixture_path(), warmup=False, autotune=False))


@needs_launch
@pytest.mark.parametrize("ranks", [2, 3])
def test_split_target_generates_what_one_process_does(one_process, ranks):
    """Greedy (ar, ngram, treegraft) and seeded sampled (ar, treegraft) output, token for
    token, and a second turn that reuses the session's cache on every rank."""
    r = launch(ranks, "generate")
    assert r.returncode == 0, r.stdout[-2000:] + r.stderr[-2000:]
    assert json_line(r.stdout) == one_process
    first, second = one_process["session"]
    assert len(first) == len(second) == 12


@needs_launch
def test_per_step_sizing_across_ranks_decides_as_one_process_does(runner):
    """With sizing on (scripted costs and clock, as the in-process tests have), rank 0 runs
    the adaptive loop over the split target: the same rows verified at every step, the same
    output."""
    family = runner.adaptive(load(fixture_path(), warmup=False))
    assert family.tree.adaptive
    expected = runner.cases(family)
    steps = generate(family, runner.PROMPTS[0], "treegraft", max_tokens=20).step_stats
    assert any(s.rows > 1 and s.accepted for s in steps)           # trees were verified
    r = launch(2, "adaptive")
    assert r.returncode == 0, r.stdout[-2000:] + r.stderr[-2000:]
    assert json_line(r.stdout) == expected


@needs_launch
def test_a_lost_rank_ends_the_others_with_a_message():
    r = launch(3, "die", timeout=300)
    assert "PipelineError: rank 0:" in r.stdout and "failed" in r.stdout, r.stdout[-2000:]


@needs_launch
def test_a_hung_rank_ends_the_others_within_the_timeout():
    """Rank 1 keeps its connections but stops answering: rank 0's deadline ends it, and
    mlx.launch then ends the rest."""
    r = launch(2, "hang", timeout=300, TREEGRAFT_PIPELINE_TIMEOUT="8")
    out = r.stdout + r.stderr
    assert "rank 0: waiting for logits from rank 1 timed out" in out, out[-2000:]
    assert "rank 0 exited with code 3" in out                     # the watchdog's exit


@needs_launch
def test_an_idle_rank_ends_at_its_idle_deadline():
    """Rank 0 stops sending after one generation: rank 1 waits for its next request no
    longer than TREEGRAFT_PIPELINE_IDLE_TIMEOUT, then ends with a message."""
    r = launch(2, "idle", timeout=300, TREEGRAFT_PIPELINE_IDLE_TIMEOUT="4",
               TREEGRAFT_PIPELINE_TIMEOUT="3600")   # only the idle deadline can end it in time
    out = r.stdout + r.stderr
    assert "rank 1: waiting for rank 0's next request from rank 0 timed out" in out, out[-2000:]
    assert "rank 1 exited with code 3" in out


@needs_launch
def test_a_stage_that_does_not_fit_names_its_layers():
    r = launch(2, "nofit", timeout=120)
    assert r.stdout.count("does not fit") == 2, r.stdout[-2000:]
    assert "rank 0 (layers 0-" in r.stdout and "rank 1 (layers " in r.stdout
    assert "of 8, split over 2 ranks)" in r.stdout and "add ranks" in r.stdout


def free_ports(n: int) -> list[int]:
    sockets = [socket.socket() for _ in range(n)]
    for s in sockets:
        s.bind(("127.0.0.1", 0))
    ports = [s.getsockname()[1] for s in sockets]
    for s in sockets:
        s.close()
    return ports


def test_an_unreachable_rank_is_named_not_waited_for(tmp_path):
    """Rank 0 of two started alone (its peer's host never runs the command): MLX's ring
    backend would wait for the peer forever; the connect's deadline ends it with a message."""
    hosts = tmp_path / "hosts.json"
    hosts.write_text(json.dumps([[f"127.0.0.1:{p}"] for p in free_ports(2)]))
    r = subprocess.run([sys.executable, "-c", "from treegraft_mlx.cli import main; main()",
                        "generate", "--pipeline",
                        "--prompt", "def f():", "--max-tokens", "4"],
                       capture_output=True, text=True, timeout=300,
                       env={**os.environ, "MLX_RANK": "0", "MLX_HOSTFILE": str(hosts),
                            "TREEGRAFT_PIPELINE_TIMEOUT": "5"})
    assert r.returncode != 0, r.stdout[-2000:] + r.stderr[-2000:]
    assert "rank 0: connecting to the other ranks" in r.stderr and "timed out" in r.stderr


def test_chat_across_ranks_replies_as_one_process_does(tmp_path):
    """`treegraft chat --pipeline` on two ranks started by hand (rank 0 reads the chat from
    stdin, rank 1 only serves its layers): both turns reply what one process generates, and
    rank 1 ends when rank 0 quits."""
    from treegraft_mlx.generate import chat_prompt

    hosts = tmp_path / "hosts.json"
    hosts.write_text(json.dumps([[f"127.0.0.1:{p}"] for p in free_ports(2)]))
    cmd = [sys.executable, "-c", "from treegraft_mlx.cli import main; main()", "chat",
           "--pipeline", "--no-autotune", "--max-tokens", "8", "--strategy", "ngram"]
    env = {**os.environ, "MLX_HOSTFILE": str(hosts), "OPENBLAS_NUM_THREADS": "1"}
    peer = subprocess.Popen(cmd, stdin=subprocess.DEVNULL, stdout=subprocess.PIPE,
                            stderr=subprocess.STDOUT, text=True, env={**env, "MLX_RANK": "1"})
    try:
        r = subprocess.run(cmd, input="def f():\nand again\n/quit\n", capture_output=True,
                           text=True, timeout=300, env={**env, "MLX_RANK": "0"})
        peer_out = peer.communicate(timeout=120)[0]
    finally:
        peer.kill()
    assert r.returncode == 0 and peer.returncode == 0, r.stderr[-2000:] + peer_out[-2000:]
    family = load(fixture_path(), warmup=False, autotune=False)
    turn1 = [{"role": "user", "content": "def f():"}]
    reply1 = generate(family, chat_prompt(family.tokenizer, turn1), "ar", max_tokens=8).text
    turn2 = turn1 + [{"role": "assistant", "content": reply1},
                     {"role": "user", "content": "and again"}]
    reply2 = generate(family, chat_prompt(family.tokenizer, turn2), "ar", max_tokens=8).text
    assert f">> {reply1}\n" in r.stdout and f">> {reply2}\n" in r.stdout, r.stdout[-2000:]


def test_serve_across_ranks_answers_as_one_process_does(tmp_path):
    """`treegraft serve --pipeline` on two ranks started by hand: rank 0 answers HTTP with
    what one process generates; on Ctrl-C it stops, and rank 1 with it. Each rank's stderr
    goes to a file (a pipe nobody reads could fill and block it); a rank that does not stop
    is sent SIGABRT, so Python's fault handler writes every thread's stack there."""
    import signal
    import time
    import urllib.request

    ring, http = free_ports(2), free_ports(1)[0]
    hosts = tmp_path / "hosts.json"
    hosts.write_text(json.dumps([[f"127.0.0.1:{p}"] for p in ring]))
    # Ctrl-C raises KeyboardInterrupt in each rank even where this process ignores SIGINT (a
    # test run started in the background of a script does, and its children inherit that).
    main = ("import signal; signal.signal(signal.SIGINT, signal.default_int_handler); "
            "from treegraft_mlx.cli import main; main()")
    cmd = [sys.executable, "-X", "faulthandler", "-c", main,
           "serve", "--pipeline", "--no-autotune", "--port", str(http), "--strategy", "ngram"]
    env = {**os.environ, "MLX_HOSTFILE": str(hosts), "OPENBLAS_NUM_THREADS": "1"}
    logs = [tmp_path / f"rank{r}.log" for r in (1, 0)]
    ranks = [subprocess.Popen(cmd, stdin=subprocess.DEVNULL, stdout=subprocess.DEVNULL,
                              stderr=log.open("w"), env={**env, "MLX_RANK": str(r)})
             for r, log in zip((1, 0), logs)]
    peer, head = ranks
    said = lambda: "\n".join(f"rank {r}: {log.read_text()[-3000:]}"
                              for r, log in zip((1, 0), logs))
    try:
        deadline = time.monotonic() + 300
        while "serving" not in logs[1].read_text():    # ready once it says where it serves
            assert head.poll() is None and time.monotonic() < deadline, said()
            time.sleep(0.2)
        body = json.dumps({"prompt": "def f():", "max_tokens": 8, "temperature": 0}).encode()
        req = urllib.request.Request(f"http://127.0.0.1:{http}/v1/completions", body,
                                     {"Content-Type": "application/json"})
        with urllib.request.urlopen(req, timeout=120) as resp:
            answer = json.loads(resp.read())
        head.send_signal(signal.SIGINT)
        for proc in (head, peer):
            try:
                proc.wait(timeout=120)
            except subprocess.TimeoutExpired:
                proc.send_signal(signal.SIGABRT)     # the fault handler dumps its stacks
                proc.wait(timeout=30)
    finally:
        for proc in ranks:
            proc.kill()
            proc.wait()
    assert head.returncode == 0 and peer.returncode == 0, said()
    family = load(fixture_path(), warmup=False, autotune=False)
    assert answer["choices"][0]["text"] == generate(family, "def f():", "ar", max_tokens=8).text


@needs_launch
def test_ranks_that_differ_refuse_to_start():
    r = launch(2, "disagree", timeout=120)
    assert r.stdout.count("the ranks differ in a test value") == 2, r.stdout[-2000:]


def test_layers_are_cut_by_bytes():
    stages = plan_stages([10] * 8, first_extra=30, last_extra=30, ranks=2)
    assert [(s.first, s.last) for s in stages] == [(0, 4), (4, 8)]
    stages = plan_stages([10] * 8, first_extra=40, last_extra=0, ranks=2)  # the embedding
    assert [(s.first, s.last) for s in stages] == [(0, 2), (2, 8)]          # weighs on rank 0
    stages = plan_stages([10] * 3, first_extra=100, last_extra=0, ranks=3)
    assert [(s.first, s.last) for s in stages] == [(0, 1), (1, 2), (2, 3)]  # one layer each
    assert stages[0].is_first and stages[-1].is_last and not stages[1].is_first
    with pytest.raises(PipelineError, match="only 3 layers"):
        plan_stages([10] * 3, 0, 0, ranks=4)
