"""Build the public benchmark prompt suite from held-out stdlib modules only.

Four categories, at least 20 prompts each, written as JSONL {id, category, prompt, source}:
  function_completion  a function's signature and docstring; continue with its body
  copy_edit            a whole function, then the start of its rewrite (copy-heavy)
  long_context         a large prefix of a module; continue it
  docstring_to_code    a task described in comments, then the start of a def

Also writes calibration.jsonl beside it, for calibrating tree budgets and the scheduler
without touching the benchmark: 16 prompts from held-out functions the suite does not use, then
6 long windows from the middle of held-out modules (past any suite prefix), holding no
function a suite prompt uses (the scheduler sees the context length, so it must be calibrated
on long contexts too).

The held-out modules are those listed in the fixture family's split.json, so no prompt was
seen in training. Deterministic: same interpreter, same suite.

    python examples/make_prompt_suite.py --out benchmarks/prompts/public.jsonl

A second suite, for checking that nothing was tuned to the first: the same four categories
from the held-out modules of the packages in split.json (never the stdlib ones), read from
their source distributions unpacked in one directory (`pip download --no-deps --no-binary
:all: <name>==<version>` for each, then untar). No calibration file is written for it.

    python examples/make_prompt_suite.py --packages /tmp/sdists --per-category 8 \
        --out benchmarks/prompts/packages.jsonl
"""

from __future__ import annotations

import argparse
import ast
import json
import random
import sysconfig
import textwrap
from pathlib import Path
from typing import Optional

SPLIT = Path(__file__).resolve().parents[1] / "treegraft_mlx/fixtures/tg-tiny/split.json"
PER_CATEGORY = 24
CALIBRATION_SIZE = 16
CALIBRATION_LONG = 6
LONG_CONTEXT_CHARS = 2400  # ~700 tokens: prompt + 256 new tokens stay inside the trained 1024


def module_path(module: str, packages: Optional[Path] = None) -> Path:
    """A stdlib module by dotted name, or a package's file ("<name>/<path>" in split.json)
    inside its unpacked sdist "<name>-<version>" under `packages`."""
    if packages is None:
        return Path(sysconfig.get_paths()["stdlib"]).joinpath(*module.split(".")).with_suffix(".py")
    name, rest = module.split("/", 1)
    key = name.replace("-", "_").lower()
    for unpacked in packages.iterdir():
        if unpacked.is_dir() and unpacked.name.rsplit("-", 1)[0].replace("-", "_").lower() == key:
            return unpacked / rest
    raise FileNotFoundError(f"no unpacked sdist of {name} under {packages}")


def functions_with_docstrings(source: str):
    """(node, source lines) of top-level and method definitions that carry a docstring."""
    tree = ast.parse(source)
    lines = source.splitlines(keepends=True)
    for node in ast.walk(tree):
        if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)) and ast.get_docstring(node):
            body_start = node.body[0]
            if node.end_lineno - node.lineno < 4 or len(node.body) < 2:
                continue
            yield node, lines, body_start


def build(modules: list[str], packages: Optional[Path] = None,
          per_category: int = PER_CATEGORY) -> tuple[list[dict], list[dict]]:
    rng = random.Random(0)
    funcs, prefixes, windows = [], [], []
    for module in modules:
        try:
            source = module_path(module, packages).read_text(encoding="utf-8")
            found = list(functions_with_docstrings(source))
        except (OSError, SyntaxError, UnicodeDecodeError):
            continue
        # Generated codec tables (encodings.*) are excluded: they would flatter any drafter.
        if len(source) > LONG_CONTEXT_CHARS * 1.5 and not module.startswith("encodings."):
            cut = source.rfind("\n", 0, LONG_CONTEXT_CHARS) + 1
            prefixes.append((module, source[:cut]))
            start = source.find("\n", len(source) // 2) + 1          # a window mid-module
            end = source.rfind("\n", start, start + LONG_CONTEXT_CHARS) + 1
            if start >= 2 * LONG_CONTEXT_CHARS and end - start > LONG_CONTEXT_CHARS // 2:
                windows.append((module, source[start:end]))
        for node, lines, first in found:
            funcs.append((module, node, lines, first))
    rng.shuffle(funcs)
    rng.shuffle(prefixes)
    prompts: list[dict] = []

    def add(category: str, prompt: str, source: str) -> None:
        n = sum(p["category"] == category for p in prompts)
        prompts.append({"id": f"{category}-{n:03d}", "category": category, "prompt": prompt,
                        "source": source})

    def dedented(lines, start, end) -> str:
        return textwrap.dedent("".join(lines[start - 1:end]))

    pool = iter(funcs)
    for module, node, lines, first in pool:
        if sum(p["category"] == "function_completion" for p in prompts) >= per_category:
            break
        add("function_completion", dedented(lines, node.lineno, first.end_lineno),
            f"{module}:{node.name}")
    for module, node, lines, first in pool:
        if sum(p["category"] == "copy_edit" for p in prompts) >= per_category:
            break
        body = dedented(lines, node.lineno, node.end_lineno)
        if len(body) > 2000:
            continue
        header = dedented(lines, node.lineno, first.lineno - 1) if first.lineno > node.lineno else ""
        prompt = (body + "\n\n# The same function, rewritten with clearer local names and "
                  "comments:\n" + (header or body.splitlines(keepends=True)[0]))
        add("copy_edit", prompt, f"{module}:{node.name}")
    for module, node, lines, first in pool:
        if sum(p["category"] == "docstring_to_code" for p in prompts) >= per_category:
            break
        doc = ast.get_docstring(node).strip().splitlines()
        comment = "".join(f"# {line}".rstrip() + "\n" for line in doc[:8])
        args = ", ".join(a.arg for a in node.args.args)
        add("docstring_to_code", f"{comment}def {node.name}({args}):\n", f"{module}:{node.name}")
    for module, prefix in prefixes[:per_category]:
        add("long_context", prefix, module)
    # Calibration prompts (tree budget, scheduler) come from functions the suite never uses.
    calibration = []
    for i, (module, node, lines, first) in enumerate(pool):
        if len(calibration) >= CALIBRATION_SIZE:
            break
        body = dedented(lines, node.lineno, node.end_lineno)
        if i % 2 or len(body) > 2000:
            calibration.append({"id": f"calibration-{len(calibration):03d}", "category": "calibration",
                                "prompt": dedented(lines, node.lineno, first.end_lineno),
                                "source": f"{module}:{node.name}"})
        else:
            calibration.append({"id": f"calibration-{len(calibration):03d}", "category": "calibration",
                                "prompt": body + "\n\n# The same function, rewritten:\n"
                                + body.splitlines(keepends=True)[0],
                                "source": f"{module}:{node.name}"})
    # Long contexts: windows from the middle of modules (well past any long_context prefix and
    # its continuation) that hold no function a suite prompt uses.
    suite_defs = [p["source"].split(":") for p in prompts if ":" in p["source"]]
    rng.shuffle(windows)
    unused = [(module, text) for module, text in windows
              if not any(m == module and f"def {name}(" in text for m, name in suite_defs)]
    for module, prefix in unused[:CALIBRATION_LONG]:
        calibration.append({"id": f"calibration-{len(calibration):03d}", "category": "calibration",
                            "prompt": prefix, "source": module})
    return prompts, calibration


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--out", type=Path, default=Path("benchmarks/prompts/public.jsonl"))
    ap.add_argument("--packages", type=Path, help="unpacked sdists: build the packages suite")
    ap.add_argument("--per-category", type=int, default=PER_CATEGORY)
    args = ap.parse_args()
    split = json.loads(SPLIT.read_text())
    held = sorted(m for m in split["heldout"] if ("/" in m) == (args.packages is not None))
    prompts, calibration = build(held, args.packages, args.per_category)
    outputs = [(args.out, prompts)]
    if args.packages is None:
        outputs.append((args.out.with_name("calibration.jsonl"), calibration))
    args.out.parent.mkdir(parents=True, exist_ok=True)
    for path, rows in outputs:
        with path.open("w") as f:
            for p in rows:
                f.write(json.dumps(p) + "\n")
    if args.packages is None:
        print(f"{len(calibration)} calibration prompts -> {args.out.with_name('calibration.jsonl')}")
    counts = {}
    for p in prompts:
        counts[p["category"]] = counts.get(p["category"], 0) + 1
    print(f"{len(prompts)} prompts -> {args.out}: {counts}")


if __name__ == "__main__":
    main()
