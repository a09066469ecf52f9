"""The target split by layers across machines (`mx.distributed`): rank 0 drafts, builds the tree
and accepts; every rank holds a slice of the target's layers and its own KV cache.

Launched by `mlx.launch` (ring backend over TCP by default, or MPI), e.g.
    mlx.launch --hosts mac1,mac2 -- treegraft generate --pipeline --model <dir> --prompt ...
Each rank loads only its own layers (cut by weight bytes; rank 0 also holds the embedding, the
last rank the final norm and head). A forward is one message per hop, down the ranks and back:
rank r sends rank r + 1 a frame (the block's size, context, positions, tree-mask bits and
logits rows, the cache operations since the last forward, then its hidden states); the last
rank sends the chosen rows' logits to rank 0. Cache operations (new cache, commit, keep the
accepted path, reset) ride in the next frame: every rank compacts its own cache with no round
trip of its own, and no hop carries two messages in a row (which TCP's small-packet delays
would stall for tens of milliseconds). Every exchange has a
deadline (TREEGRAFT_PIPELINE_TIMEOUT seconds, default 120; waiting for rank 0's next request,
TREEGRAFT_PIPELINE_IDLE_TIMEOUT, default 3600): a lost peer or a missed deadline ends the rank
with a message that names it, never a silent hang.
"""

from __future__ import annotations

import hashlib
import json
import os
import subprocess
import sys
import threading
import time
from contextlib import contextmanager
from dataclasses import dataclass, field
from importlib import metadata
from pathlib import Path
from typing import Iterator, Optional, Sequence

import mlx.core as mx
import numpy as np

from .models.forward import Forward
from .tree import TreeMask

CONTROL = 9                  # int32 control words a frame opens with (Frame.control)
FORWARD, STOP = 1, 2
NEW, COMMIT, KEEP, RESET = 1, 2, 3, 4  # cache operations: (op, cache, arg[, rows...])
NO_MASK, CAUSAL, TREE = 0, 1, 2


class PipelineError(RuntimeError):
    """A rank cannot go on: a peer was lost, did not answer in time, or differs."""


def timeout_s(idle: bool = False) -> float:
    name, default = (("TREEGRAFT_PIPELINE_IDLE_TIMEOUT", 3600.0) if idle
                     else ("TREEGRAFT_PIPELINE_TIMEOUT", 120.0))
    return float(os.environ.get(name, default))


def timed_out(rank, what: str) -> str:
    return f"treegraft pipeline, rank {rank}: {what} timed out; ending this rank"


class Watchdog:
    """Ends the process with a message when a bounded wait overruns: a blocked `mx.eval` (which
    releases the GIL) cannot be interrupted from Python, so a thread watches the deadline."""

    def __init__(self, rank: int):
        self.rank = rank
        self._deadline: Optional[tuple[float, str]] = None
        threading.Thread(target=self._watch, daemon=True).start()

    def _watch(self) -> None:
        while True:
            time.sleep(0.2)
            pending = self._deadline
            if pending is not None and time.monotonic() > pending[0]:
                print(timed_out(self.rank, pending[1]), file=sys.stderr, flush=True)
                os._exit(3)

    @contextmanager
    def bound(self, seconds: float, what: str) -> Iterator[None]:
        self._deadline = (time.monotonic() + seconds, what)
        try:
            yield
        finally:
            self._deadline = None


WATCHER = """
import os, select, signal, sys
pid, seconds, message = int(sys.argv[1]), float(sys.argv[2]), sys.argv[3]
if not select.select([sys.stdin], [], [], seconds)[0]:
    sys.stderr.write(message)
    sys.stderr.flush()
    os.kill(pid, signal.SIGTERM)
"""


@contextmanager
def watched_from_outside(seconds: float, what: str) -> Iterator[None]:
    """A deadline for a call that holds the GIL while it waits (the ring backend's connect
    waits for an absent peer forever), so no thread of this process can act: a small watcher
    process ends this one with a message unless the call returns in time."""
    message = timed_out(os.environ.get("MLX_RANK", "0"), what) + "\n"
    watcher = subprocess.Popen([sys.executable, "-c", WATCHER, str(os.getpid()), str(seconds),
                                message], stdin=subprocess.PIPE)
    try:
        yield
    finally:
        watcher.stdin.close()
        watcher.wait()


class Link:
    """Point-to-point messages between ranks, each under a deadline (Watchdog). MLX's ring
    backend raises when a peer's connection drops; a peer that hangs is caught by the watchdog."""

    def __init__(self, group):
        self.group, self.rank, self.size = group, group.rank(), group.size()
        self.comm_s = 0.0  # time spent in exchanges on this rank
        self.broken = False  # a peer was lost: nothing more is sent
        self.watchdog = Watchdog(self.rank)

    def _run(self, x: mx.array, what: str, idle: bool = False) -> mx.array:
        t0 = time.perf_counter()
        try:
            with self.watchdog.bound(timeout_s(idle), what):
                mx.eval(x)
        except RuntimeError as e:
            self.broken = True
            raise PipelineError(f"rank {self.rank}: {what} failed: {e}") from None
        if not idle:
            self.comm_s += time.perf_counter() - t0
        return x

    def send(self, x: mx.array, dst: int, what: str) -> None:
        self._run(mx.distributed.send(x, dst, group=self.group),
                  f"sending {what} to rank {dst}")

    def recv(self, shape, dtype, src: int, what: str, idle: bool = False) -> mx.array:
        return self._run(mx.distributed.recv(tuple(shape), dtype, src, group=self.group),
                         f"waiting for {what} from rank {src}", idle)

    def agree(self, value: str, what: str) -> None:
        """Every rank holds the same `value` (a version, a model), or every rank stops."""
        digest = np.frombuffer(hashlib.sha256(value.encode()).digest()[:8], dtype=np.int32)
        mine = mx.array(digest)
        got = self._run(mx.distributed.all_gather(mine[None], group=self.group),
                        f"comparing {what}")
        if not (np.array(got) == np.array(mine)).all():
            raise PipelineError(f"rank {self.rank}: the ranks differ in {what}; install the same "
                                "package versions and the same model on every host")


@dataclass(frozen=True)
class Stage:
    """One rank's share of the target: layers [first, last), the embedding on the first
    stage, the final norm and head on the last (the embedding too when the head is tied)."""
    first: int
    last: int
    is_first: bool
    is_last: bool

    def keeps(self, name: str, tied: bool) -> bool:
        if name.startswith("model.layers."):
            return self.first <= int(name.split(".")[2]) < self.last
        if name.startswith("model.embed_tokens."):
            return self.is_first or (self.is_last and tied)
        return self.is_last  # model.norm, lm_head

    def local_name(self, name: str) -> str:
        """model.layers.<i>. -> model.layers.<i - first>. (this stage's own numbering)."""
        if not name.startswith("model.layers."):
            return name
        parts = name.split(".")
        parts[2] = str(int(parts[2]) - self.first)
        return ".".join(parts)

    def apply(self, model) -> None:
        """Keep only this stage's layers in a (lazily initialised) model."""
        model.model.layers = model.model.layers[self.first:self.last]


def plan_stages(layer_bytes: Sequence[int], first_extra: int, last_extra: int,
                ranks: int) -> list[Stage]:
    """Contiguous layer ranges that even out each rank's bytes (rank 0 also holds
    `first_extra`, the last rank `last_extra`); every rank gets at least one layer."""
    n = len(layer_bytes)
    if ranks > n:
        raise PipelineError(f"{ranks} ranks but only {n} layers to split")
    before = np.concatenate([[0], np.cumsum(layer_bytes)]) + first_extra  # bytes before layer i
    total = before[-1] + last_extra
    bounds = [0]
    for k in range(1, ranks):
        lo, hi = bounds[-1] + 1, n - (ranks - k)  # leave a layer for every later rank
        share = total * k / ranks
        bounds.append(min(range(lo, hi + 1), key=lambda i: abs(before[i] - share)))
    bounds.append(n)
    return [Stage(bounds[k], bounds[k + 1], k == 0, k == ranks - 1) for k in range(ranks)]


def model_digest(path: Path) -> str:
    """What makes two hosts' copies the same model: config.json and the weight files' sizes."""
    from .loading import weight_files

    files = sorted((f.name, f.stat().st_size) for f in weight_files(path))
    return (path / "config.json").read_text() + json.dumps(files)


def versions() -> str:
    return json.dumps({p: metadata.version(p) for p in ("treegraft-mlx", "mlx", "mlx-lm")})


def connect(target_dir: Path) -> tuple[Link, list[Stage]]:
    """Join the group `mlx.launch` started, check every rank runs the same versions and model,
    and cut the target's layers by bytes."""
    from .loading import read_config, read_weights, weight_files
    from .models import model_args

    with watched_from_outside(timeout_s(), "connecting to the other ranks (is every host in "
                              "--hosts / --hostfile reachable and running the same command?)"):
        group = mx.distributed.init(strict=True)
    if group.size() < 2:
        raise PipelineError("--pipeline needs two or more processes: run it under mlx.launch "
                            "(--hosts or --hostfile)")
    link = Link(group)
    link.agree(versions(), "package versions (treegraft-mlx, mlx, mlx-lm)")
    link.agree(model_digest(target_dir), "the target model (config.json, weight files)")
    args = model_args(read_config(target_dir))
    weights = read_weights(weight_files(target_dir))  # lazily: only shapes are read here
    per_layer = [0] * args.num_hidden_layers
    embed = head = 0
    for name, w in weights.items():
        if name.startswith("model.layers."):
            per_layer[int(name.split(".")[2])] += w.nbytes
        elif name.startswith("model.embed_tokens."):
            embed += w.nbytes
        else:
            head += w.nbytes
    head += embed if args.tie_word_embeddings else 0
    return link, plan_stages(per_layer, embed, head, link.size)


def hidden_dtype(model) -> mx.Dtype:
    """The dtype hidden states travel in: the stage's (loaded) layers' own."""
    return model.model.layers[0].input_layernorm.weight.dtype


class PipelineCache:
    """Rank 0's handle on one KV cache held in slices by every rank: its own slice, and the
    operations the other ranks repeat on theirs (sent with the next forward)."""

    def __init__(self, local, target: "PipelineTarget", ident: int):
        self.local, self.target, self.ident = local, target, ident

    @property
    def offset(self) -> int:
        return self.local.offset

    @property
    def pending(self) -> int:
        return self.local.pending

    def commit(self, n: Optional[int] = None) -> None:
        self.local.commit(n)
        self.target.ops += [COMMIT, self.ident, -1 if n is None else n]

    def keep(self, rows: Sequence[int]) -> None:
        self.local.keep(rows)
        rows = [int(r) for r in rows]
        self.target.ops += [KEEP, self.ident, len(rows), *rows]

    def rewindable(self, length: int) -> int:
        """Any length: every rank's cache is a KVCache (hybrid targets are refused)."""
        return length

    def reset(self, length: int = 0) -> None:
        self.local.reset(length)
        self.target.ops += [RESET, self.ident, length]

    def nbytes(self) -> int:
        return self.local.nbytes()


def apply_ops(ops: list[int], caches: dict, model) -> None:
    """A stage repeats rank 0's cache operations on its own slices."""
    i = 0
    while i < len(ops):
        op, ident, arg = ops[i:i + 3]
        i += 3
        if op == NEW:
            caches[ident] = model.make_cache(arg or None)
        elif op == COMMIT:
            caches[ident].commit(None if arg < 0 else arg)
        elif op == KEEP:
            caches[ident].keep(ops[i:i + arg])
            i += arg
        elif op == RESET:
            caches[ident].reset(arg)


@dataclass
class Frame:
    """One request as it travels down the ranks. On the wire: CONTROL int32 words (what a
    receiver needs to size the rest), then the int32 payload (cache operations, positions,
    tree-mask words, logits rows), then the hidden states' bytes. A receiver reads the
    control words first (`Frame.sizes`), the payload (`Frame.read`), then the hidden states."""

    kind: int = FORWARD
    cache: int = -1                          # the cache's ident; -1: none
    rows: int = 0
    context: int = 0                         # committed tokens before the block
    mask_kind: int = NO_MASK
    ops: list[int] = field(default_factory=list)          # cache operations (apply_ops)
    positions: Optional[list[int]] = None
    mask_bits: Optional[np.ndarray] = None   # (rows, words) uint32, for TREE
    logits_rows: Optional[list[int]] = None  # None: every row

    def control(self) -> list[int]:
        words = 0 if self.mask_bits is None else self.mask_bits.shape[1]
        return [self.kind, self.cache, self.rows, self.context, self.mask_kind, words,
                -1 if self.logits_rows is None else len(self.logits_rows),
                int(self.positions is not None), len(self.ops)]

    def payload(self) -> list[int]:
        ints = list(self.ops) + (self.positions or [])
        if self.mask_bits is not None:
            ints += self.mask_bits.view(np.int32).reshape(-1).tolist()
        return ints + (self.logits_rows or [])

    def pack(self, hidden: Optional[mx.array] = None) -> mx.array:
        parts = [mx.array(self.control() + self.payload(), dtype=mx.int32)]
        if hidden is not None:
            parts.append(hidden.reshape(-1).view(mx.int32))
        return mx.concatenate(parts)

    @staticmethod
    def sizes(control: list[int]) -> int:
        """Payload words that follow these control words."""
        _, _, rows, _, mask_kind, words, n_logits, has_pos, n_ops = control
        return n_ops + rows * has_pos + rows * words * (mask_kind == TREE) + max(n_logits, 0)

    @classmethod
    def read(cls, control: list[int], payload: list[int]) -> "Frame":
        kind, cache, rows, context, mask_kind, words, n_logits, has_pos, n_ops = control
        at = n_ops
        frame = cls(kind, cache, rows, context, mask_kind, payload[:n_ops])
        if has_pos:
            frame.positions, at = payload[at:at + rows], at + rows
        if mask_kind == TREE:
            bits = np.array(payload[at:at + rows * words], dtype=np.int32).view(np.uint32)
            frame.mask_bits, at = bits.reshape(rows, words), at + rows * words
        if n_logits >= 0:
            frame.logits_rows = payload[at:at + n_logits]
        return frame

    def mask(self):
        """The mask the layers take: a TreeMask, 'causal' or None."""
        if self.mask_kind == TREE:
            return TreeMask(self.context, self.mask_bits)
        return "causal" if self.mask_kind == CAUSAL else None


class PipelineTarget:
    """Rank 0's view of the split target, called like a model: its own stage (embedding and
    first layers) runs here, the rest on the other ranks, in order."""

    def __init__(self, stage_model, link: Link, stages: list[Stage]):
        self.stage_model, self.link, self.stages = stage_model, link, stages
        self.args, self.model = stage_model.args, stage_model.model
        self.quantization = getattr(stage_model, "quantization", None)
        self.ops: list[int] = []  # cache operations the next frame carries
        self._caches = 0
        import atexit
        atexit.register(self.close)

    def make_cache(self, max_len: Optional[int] = None, dtype: Optional[mx.Dtype] = None):
        self._caches += 1
        self.ops += [NEW, self._caches, max_len or 0]
        return PipelineCache(self.stage_model.make_cache(max_len, dtype), self, self._caches)

    def __call__(self, inputs: mx.array, cache: Optional[PipelineCache] = None,
                 positions: Optional[mx.array] = None, mask=None,
                 logits_rows: Optional[mx.array] = None) -> mx.array:
        rows = inputs.shape[1]
        frame = Frame(FORWARD, cache.ident if cache is not None else -1, rows,
                      cache.offset if cache is not None else 0, NO_MASK, self.ops)
        if positions is not None:
            frame.positions = np.asarray(positions, dtype=np.int32).tolist()
        if isinstance(mask, TreeMask):
            frame.mask_kind, frame.context, frame.mask_bits = TREE, mask.context, mask.bits
        elif isinstance(mask, str):
            frame.mask_kind = CAUSAL
        elif mask is not None:
            raise PipelineError("a pipelined target takes tree masks, 'causal' or none")
        if logits_rows is not None:
            frame.logits_rows = np.asarray(logits_rows, dtype=np.int32).reshape(-1).tolist()
        self.ops = []
        local = cache.local if cache is not None else None
        dtype = hidden_dtype(self.stage_model)
        h = self.stage_model.run_layers(self.stage_model.embed(inputs), local, positions, mask)
        h = h.astype(dtype)
        mx.eval(h)  # this stage's own compute stays outside the exchange's deadline
        self.link.send(frame.pack(h), 1, "a forward")
        out_rows = rows if frame.logits_rows is None else len(frame.logits_rows)
        return self.link.recv((1, out_rows, self.args.vocab_size), dtype, self.link.size - 1,
                              "logits")

    def forward(self, inputs: mx.array, cache: Optional[PipelineCache] = None,
                positions: Optional[mx.array] = None, mask=None) -> Forward:
        """Every row's logits: the hidden states stay on the last rank."""
        return Forward(None, all_logits=self(inputs, cache, positions, mask)[0])

    def close(self) -> None:
        """Ends the other ranks' loops (once; not after a peer was lost)."""
        if self.link is None or self.link.broken:
            return
        link, self.link = self.link, None
        link.send(Frame(STOP).pack(), 1, "stop")


def serve_stage(model, link: Link, stage: Stage) -> None:
    """A rank other than 0: run this stage's layers for rank 0's requests until it stops."""
    caches: dict = {}
    dtype = hidden_dtype(model)
    prev, nxt = link.rank - 1, link.rank + 1
    while True:
        control = link.recv((CONTROL,), mx.int32, prev, "rank 0's next request",
                            idle=True).tolist()
        if control[0] == STOP:
            if not stage.is_last:
                link.send(mx.array(control, dtype=mx.int32), nxt, "stop")
            return
        n_ints = Frame.sizes(control)
        ints = link.recv((n_ints,), mx.int32, prev, "a forward's layout") if n_ints else None
        frame = Frame.read(control, np.array(ints).tolist() if ints is not None else [])
        hidden_ints = frame.rows * model.args.hidden_size * dtype.size // 4
        h = link.recv((hidden_ints,), mx.int32, prev, "hidden states").view(dtype)
        h = h.reshape(1, frame.rows, model.args.hidden_size)
        apply_ops(frame.ops, caches, model)
        positions = (mx.array(frame.positions, dtype=mx.int32)
                     if frame.positions is not None else None)
        chosen = (mx.array(frame.logits_rows, dtype=mx.int32)
                  if frame.logits_rows is not None else None)
        h = model.run_layers(h, caches.get(frame.cache), positions, frame.mask())
        out = (model.head(h, chosen) if stage.is_last else h).astype(dtype)
        mx.eval(out)  # compute outside the exchange's deadline
        if stage.is_last:
            link.send(out, 0, "logits")
        else:
            link.send(frame.pack(out), nxt, "a forward")


def refuse_hybrid(path) -> None:
    """A hybrid target's recurrent state would have to travel between ranks with every
    tree step; not built, so it is refused before any rank connects."""
    from .loading import read_config
    from .models import build_class, model_args

    args = model_args(read_config(path))
    if build_class(args).RECURRENT:
        raise PipelineError(f"{path}: --pipeline does not carry the recurrent state of a hybrid "
                            "(linear-attention) model yet; run it in one process")
    refusal = getattr(build_class(args), "pipeline_refusal", None)
    why = refusal(args) if refusal is not None else None
    if why:
        raise PipelineError(f"{path}: {why}")


def start(target_path_or_bundle, drafters=(), tree=None, **model_kwargs):
    """Rank 0: the family with its target split over the ranks (drafters stay here). Other
    ranks: load their stage, serve rank 0 until it stops, then return None."""
    from .family import load_family, target_dir
    from .loading import load_model

    path = target_dir(target_path_or_bundle)
    refuse_hybrid(path)
    link, stages = connect(path)
    stage = stages[link.rank]
    try:
        if link.rank != 0:
            model, _ = load_model(path, stage=stage, **model_kwargs)
            serve_stage(model, link, stage)
            return None
        family = load_family(target_path_or_bundle, drafters, tree, target_stage=stage,
                             **model_kwargs)
    except MemoryError as e:
        raise PipelineError(f"rank {link.rank} (layers {stage.first}-{stage.last - 1} of "
                            f"{stages[-1].last}, split over {link.size} ranks) does not fit: "
                            f"{e}; add ranks or use a quantized model") from None
    family.target = PipelineTarget(family.target, link, stages)
    return family
