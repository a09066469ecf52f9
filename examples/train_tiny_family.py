"""Train the `tg-tiny` fixture family: a byte-level BPE tokenizer, a Llama-style target and a
distilled strong drafter, on the Python standard library of the running interpreter.

Why it exists: nothing can be downloaded here, yet every test and every speed number needs a
real target/drafter pair of one family. This script makes it, reproducibly.

Stages (each resumable; a finished stage is skipped, an interrupted one continues from its
last checkpoint in --work):

  corpus     collect stdlib sources (no test suites, no site-packages) and the sources of the
             PACKAGES below (fetched by name as source distributions, refused if installed
             here), split by module into train / held-out (the split goes to <out>/split.json
             on export)
  tokenizer  byte-level BPE, vocabulary 8192, <|bos|> <|eos|> <|pad|> (with --resume-from:
             the family's own tokenizer, which its weights need)
  target     train the target (next-token loss) for --target-minutes of wall time or
             --target-tokens
  outputs    the target's own greedy and sampled continuations of training windows, which the
             drafter is distilled on beside the corpus (what acceptance depends on)
  drafter    distil the drafter from the target's logits for --drafter-minutes / -tokens
  export     write Hugging Face format (config.json, model.safetensors in bf16,
             generation_config.json, tokenizer files) into <out>/target, <out>/drafters/<name>

--resume-from <family dir> starts both models from that family's weights (a warm restart: the
optimizer state is not part of a family, so AdamW starts afresh with a short warm-up to half
the peak learning rate); a second session adds tokens instead of starting over.

Training uses PyTorch on CPU (measured here: about 2x faster than MLX CPU for training) or,
with --device cuda, an NVIDIA GPU.

    pip install -e ".[train]"
    python examples/train_tiny_family.py --out treegraft_mlx/fixtures/tg-tiny
"""

from __future__ import annotations

import argparse
import hashlib
import importlib.metadata
import json
import math
import os
import random
import re
import shutil
import subprocess
import sys
import sysconfig
import tarfile
import time
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Optional

import numpy as np

SPECIAL_TOKENS = ["<|bos|>", "<|eos|>", "<|pad|>"]
HELDOUT_PERCENT = 10  # modules whose name hashes below this percentile are held out
DOC_SEPARATOR = "<|eos|>"
# Well-known, permissively licensed, pure-Python packages beside the stdlib: none of them is
# installed in this project's environment (checked when fetched). Licence as each declares it.
PACKAGES = {
    "toolz==1.2.0": "BSD-3-Clause", "more-itertools==11.2.1": "MIT",
    "boltons==26.2.0": "BSD-3-Clause", "bottle==0.13.4": "MIT", "arrow==1.4.0": "Apache-2.0",
    "tabulate==0.10.0": "MIT", "marshmallow==4.4.0": "MIT", "tomlkit==0.15.2": "MIT",
    "sqlparse==0.6.1": "BSD-3-Clause", "django==5.2.19": "BSD-3-Clause",
}
SKIP_DIRS = {"test", "tests", "testing", "docs", "doc", "examples", "benchmarks", "scripts",
             "site-packages", "dist-packages", "idle_test", "__pycache__"}


# ----------------------------------------------------------------------------- corpus

def is_source(rel: Path) -> bool:
    """A module's own code: no test suites, docs, examples or packaging scripts."""
    return (not any(part in SKIP_DIRS for part in rel.parts[:-1])
            and not rel.name.startswith("test_") and rel.name not in ("setup.py", "conftest.py"))


def stdlib_modules() -> list[tuple[str, str]]:
    """(module name, text) for every .py file of the interpreter's stdlib, tests excluded."""
    root = Path(sysconfig.get_paths()["stdlib"])
    found = []
    for path in sorted(root.rglob("*.py")):
        rel = path.relative_to(root)
        if is_source(rel):
            try:
                found.append((".".join(rel.with_suffix("").parts), path.read_text(encoding="utf-8")))
            except (UnicodeDecodeError, OSError):
                continue
    return found


def package_modules(work: Path, spec: str) -> list[tuple[str, str]]:
    """(module name, text) of one package's source distribution, fetched by name from the
    package index (never from this environment: an installed package is refused)."""
    name, version = spec.split("==")
    try:
        importlib.metadata.distribution(name)
        raise SystemExit(f"{name} is installed in this environment: the corpus takes only "
                         "packages the project does not run on")
    except importlib.metadata.PackageNotFoundError:
        pass
    dest = work / "sdists"

    def normal(text: str) -> str:
        return re.sub(r"[-_.]+", "_", text).lower()

    def fetched() -> Optional[Path]:
        want = normal(f"{name}-{version}")
        return next((a for a in dest.glob("*.tar.gz")
                     if normal(a.name.removesuffix(".tar.gz")) == want), None)

    if fetched() is None:
        subprocess.run([sys.executable, "-m", "pip", "download", "--quiet", "--no-deps",
                        "--no-binary", ":all:", spec, "-d", str(dest)], check=True)
    archive = fetched()
    if archive is None:
        raise SystemExit(f"pip fetched no {name}-{version}.tar.gz into {dest}")
    found = []
    with tarfile.open(archive) as tar:
        for member in sorted(tar.getmembers(), key=lambda m: m.name):
            rel = Path(*Path(member.name).parts[1:])  # drop the <name>-<version>/ root
            if member.isfile() and rel.suffix == ".py" and is_source(rel):
                text = tar.extractfile(member).read().decode("utf-8", errors="replace")
                found.append((f"{name}/{rel.as_posix()}", text))
    return found


def is_heldout(module: str) -> bool:
    """Deterministic split by module name, stable across machines."""
    bucket = int(hashlib.sha256(module.encode()).hexdigest(), 16) % 100
    return bucket < HELDOUT_PERCENT


def stage_corpus(work: Path, packages: list[str]) -> None:
    if (work / "train.txt").exists():
        return
    train, held, split = [], [], {"train": [], "heldout": []}
    sources = {"stdlib": stdlib_modules(), **{p: package_modules(work, p) for p in packages}}
    for source, modules in sources.items():
        for module, text in modules:
            if not text.strip():
                continue
            side = "heldout" if is_heldout(module) else "train"
            (held if side == "heldout" else train).append(text)
            split[side].append(module)
    split["python"] = sysconfig.get_python_version()
    split["packages"] = {p: PACKAGES.get(p, "unknown") for p in packages}
    split["rule"] = f"sha256(module name) % 100 < {HELDOUT_PERCENT} -> heldout"
    (work / "split.json").write_text(json.dumps(split, indent=1))
    (work / "heldout.json").write_text(json.dumps(held))
    (work / "train.json").write_text(json.dumps(train))
    (work / "train.txt").write_text("ok")
    print(f"corpus: {len(split['train'])} train modules, {len(split['heldout'])} held out")


# ----------------------------------------------------------------------------- tokenizer

def stage_tokenizer(work: Path, resume_from: Optional[Path] = None) -> None:
    if (work / "tokenizer.json").exists():
        return
    if resume_from is not None:  # the family's weights only mean something with its tokenizer
        shutil.copy(resume_from / "target" / "tokenizer.json", work / "tokenizer.json")
        return
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=8192,
        special_tokens=SPECIAL_TOKENS,
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    docs = json.loads((work / "train.json").read_text())
    tok.train_from_iterator(docs, trainer=trainer)
    tok.save(str(work / "tokenizer.json"))
    print(f"tokenizer: vocabulary {tok.get_vocab_size()}")


def corpus_report(work: Path, split: dict) -> dict:
    """Modules and tokens per source (the stdlib, each package) on each side of the split, and
    each package's licence: what the model card lists."""
    from tokenizers import Tokenizer

    tok = Tokenizer.from_file(str(work / "tokenizer.json"))
    report: dict = {}
    for side in ("train", "heldout"):
        docs = json.loads((work / f"{side}.json").read_text())
        for module, enc in zip(split[side], tok.encode_batch(docs)):
            source = module.split("/")[0] if "/" in module else "stdlib"
            entry = report.setdefault(source, {"train_tokens": 0, "heldout_tokens": 0,
                                               "train_modules": 0, "heldout_modules": 0})
            entry[f"{side}_tokens"] += len(enc.ids) + 1  # + <|eos|>
            entry[f"{side}_modules"] += 1
    for spec, licence in split.get("packages", {}).items():
        report.setdefault(spec.split("==")[0], {})["licence"] = licence
        report[spec.split("==")[0]]["version"] = spec.split("==")[1]
    return report


def encode_corpus(work: Path, name: str) -> np.ndarray:
    """Token ids of all documents of one side, each followed by <|eos|>, cached as .npy."""
    cache = work / f"{name}.npy"
    if cache.exists():
        return np.load(cache)
    from tokenizers import Tokenizer

    tok = Tokenizer.from_file(str(work / "tokenizer.json"))
    eos = tok.token_to_id("<|eos|>")
    docs = json.loads((work / f"{name}.json").read_text())
    ids: list[int] = []
    for enc in tok.encode_batch(docs):
        ids.extend(enc.ids)
        ids.append(eos)
    arr = np.asarray(ids, dtype=np.uint16)
    np.save(cache, arr)
    return arr


# ----------------------------------------------------------------------------- model (torch)

@dataclass
class Config:
    hidden_size: int
    num_hidden_layers: int
    intermediate_size: int
    num_attention_heads: int
    num_key_value_heads: int
    vocab_size: int = 8192
    max_position_embeddings: int = 2048
    rope_theta: float = 10000.0
    rms_norm_eps: float = 1e-5


TARGET = Config(hidden_size=384, num_hidden_layers=8, intermediate_size=1536,
                num_attention_heads=6, num_key_value_heads=2)
# One wide layer: on this machine a forward's cost is dominated by per-layer op overhead, so
# the layer count sets the latency ratio (measured: 2 layers gave ~4.4x, short of the 5x asked).
DRAFTER = Config(hidden_size=320, num_hidden_layers=1, intermediate_size=1280,
                 num_attention_heads=5, num_key_value_heads=1)


def build_model(cfg: Config):
    """A Llama decoder whose parameter names match Hugging Face's LlamaForCausalLM."""
    import torch
    import torch.nn as nn
    import torch.nn.functional as F

    head_dim = cfg.hidden_size // cfg.num_attention_heads

    class RMSNorm(nn.Module):
        def __init__(self, d):
            super().__init__()
            self.weight = nn.Parameter(torch.ones(d))

        def forward(self, x):
            return self.weight * x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + cfg.rms_norm_eps)

    def rope(x, cos, sin):
        x1, x2 = x[..., : head_dim // 2], x[..., head_dim // 2:]
        return x * cos + torch.cat((-x2, x1), dim=-1) * sin

    class Attention(nn.Module):
        def __init__(self):
            super().__init__()
            kv = cfg.num_key_value_heads * head_dim
            self.q_proj = nn.Linear(cfg.hidden_size, cfg.hidden_size, bias=False)
            self.k_proj = nn.Linear(cfg.hidden_size, kv, bias=False)
            self.v_proj = nn.Linear(cfg.hidden_size, kv, bias=False)
            self.o_proj = nn.Linear(cfg.hidden_size, cfg.hidden_size, bias=False)

        def forward(self, x, cos, sin, cache=None):
            b, t, _ = x.shape
            q = self.q_proj(x).view(b, t, -1, head_dim).transpose(1, 2)
            k = self.k_proj(x).view(b, t, -1, head_dim).transpose(1, 2)
            v = self.v_proj(x).view(b, t, -1, head_dim).transpose(1, 2)
            q, k = rope(q, cos, sin), rope(k, cos, sin)
            if cache is not None:  # generation: a prefill, then one token per call
                if cache:
                    k, v = torch.cat([cache["k"], k], 2), torch.cat([cache["v"], v], 2)
                cache["k"], cache["v"] = k, v
            # A block of several tokens is only ever a prefill (no cached keys before it), so
            # is_causal's top-left alignment is right; a single decoded token sees everything.
            o = F.scaled_dot_product_attention(q, k, v, is_causal=t > 1, enable_gqa=True)
            return self.o_proj(o.transpose(1, 2).reshape(b, t, -1))

    class MLP(nn.Module):
        def __init__(self):
            super().__init__()
            self.gate_proj = nn.Linear(cfg.hidden_size, cfg.intermediate_size, bias=False)
            self.up_proj = nn.Linear(cfg.hidden_size, cfg.intermediate_size, bias=False)
            self.down_proj = nn.Linear(cfg.intermediate_size, cfg.hidden_size, bias=False)

        def forward(self, x):
            return self.down_proj(F.silu(self.gate_proj(x)) * self.up_proj(x))

    class Layer(nn.Module):
        def __init__(self):
            super().__init__()
            self.self_attn = Attention()
            self.mlp = MLP()
            self.input_layernorm = RMSNorm(cfg.hidden_size)
            self.post_attention_layernorm = RMSNorm(cfg.hidden_size)

        def forward(self, x, cos, sin, cache=None):
            x = x + self.self_attn(self.input_layernorm(x), cos, sin, cache)
            return x + self.mlp(self.post_attention_layernorm(x))

    class Inner(nn.Module):
        def __init__(self):
            super().__init__()
            self.embed_tokens = nn.Embedding(cfg.vocab_size, cfg.hidden_size)
            self.layers = nn.ModuleList([Layer() for _ in range(cfg.num_hidden_layers)])
            self.norm = RMSNorm(cfg.hidden_size)

    class LlamaLM(nn.Module):
        def __init__(self):
            super().__init__()
            self.model = Inner()
            inv = 1.0 / cfg.rope_theta ** (torch.arange(0, head_dim, 2).float() / head_dim)
            self.register_buffer("inv_freq", inv, persistent=False)
            self.apply(self._init)
            for name, p in self.named_parameters():  # GPT-2 style scaled residual init
                if name.endswith(("o_proj.weight", "down_proj.weight")):
                    nn.init.normal_(p, std=0.02 / math.sqrt(2 * cfg.num_hidden_layers))

        @staticmethod
        def _init(m):
            if isinstance(m, (nn.Linear, nn.Embedding)):
                nn.init.normal_(m.weight, std=0.02)

        def forward(self, ids, caches=None):
            """Logits of `ids`; with `caches` (one dict per layer, filled in place) the ids
            continue the positions already cached."""
            start = caches[0]["k"].shape[2] if caches and caches[0] else 0
            positions = torch.arange(start, start + ids.shape[1], dtype=torch.float32)
            freqs = torch.outer(positions.to(self.inv_freq.device), self.inv_freq)
            emb = torch.cat((freqs, freqs), dim=-1)
            cos, sin = emb.cos(), emb.sin()
            x = self.model.embed_tokens(ids)
            for i, layer in enumerate(self.model.layers):
                x = layer(x, cos, sin, caches[i] if caches else None)
            x = self.model.norm(x)
            return x @ self.model.embed_tokens.weight.T  # tied LM head

    return LlamaLM()


def n_params(model) -> int:
    return sum(p.numel() for p in model.parameters())


# ----------------------------------------------------------------------------- training

def batches(data: np.ndarray, batch: int, seq: int, rng: np.random.Generator,
            device: str = "cpu", rows: bool = False):
    """(inputs, next tokens) of random windows of a token stream, or of random whole rows of
    a (n, seq + 1) array with `rows`."""
    import torch

    while True:
        if rows:
            chunk = data[rng.integers(0, len(data), size=batch)].astype(np.int64)
        else:
            starts = rng.integers(0, len(data) - seq - 1, size=batch)
            chunk = np.stack([data[s: s + seq + 1] for s in starts]).astype(np.int64)
        chunk = torch.from_numpy(chunk).to(device)
        yield chunk[:, :-1], chunk[:, 1:]


def alternate(*streams):
    while True:
        for stream in streams:
            yield next(stream)


def lr_at(step: int, total: int, peak: float, warmup: int) -> float:
    """Linear warm-up then cosine decay to 10% of peak: no spikes at the end."""
    if step < warmup:
        return peak * (step + 1) / warmup
    frac = min(1.0, (step - warmup) / max(1, total - warmup))
    return peak * (0.1 + 0.9 * 0.5 * (1 + math.cos(math.pi * frac)))


@dataclass
class RunSpec:
    name: str
    minutes: float
    batch: int
    seq: int
    peak_lr: float
    warmup: int = 50
    seed: int = 0
    tokens: Optional[int] = None  # a token budget instead of a wall-clock one
    device: str = "cpu"
    init_from: Optional[Path] = None  # a model directory to start from (warm restart)


def evaluate(model, data: np.ndarray, seq: int, teacher=None, max_tokens: int = 200_000):
    """Mean next-token loss (nats) on held-out tokens, and top-1 agreement with a teacher."""
    import torch
    import torch.nn.functional as F

    model.eval()
    device = next(model.parameters()).device
    n = min(len(data) - 1, max_tokens) // seq
    losses, agree, count = 0.0, 0, 0
    with torch.no_grad():
        for i in range(0, n, 8):
            rows = [data[(i + j) * seq: (i + j) * seq + seq + 1] for j in range(min(8, n - i))]
            chunk = torch.from_numpy(np.stack(rows).astype(np.int64)).to(device)
            x, y = chunk[:, :-1], chunk[:, 1:]
            logits = model(x)
            losses += F.cross_entropy(logits.flatten(0, 1), y.flatten(), reduction="sum").item()
            if teacher is not None:
                agree += (logits.argmax(-1) == teacher(x).argmax(-1)).sum().item()
            count += y.numel()
    model.train()
    return losses / count, (agree / count if teacher is not None else None)


def train(work: Path, cfg: Config, spec: RunSpec, teacher=None,
          outputs: Optional[np.ndarray] = None) -> None:
    """Train one model for a wall-clock budget; checkpoints every few minutes; resumable.

    With a teacher, the loss is KL(teacher || student) on temperature-1 logits plus a small
    next-token term: the drafter learns to agree with the target, which is what acceptance
    rates reward.
    """
    import torch
    import torch.nn.functional as F

    done = work / f"{spec.name}.done.pt"
    if done.exists():
        return
    torch.manual_seed(spec.seed)
    data = encode_corpus(work, "train")
    held = encode_corpus(work, "heldout")
    model = build_model(cfg)
    if spec.init_from is not None:
        load_weights(model, spec.init_from)
        print(f"{spec.name}: warm restart from {spec.init_from}")
    model.to(spec.device)
    step_fn = torch.compile(model)  # measured here: ~1.45x faster training on CPU
    opt = torch.optim.AdamW(model.parameters(), lr=spec.peak_lr, betas=(0.9, 0.95),
                            weight_decay=0.1)
    ckpt = work / f"{spec.name}.ckpt.pt"
    state = {"step": 0, "elapsed": 0.0, "log": [], "total_steps": None}
    if spec.tokens:
        state["total_steps"] = max(1, spec.tokens // (spec.batch * spec.seq))
    if ckpt.exists():
        saved = torch.load(ckpt, weights_only=False)
        model.load_state_dict(saved["model"])
        opt.load_state_dict(saved["opt"])
        state = saved["state"]
        print(f"{spec.name}: resumed at step {state['step']}")
    print(f"{spec.name}: {n_params(model) / 1e6:.2f}M parameters, {len(data) / 1e6:.2f}M train tokens")
    rng = np.random.default_rng(spec.seed + state["step"])
    stream = batches(data, spec.batch, spec.seq, rng, spec.device)
    if outputs is not None:  # alternate corpus batches with the target's own continuations
        stream = alternate(stream, batches(outputs, spec.batch, outputs.shape[1] - 1, rng,
                                           spec.device, rows=True))
    budget = spec.minutes * 60
    last_ckpt = time.time()

    def save(path: Path) -> None:
        tmp = path.with_suffix(".tmp")
        torch.save({"model": model.state_dict(), "opt": opt.state_dict(), "state": state,
                    "config": asdict(cfg)}, tmp)
        os.replace(tmp, path)

    while True:
        t0 = time.time()
        # The schedule's length is fixed after timing steps 5..25 (the first ones compile).
        if state["step"] == 5:
            state["elapsed_at_5"] = state["elapsed"]
        if state["total_steps"] is None and state["step"] == 25:
            per_step = (state["elapsed"] - state["elapsed_at_5"]) / 20
            state["total_steps"] = int((budget - state["elapsed_at_5"]) / per_step)
            print(f"{spec.name}: {per_step:.2f}s/step -> {state['total_steps']} steps, "
                  f"{state['total_steps'] * spec.batch * spec.seq / 1e6:.1f}M tokens")
        total = state["total_steps"] or 10**9
        if state["step"] >= total:
            break
        lr = lr_at(state["step"], total if state["total_steps"] else 10**5, spec.peak_lr, spec.warmup)
        for g in opt.param_groups:
            g["lr"] = lr
        x, y = next(stream)
        with torch.autocast(spec.device, dtype=torch.bfloat16, enabled=spec.device == "cuda"):
            logits = step_fn(x).float()
        ce = F.cross_entropy(logits.flatten(0, 1), y.flatten())
        if teacher is not None:
            with torch.no_grad():
                t_logp = F.log_softmax(teacher(x).float(), -1)
            kl = F.kl_div(F.log_softmax(logits, -1), t_logp, log_target=True,
                          reduction="batchmean") / x.shape[1]
            loss = kl + 0.1 * ce
        else:
            loss = ce
        opt.zero_grad(set_to_none=True)
        loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        opt.step()
        state["step"] += 1
        state["elapsed"] += time.time() - t0
        if state["step"] % 50 == 0:
            entry = {"step": state["step"], "loss": round(loss.item(), 4), "ce": round(ce.item(), 4),
                     "lr": lr, "elapsed_s": round(state["elapsed"], 1)}
            state["log"].append(entry)
            print(json.dumps(entry), flush=True)
        if time.time() - last_ckpt > 300:
            save(ckpt)
            last_ckpt = time.time()
    held_loss, agreement = evaluate(model, held, 512, teacher)
    state["heldout_loss"] = held_loss
    state["agreement"] = agreement
    state["tokens_per_s"] = state["step"] * spec.batch * spec.seq / state["elapsed"]
    print(f"{spec.name}: held-out loss {held_loss:.3f}" +
          (f", top-1 agreement with teacher {agreement:.3f}" if agreement is not None else ""))
    save(done)
    ckpt.unlink(missing_ok=True)


def load_trained(work: Path, name: str, cfg: Config):
    import torch

    model = build_model(cfg)
    saved = torch.load(work / f"{name}.done.pt", weights_only=False, map_location="cpu")
    model.load_state_dict(saved["model"])
    model.eval()
    return model, saved["state"]


def load_weights(model, model_dir: Path) -> None:
    """A family model's exported weights (bf16 safetensors, tied head) into `model`, in fp32."""
    from safetensors.torch import load_file

    tensors = {k: v.float() for k, v in load_file(str(model_dir / "model.safetensors")).items()}
    missing, unexpected = model.load_state_dict(tensors, strict=False)
    if missing or unexpected:
        raise SystemExit(f"{model_dir} does not fit this architecture: missing {missing}, "
                         f"unexpected {unexpected}")


def stage_outputs(work: Path, target, count: int, device: str, prefix: int = 192,
                  new: int = 128, batch: int = 32) -> np.ndarray:
    """The target's own continuations of `count` random training windows: half greedy, half
    sampled at temperature 0.7 / top-p 0.95 (the bench's sampled setting). (count, prefix +
    new) uint16, cached. Decoded with a KV cache: minutes on a CPU."""
    import torch

    cache = work / "outputs.npy"
    if cache.exists():
        return np.load(cache)
    data = encode_corpus(work, "train")
    rng = np.random.default_rng(7)
    torch.manual_seed(7)
    target.to(device)
    rows = []
    with torch.no_grad():
        for first in range(0, count, batch):
            n = min(batch, count - first)
            starts = rng.integers(0, len(data) - prefix, size=n)
            x = torch.from_numpy(np.stack([data[s: s + prefix] for s in starts]).astype(np.int64))
            x = x.to(device)
            sampled = first >= count // 2
            caches = [{} for _ in target.model.layers]
            logits = target(x, caches)[:, -1].float()
            for _ in range(new):
                if sampled:
                    probs = torch.softmax(logits / 0.7, -1)
                    ranked, order = probs.sort(-1, descending=True)
                    ranked[(ranked.cumsum(-1) - ranked) > 0.95] = 0.0
                    pick = order.gather(-1, torch.multinomial(ranked, 1))
                else:
                    pick = logits.argmax(-1, keepdim=True)
                x = torch.cat([x, pick], 1)
                logits = target(pick, caches)[:, -1].float()
            rows.append(x.cpu().numpy().astype(np.uint16))
            print(f"outputs: {first + n}/{count}", flush=True)
    out = np.concatenate(rows)
    np.save(cache, out)
    return out


# ----------------------------------------------------------------------------- export

def export(work: Path, out: Path, name: str, cfg: Config, role_dir: Path) -> dict:
    """Write one model in Hugging Face Llama format (bf16 safetensors, tied embeddings)."""
    import torch
    from safetensors.torch import save_file

    model, state = load_trained(work, name, cfg)
    dest = out / role_dir
    dest.mkdir(parents=True, exist_ok=True)
    tensors = {k: v.detach().to(torch.bfloat16).contiguous()
               for k, v in model.state_dict().items()}
    tmp = dest / "model.safetensors.tmp"  # an interrupted export leaves the old weights whole
    save_file(tensors, str(tmp), metadata={"format": "pt"})
    os.replace(tmp, dest / "model.safetensors")
    from tokenizers import Tokenizer

    tok = Tokenizer.from_file(str(work / "tokenizer.json"))
    ids = {t: tok.token_to_id(t) for t in SPECIAL_TOKENS}
    config = {
        "architectures": ["LlamaForCausalLM"],
        "model_type": "llama",
        **asdict(cfg),
        "head_dim": cfg.hidden_size // cfg.num_attention_heads,
        "hidden_act": "silu",
        "tie_word_embeddings": True,
        "attention_bias": False,
        "mlp_bias": False,
        "bos_token_id": ids["<|bos|>"],
        "eos_token_id": ids["<|eos|>"],
        "pad_token_id": ids["<|pad|>"],
        "torch_dtype": "bfloat16",
        "initializer_range": 0.02,
    }
    (dest / "config.json").write_text(json.dumps(config, indent=2))
    (dest / "generation_config.json").write_text(json.dumps(
        {"bos_token_id": ids["<|bos|>"], "eos_token_id": ids["<|eos|>"],
         "pad_token_id": ids["<|pad|>"]}, indent=2))
    tok.save(str(dest / "tokenizer.json"))
    (dest / "tokenizer_config.json").write_text(json.dumps({
        "tokenizer_class": "PreTrainedTokenizerFast",
        "bos_token": "<|bos|>", "eos_token": "<|eos|>", "pad_token": "<|pad|>",
        "add_bos_token": False, "clean_up_tokenization_spaces": False,
        "model_max_length": cfg.max_position_embeddings,
    }, indent=2))
    (dest / "special_tokens_map.json").write_text(json.dumps(
        {"bos_token": "<|bos|>", "eos_token": "<|eos|>", "pad_token": "<|pad|>"}, indent=2))
    return {"parameters": n_params(model), "heldout_loss": state.get("heldout_loss"),
            "agreement_with_target": state.get("agreement"),
            "train_tokens_per_s": state.get("tokens_per_s"),
            "train_seconds": state.get("elapsed"), "steps": state.get("step")}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--work", type=Path, default=Path(".train/tg-tiny"))
    ap.add_argument("--out", type=Path, default=Path("treegraft_mlx/fixtures/tg-tiny"))
    ap.add_argument("--target-minutes", type=float, default=75)
    ap.add_argument("--drafter-minutes", type=float, default=30)
    ap.add_argument("--target-tokens", type=float, default=None,
                    help="train the target on this many tokens (instead of minutes)")
    ap.add_argument("--drafter-tokens", type=float, default=None)
    ap.add_argument("--outputs", type=int, default=512,
                    help="target continuations to distil the drafter on (0: corpus only)")
    ap.add_argument("--packages", default=",".join(PACKAGES),
                    help="source distributions added to the stdlib ('' for the stdlib only)")
    ap.add_argument("--resume-from", type=Path, default=None,
                    help="a family directory whose weights (and tokenizer) training starts from")
    ap.add_argument("--device", default="cpu", choices=["cpu", "cuda"])
    ap.add_argument("--threads", type=int, default=os.cpu_count())
    ap.add_argument("--stages", default="corpus,tokenizer,target,outputs,drafter,export")
    args = ap.parse_args()

    import torch

    torch.set_num_threads(args.threads)
    random.seed(0)
    args.work.mkdir(parents=True, exist_ok=True)
    stages = args.stages.split(",")
    resume = args.resume_from
    warm = 0.5 if resume else 1.0  # a warm restart peaks at half the learning rate
    target_spec = RunSpec("target", args.target_minutes, batch=4, seq=1024, peak_lr=1.5e-3 * warm,
                          tokens=int(args.target_tokens or 0) or None, device=args.device,
                          init_from=resume / "target" if resume else None)
    drafter_spec = RunSpec("drafter", args.drafter_minutes, batch=4, seq=1024,
                           peak_lr=2e-3 * warm, seed=1,
                           tokens=int(args.drafter_tokens or 0) or None, device=args.device,
                           init_from=resume / "drafters/tg-tiny-draft" if resume else None)
    if "corpus" in stages:
        stage_corpus(args.work, [p for p in args.packages.split(",") if p])
    if "tokenizer" in stages:
        stage_tokenizer(args.work, resume)
    earlier = resume / "training_report.json" if resume else None
    if earlier and earlier.exists() and not (args.work / "earlier_report.json").exists():
        shutil.copy(earlier, args.work / "earlier_report.json")  # before export replaces it
    if "target" in stages:
        train(args.work, TARGET, target_spec)
    outputs = None
    if "outputs" in stages and args.outputs:
        teacher, _ = load_trained(args.work, "target", TARGET)
        outputs = stage_outputs(args.work, teacher, args.outputs, args.device)
    if "drafter" in stages:
        teacher, _ = load_trained(args.work, "target", TARGET)
        teacher.to(args.device)
        for p in teacher.parameters():
            p.requires_grad_(False)
        teacher = torch.compile(teacher)
        if outputs is None and (args.work / "outputs.npy").exists():
            outputs = np.load(args.work / "outputs.npy")
        train(args.work, DRAFTER, drafter_spec, teacher=teacher, outputs=outputs)
    if "export" in stages:
        report = {
            "target": export(args.work, args.out, "target", TARGET, Path("target")),
            "drafter": export(args.work, args.out, "drafter", DRAFTER, Path("drafters/tg-tiny-draft")),
            "corpus": corpus_report(args.work, json.loads((args.work / "split.json").read_text())),
            "resumed_from": str(resume) if resume else None,
            # the runs the resumed weights came from: a family's lineage, tokens added up
            "earlier": (json.loads((args.work / "earlier_report.json").read_text())
                        if (args.work / "earlier_report.json").exists() else None),
        }
        (args.out / "training_report.json").write_text(json.dumps(report, indent=2))
        shutil.copy(args.work / "split.json", args.out / "split.json")
        tok_hash = hashlib.sha256((args.work / "tokenizer.json").read_bytes()).hexdigest()
        # A family's calibrated settings (tree, schedulers, acceptance) stay: recalibrate them
        # for the new weights with the commands in the model card.
        bundle = args.out / "treegraft.json"
        kept = json.loads(bundle.read_text()) if bundle.exists() else {}
        bundle.write_text(json.dumps({
            **kept,
            "format_version": 1,
            "name": "tg-tiny",
            "target": "target",
            "drafters": {"tg-tiny-draft": "drafters/tg-tiny-draft"},
            "roles": {"target": "target", "strong": "tg-tiny-draft", "weak": "ngram"},
            "tokenizer_sha256": tok_hash,
            "vocab_size": TARGET.vocab_size,
        }, indent=2))
        print(json.dumps(report, indent=2))


if __name__ == "__main__":
    main()
