"""Mutation check: hand-made mutants of verification, sampling, the tree and the commit path, run on the fast tests.

Each mutant is a plausible bug: (file, exact original snippet, replacement, what the bug is).
The repository (git-tracked files plus untracked, non-ignored ones) is copied once into a
temporary directory; for each mutant the snippet is replaced there, the fast tests run against
the copy (cwd and PYTHONPATH are the copy, so its treegraft_mlx is imported, not the editable
install), and the file is restored. A mutant is killed when the tests fail (or time out).
Acceptance-rule mutants also run tests/test_lossless.py (slow, ~3 min).

    python examples/mutation_check.py [--json out.json] [--only NAME ...] [--no-baseline]

Before the mutants: every snippet must occur exactly once (else it stops), the copy must be
what runs (a deliberately broken tree.py must fail the tree tests with its marker), and the
unmutated copy must pass every test list used (the baseline).
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import re
import shutil
import signal
import subprocess
import sys
import tempfile
import time
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Iterator

ROOT = Path(__file__).resolve().parents[1]
FAST_TESTS = ("tests/test_tree.py", "tests/test_acceptance.py", "tests/test_distribution.py",
              "tests/test_session.py", "tests/test_engine.py", "tests/test_sampling.py",
              "tests/test_history.py")
DESELECT = "not greedy_output_identical"   # test_engine's slow greedy identity test
LOSSLESS = ("tests/test_lossless.py",)
BASE_TIMEOUT_S = 240                       # fast tests: ~55 s unmutated on 2 busy cores
EXTRA_TIMEOUT_S = 480                      # per slow extra file
SANITY_MARKER = "mutation-check sanity: the copy's tree.py is imported"

V, S, T, E, H = ("treegraft_mlx/verify.py", "treegraft_mlx/sampling.py", "treegraft_mlx/tree.py",
                 "treegraft_mlx/decoder.py", "treegraft_mlx/history.py")
P = "treegraft_mlx/step.py"


@dataclass(frozen=True)
class Mutant:
    name: str
    file: str
    original: str
    replacement: str
    bug: str
    extra: tuple[str, ...] = ()


MUTANTS: tuple[Mutant, ...] = (
    # --- verify.py: the verification forward -------------------------------------------------
    Mutant("verify-pad-not-sliced", V, "list(range(n)))", "list(range(n + pad)))",
           "dropped pad handling: the inert pad rows' logits are returned too"),
    Mutant("verify-positions-plus-one", V, "cache, positions(parent, ctx), attention_mask",
           "cache, positions(parent, ctx + 1), attention_mask",
           "tree positions off by one (root at ctx + 1)"),
    # --- verify.py: greedy acceptance ---------------------------------------------------------
    Mutant("greedy-bonus-from-root", V, "Acceptance(path, best[path[-1]])",
           "Acceptance(path, best[path[0]])",
           "bonus token from the wrong node (the root's argmax, not the last accepted node's)"),
    Mutant("greedy-shortest-twin", V, "return [node] + max(below, key=len, default=[])",
           "return [node] + min(below, key=len, default=[])",
           "of twin siblings (a queued chain beside the tree), the one that accepts less"),
    # --- verify.py: sampled acceptance (host_table on this CPU, device_table on a GPU) ------
    Mutant("sample-root-row-everywhere", V,
           "rng, dist = np.random.default_rng([seed, r]), host_probs(x[r], settings)",
           "rng, dist = np.random.default_rng([seed, r]), host_probs(x[0], settings)",
           "wrong row in the logits: every node draws from the root's distribution", LOSSLESS),
    Mutant("sample-root-draw-everywhere", V, "        y = int(verdict[node, 0])\n",
           "        y = int(verdict[0, 0])\n",
           "the walk reads the root's draw at every node", LOSSLESS),
    Mutant("sample-filters-dropped", V,
           "rng, dist = np.random.default_rng([seed, r]), host_probs(x[r], settings)",
           "rng, dist = np.random.default_rng([seed, r]), host_probs(x[r], "
           "SamplerSettings(temp=settings.temp))",
           "acceptance ignores top-k / top-p / min-p (temperature only)", LOSSLESS),
    Mutant("accept-greedy-when-sampling", V, "    if settings.greedy:\n        best = x.argmax(axis=-1)",
           "    if True:\n        best = x.argmax(axis=-1)",
           "the host verdict takes the greedy branch whatever the regime", LOSSLESS),
    Mutant("sample-draft-always-passes", V,
           "took = float(rng.random() * qr[child] < dist[child])", "took = 1.0",
           "every sampled draft accepted without the min(1, p/q) test", LOSSLESS),
    Mutant("residual-forgotten", V, "    r = lib.maximum(p - q, 0.0)\n", "    r = p\n",
           "after rejecting a sampled draft, the draw comes from p again, not from the "
           "residual max(p - q, 0) (it may return the rejected draft)", LOSSLESS),
    Mutant("device-draft-always-passes", V,
           "passed = has & (mx.random.uniform(shape=px.shape, key=key_u) * qx < px)",
           "passed = has", "on the device: every sampled draft accepted without its test",
           LOSSLESS),
    Mutant("epl-skips-root", V, "for u in range(len(tree) - 1, -1, -1):",
           "for u in range(len(tree) - 1, 0, -1):",
           "off-by-one in the tree walk: expected_path_length never sums the root's children"),
    Mutant("epl-child-row", V, "probs[u, tree.token[c]]", "probs[c, tree.token[c]]",
           "wrong row: a child's acceptance read from its own row instead of its parent's"),
    # --- sampling.py ------------------------------------------------------------------------
    Mutant("topk-off-by-one", S, "keep = desc >= desc[..., s.top_k - 1:s.top_k]",
           "keep = desc >= desc[..., s.top_k:s.top_k + 1]", "top-k keeps k + 1 tokens"),
    Mutant("topp-inclusive", S, "(before < s.top_p * p.sum(-1, keepdims=True))",
           "(before <= s.top_p * p.sum(-1, keepdims=True))", "< vs <= at the top-p boundary"),
    Mutant("topp-of-full-mass", S, "(before < s.top_p * p.sum(-1, keepdims=True))",
           "(before < s.top_p)", "top-p measured on the full mass, not the mass top-k kept"),
    Mutant("minp-alone-skipped", S, "if not (s.top_k or s.top_p < 1.0 or s.min_p > 0):",
           "if not (s.top_k or s.top_p < 1.0):", "min-p alone takes the no-filter shortcut"),
    Mutant("threshold-strict", S, "return mx.where(x >= threshold, x, -mx.inf)",
           "return mx.where(x > threshold, x, -mx.inf)",
           ">= vs >: the last kept token (and its ties) filtered out"),
    Mutant("host-temp-multiplied", S, "    x = x / s.temp\n", "    x = x * s.temp\n",
           "host_probs multiplies by the temperature"),
    Mutant("host-not-renormalised", S, "    return p / p.sum()\n", "    return p\n",
           "host_probs forgets to renormalise after filtering"),
    Mutant("host-topp-includes-own-mass", S, "before = np.cumsum(desc) - desc",
           "before = np.cumsum(desc)", "host top-p counts a token's own mass as 'before' it"),
    Mutant("draw-side-left", S, 'side="right"', 'side="left"',
           "inverse-CDF search on the left side (differs only at exact cumulative values)"),
    Mutant("ar-draw-unfiltered", S, "return _compiled_sampler(s)(logits, key)",
           "return mx.random.categorical(logits / s.temp, key=key)",
           "the AR device draw ignores top-k / top-p / min-p"),
    # --- tree.py ----------------------------------------------------------------------------
    Mutant("ancestor-mask-parent-only", T, "m[i] = m[parent[i]]", "m[i, parent[i]] = True",
           "wrong ancestor mask: a node sees its parent only, not all its ancestors"),
    Mutant("depths-off-by-one", T, "return ancestor_mask(parent).sum(1) - 1",
           "return ancestor_mask(parent).sum(1)", "depths (hence positions) off by one"),
    Mutant("tree-rows-miss-prefix", T, "block[prefix:, :prefix] = True",
           "block[prefix:, :prefix] = False", "tree rows do not see the block's prefix tokens"),
    Mutant("prune-strict-budget", T, "if count + len(chain) <= budget:",
           "if count + len(chain) < budget:", "< vs <=: prune never fills the budget exactly"),
    Mutant("path-prob-parent-only", T, "prob[v] *= prob[parent[v]]",
           "prob[v] *= accept[parent[v]]",
           "path probability multiplies the parent's estimate, not the parent's path probability"),
    Mutant("rerooted-walk-off-by-one", T, "for v in range(node + 1, len(self)):",
           "for v in range(node + 2, len(self)):", "off-by-one in the rerooting walk"),
    Mutant("subtree-parents-not-reindexed", T, "values[1] = new_index.get(p, -1)",
           "values[1] = p", "pruned subtree keeps the old parent indices"),
    Mutant("treemask-words-floor", T, "words = max(1, -(-rows // 32))",
           "words = max(1, rows // 32)", "bit words rounded down: rows past 32 lose mask bits"),
    # --- decoder.py and step.py: the acceptance / commit path ----------------------------------------------
    Mutant("commit-keeps-prefix-rows", P, "session.cache.keep(acc.path)",
           "session.cache.keep(range(len(acc.path)))",
           "wrong cache.keep path: the first len(path) rows kept, not the accepted nodes' rows"),
    Mutant("commit-history-prefix-rows", V, "verdict[path, 1].tolist()",
           "verdict[:len(path), 1].tolist()",
           "the history scores the first rows, not the accepted path's"),
    Mutant("commit-history-offset", P,
           "history.keep(history.committed, np.array(walked.scores, dtype=np.float32))",
           "history.keep(history.committed + 1, np.array(walked.scores, dtype=np.float32))",
           "the path's scores recorded one position late"),
    Mutant("ar-step-score-offset", P,
           "history.keep(history.committed, self.score.finish(got[1], [token]))",
           "history.keep(history.committed - 1, self.score.finish(got[1], [token]))",
           "an AR step's score recorded one position early"),
    # --- history.py: the scores the n-gram drafter reads --------------------------------------
    Mutant("history-deferred-own-token", H,
           "following = np.concatenate([self.tokens[s + 1:s + 1 + h.shape[0]] for s, h in mine])",
           "following = np.concatenate([self.tokens[s:s + h.shape[0]] for s, h in mine])",
           "deferred rows scored against their own token, not the one that followed"),
    Mutant("history-reuse-keeps-stale-score", H,
           "return keep if same or deferred else keep - 1", "return keep",
           "a reused prefix keeps its last position unscored when the token after it changed"),
    Mutant("history-top10-rule-off-by-one", H,
           "(x > own[:, None]).sum(-1) >= TOP_RANKS", "(x > own[:, None]).sum(-1) > TOP_RANKS",
           "the 11th-ranked token counts as inside the top-10"),
    Mutant("commit-block-by-index", P, "block = [tree.token[i] for i in acc.path]",
           "block = [tree.token[i] for i in range(len(acc.path))]",
           "committed tokens read by position in the tree, not along the accepted path"),
    Mutant("accept-and-commit-returns-root", P, "    return following\n",
           "    return block + [acc.bonus]\n",
           "commit (so tree_step and the decoder) also returns the root (already committed)"),
    Mutant("decoder-stats-accepted", E, "self._record(plan.stats(len(drafted),",
           "self._record(plan.stats(len(step.acceptance.path),",
           "accepted drafts counted with the root"),
    Mutant("ar-read-packs-late", P,
           "        if history.pending():\n            return self.finish(read_back(",
           "        if True:\n            return self.finish(read_back(",
           "a scored AR step packs its readback when read, behind the next forward already "
           "queued, so the read waits for that forward too", ("tests/test_waits.py",)),
    Mutant("decoder-greedy-rule", P,
           "verdict = verify.queue_verdict(logits, settings, seed, drafts, scores)",
           "verdict = verify.queue_verdict(logits, SamplerSettings(), seed, drafts, scores)",
           "the tree step accepts with default (greedy) settings whatever the regime", LOSSLESS),
    # --- requests decoded together (batch.py, decoder.py, pricing.py) -------------------------
    Mutant("batch-reads-misaligned", "treegraft_mlx/batch.py", "n = len(one.want.parts)",
           "n = len(one.want.parts) + (at > 0)",
           "every lane after the first reads values shifted by one part",
           ("tests/test_batch.py",)),
    Mutant("together-stretch-reruns-in-flight", E,
           "                    if queued is None:\n                        queued = forward.queue(",
           "                    if True:\n                        queued = forward.queue(",
           "a request that joins company with a forward in flight runs its row again",
           ("tests/test_batch.py",)),
    Mutant("together-ar-step-reruns-in-flight", E,
           "        if self.together and queued is None:\n",
           "        if self.together:\n",
           "the same, in a tree strategy's AR step", ("tests/test_batch.py",)),
    Mutant("together-stretch-not-ahead", E,
           "                    after = forward.queue((yield forward.block(queued.token)))\n",
           "                    after = None\n",
           "AR requests together read each token before queueing the next row (outputs "
           "unchanged; the device idles while the host accepts)", ("tests/test_batch.py",)),
    Mutant("batch-call-priced-alone", "treegraft_mlx/pricing.py",
           "value = (company.tokens + tokens[tried])", "value = (tokens[tried])",
           "a chain in a batch is priced on its own request's tokens over the batch's time, "
           "so the bigger the batch the more it calls", ("tests/test_engine.py",)),
    Mutant("joint-plan-prices-one-row-late", "treegraft_mlx/pricing.py",
           "ms[forced - 1:forced + len(pool)]", "ms[forced:forced + len(pool) + 1]",
           "the joint plan prices every size one row too dear", ("tests/test_batch.py",)),
    Mutant("pool-ar-length-one-short", "treegraft_mlx/models/segments.py",
           "lengths[ar_slots] = [s.cache.offset + 1 for s in ar]",
           "lengths[ar_slots] = [s.cache.offset for s in ar]",
           "the AR rows over the pool do not attend their own new key",
           ("tests/test_packed.py",)),
    Mutant("pool-rows-in-pool-order", "treegraft_mlx/models/segments.py",
           'order = np.argsort(np.concatenate([rows, others]), kind="stable")',
           "order = np.concatenate([rows, others])",
           "a pooled forward's outputs are put back in the wrong row order",
           ("tests/test_packed.py",)),
    Mutant("pool-slot-taken-twice", "treegraft_mlx/slots.py",
           "slot = min(set(range(len(self.taken) + 1)) - set(self.taken))",
           "slot = len(self.taken)",
           "a new request can get a slot another still holds (after one left)",
           ("tests/test_slots.py", "tests/test_batch.py")),
    Mutant("varlen-every-ar-row-in-slot-0", "treegraft_mlx/models/segments.py",
           "blocks.append((s.cache.slot, attention_mask(np.array([-1]), s.cache.offset)))",
           "blocks.append((0, attention_mask(np.array([-1]), s.cache.offset)))",
           "the varlen table sends every AR row to slot 0", ("tests/test_kernels.py",)),
    Mutant("decoder-drops-padding", P,
           "block = tree_block(session.cache, tree, rows, chain)",
           "block = tree_block(session.cache, tree, 0, chain)",
           "the chosen padded block size is ignored (performance only, outputs unchanged)"),
)

SANITY = Mutant("sanity-broken-tree", T, 'NEG_INF = float("-inf")',
                f'raise RuntimeError("{SANITY_MARKER}")', "the copy must be what runs")


@dataclass
class Outcome:
    name: str
    file: str
    bug: str
    killed: bool
    killer: str
    seconds: float


def copy_repository(src: Path, dst: Path) -> int:
    """Copy git-tracked and untracked non-ignored files (those present) into dst."""
    listing = subprocess.run(["git", "ls-files", "-co", "--exclude-standard", "-z"], cwd=src,
                             check=True, capture_output=True).stdout.decode()
    count = 0
    for rel in filter(None, listing.split("\0")):
        path = src / rel
        if path.is_file():
            (dst / rel).parent.mkdir(parents=True, exist_ok=True)
            shutil.copy2(path, dst / rel)
            count += 1
    return count


def check_snippets(copy: Path, mutants: tuple[Mutant, ...]) -> None:
    """Fail loudly unless every mutant's snippet occurs exactly once in its file."""
    bad = []
    for m in mutants:
        n = (copy / m.file).read_text().count(m.original)
        if n != 1:
            bad.append(f"{m.name}: snippet found {n} times in {m.file}: {m.original!r}")
    if bad:
        raise SystemExit("mutation check: snippets must occur exactly once\n  " + "\n  ".join(bad))


def copy_env(copy: Path) -> dict[str, str]:
    env = dict(os.environ, PYTHONPATH=str(copy), PYTHONDONTWRITEBYTECODE="1")
    env.pop("PYTEST_ADDOPTS", None)
    return env


def check_import_path(copy: Path) -> None:
    """The copy's treegraft_mlx must shadow the editable install."""
    out = subprocess.run([sys.executable, "-c", "import treegraft_mlx; print(treegraft_mlx.__file__)"],
                         cwd=copy, env=copy_env(copy), check=True, capture_output=True,
                         text=True).stdout.strip()
    if not Path(out).resolve().is_relative_to(copy.resolve()):
        raise SystemExit(f"mutation check: treegraft_mlx imported from {out}, not the copy {copy}")


def run_pytest(copy: Path, tests: tuple[str, ...], timeout: float) -> tuple[int, str]:
    """(return code, output) of one pytest run in the copy; 124 on timeout."""
    cmd = [sys.executable, "-m", "pytest", "-q", "-x", "-p", "no:cacheprovider", "-k", DESELECT,
           *tests]
    proc = subprocess.Popen(cmd, cwd=copy, env=copy_env(copy), stdout=subprocess.PIPE,
                            stderr=subprocess.STDOUT, text=True, start_new_session=True)
    try:
        out, _ = proc.communicate(timeout=timeout)
        return proc.returncode, out
    except subprocess.TimeoutExpired:
        os.killpg(proc.pid, signal.SIGKILL)
        out, _ = proc.communicate()
        return 124, out


def first_failure(rc: int, output: str) -> str:
    """The test that failed first, from pytest's short summary (or why it stopped)."""
    if rc == 124:
        return "timeout"
    found = re.search(r"^(?:FAILED|ERROR) (.+?)(?: - .*)?$", output, re.MULTILINE)
    if found:
        return found.group(1)
    conftest = re.search(r"^\S*Error while loading conftest '(.+?)'", output, re.MULTILINE)
    return f"import error in {Path(conftest.group(1)).name}" if conftest else f"pytest exit {rc}"


@contextlib.contextmanager
def applied(copy: Path, m: Mutant) -> Iterator[None]:
    """The mutant's replacement in the copy for the duration; the file restored after."""
    path = copy / m.file
    source = path.read_text()
    path.write_text(source.replace(m.original, m.replacement, 1))
    try:
        yield
    finally:
        path.write_text(source)


def run_mutant(copy: Path, m: Mutant) -> Outcome:
    """Apply one mutant in the copy, run its tests, restore the file."""
    t0 = time.monotonic()
    with applied(copy, m):
        rc, output = run_pytest(copy, FAST_TESTS + m.extra,
                                BASE_TIMEOUT_S + EXTRA_TIMEOUT_S * len(m.extra))
    killed = rc != 0
    return Outcome(m.name, m.file, m.bug, killed, first_failure(rc, output) if killed else "",
                   round(time.monotonic() - t0, 1))


def check_sanity(copy: Path) -> None:
    """A deliberately broken tree.py in the copy must fail the tree tests with its marker."""
    with applied(copy, SANITY):
        rc, output = run_pytest(copy, ("tests/test_tree.py",), BASE_TIMEOUT_S)
    if rc == 0 or SANITY_MARKER not in output:
        raise SystemExit("mutation check: the broken copy did not fail: the copy is not what runs")
    print(f"sanity: broken copy fails as it should ({first_failure(rc, output)})", flush=True)


def check_baseline(copy: Path, mutants: tuple[Mutant, ...]) -> None:
    """The unmutated copy must pass every test list the mutants use."""
    extras = tuple(dict.fromkeys(t for m in mutants for t in m.extra))
    t0 = time.monotonic()
    rc, output = run_pytest(copy, FAST_TESTS + extras,
                            BASE_TIMEOUT_S + EXTRA_TIMEOUT_S * len(extras))
    if rc != 0:
        print(output[-4000:])
        raise SystemExit(f"mutation check: the unmutated copy fails ({first_failure(rc, output)})")
    print(f"baseline: unmutated copy passes in {time.monotonic() - t0:.0f} s", flush=True)


def print_table(outcomes: list[Outcome]) -> None:
    width = max(len(o.name) for o in outcomes)
    print(f"\n{'mutant':<{width}}  {'result':<8}  {'s':>6}  killed by")
    for o in outcomes:
        result = "killed" if o.killed else "SURVIVED"
        print(f"{o.name:<{width}}  {result:<8}  {o.seconds:>6.1f}  {o.killer or '-'}")
    killed = sum(o.killed for o in outcomes)
    print(f"\nkilled {killed} of {len(outcomes)} mutants: {100 * killed / len(outcomes):.0f}%")
    for o in outcomes:
        if not o.killed:
            print(f"  survived: {o.name} ({o.file}): {o.bug}")


def select(names: list[str] | None) -> tuple[Mutant, ...]:
    if not names:
        return MUTANTS
    unknown = set(names) - {m.name for m in MUTANTS}
    if unknown:
        raise SystemExit(f"mutation check: unknown mutants {sorted(unknown)}")
    return tuple(m for m in MUTANTS if m.name in names)


def parse_args() -> argparse.Namespace:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--json", type=Path, help="also write the outcomes here")
    ap.add_argument("--only", nargs="+", metavar="NAME", help="run only these mutants")
    ap.add_argument("--no-baseline", action="store_true", help="skip the unmutated run")
    ap.add_argument("--list", action="store_true", help="list the mutants and exit")
    return ap.parse_args()


def main() -> None:
    args = parse_args()
    mutants = select(args.only)
    if args.list:
        for m in mutants:
            print(f"{m.name:<32} {m.file:<28} {m.bug}")
        return
    with tempfile.TemporaryDirectory(prefix="mutation-check-") as tmp:
        copy = Path(tmp)
        print(f"copied {copy_repository(ROOT, copy)} files to {copy}", flush=True)
        check_snippets(copy, mutants + (SANITY,))
        check_import_path(copy)
        check_sanity(copy)
        if not args.no_baseline:
            check_baseline(copy, mutants)
        outcomes = []
        for i, m in enumerate(mutants, 1):
            outcomes.append(run_mutant(copy, m))
            o = outcomes[-1]
            print(f"[{i}/{len(mutants)}] {o.name}: {'killed' if o.killed else 'SURVIVED'} "
                  f"({o.seconds:.0f} s) {o.killer}", flush=True)
    print_table(outcomes)
    if args.json:
        killed = sum(o.killed for o in outcomes)
        args.json.write_text(json.dumps({"killed": killed, "total": len(outcomes),
                                         "share_killed": killed / len(outcomes),
                                         "fast_tests": FAST_TESTS, "deselect": DESELECT,
                                         "mutants": [asdict(o) for o in outcomes]}, indent=1))


if __name__ == "__main__":
    main()
