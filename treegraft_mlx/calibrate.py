"""The offline value system: counterfactual labels for the scheduler, and their distillation.

At every decision point of a step (before each tree layer) both branches are played out from
the same state: the strong drafter expands this layer (call) or the weak one does (skip); the
rest of the step follows the reference policy (weak drafter only); each branch's tree is
pruned and verified by the target. A branch's value is committed tokens per millisecond of
step time:

    value = E[committed tokens] / (drafting ms measured so far in this step + the branch's
            measured drafting ms + T_verify(nodes verified))

where T_verify comes from the target's verification-latency curve measured on this machine at
the start of the run (a curve, not each branch's own noisy wall time: both branches verify
similar trees, and a 2-3 ms timing jitter would otherwise swamp a one-token difference).
E[committed tokens] is exact, not a draw: a drafted child is accepted iff the target's draw at
its parent is its token (verify.expected_path_length), so greedy labels count the greedy path
and sampled labels (a calibration with temperature > 0) weigh every path by its probability.
The label is value(call) - value(skip); the scheduler calls iff its prediction is > 0. The step
itself then continues with an exploring behaviour policy (strong drafter with probability
1/2, within b0 calls), so states after earlier calls are visited too.

The dataset is written prompt by prompt (one JSON line each), so an interrupted run resumes
where it stopped. Greedy and sampled decoding get separate datasets and artifacts: which
drafter pays off differs (n-gram drafts are accepted far less often when sampling).

One-step counterfactual labels miss what a whole generation pays (the strong drafter catching
up on tokens committed while it was skipped, several calls in one step compounding), so the
zero point of the distilled value is corrected end to end: the scheduler runs on the
calibration prompts with the value shifted by a few candidate offsets (chosen as the
dataset's call-rate quantiles, plus 0 and "never"), tokens/s is measured in alternating order,
and the fastest offset is folded into the de-standardisation (`out_mean`), so the runtime rule
stays "call iff value > 0".

The runtime budget b0 is chosen from the same data: every strong-drafter call in a step opens
another run of decisions (features, look-ahead, one MLP evaluation, measured during the offset
runs), and calls stop at the first count of calls-this-step where what the policy's calls
gain (their labels) no longer pays for those evaluations (`budget_table`, `choose_b0`).
"""

from __future__ import annotations

import functools
import hashlib
import json
import time
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Callable, Optional

import mlx.core as mx
import mlx.optimizers as optim
import numpy as np

from .bench import machine_info
from .build import TreeBuild
from .calibration import play, resume
from .step import VerifiedStep, tree_step
from .drafters import Drafters
from .engine import generate
from .family import Family, TreeConfig
from .sampling import SamplerSettings, target_probs
from .scheduler import (FEATURE_NAMES, FixedSchedule, LearnedSchedule,
                        SchedulerMLP, features, mlp_forward)
from .session import Session
from .timing import LatencyCurve, Timing, verification_latency
from .tree import prune
from .verify import expected_path_length, verify

REFERENCE = FixedSchedule(frozenset())   # after a decision, the weak drafter builds the rest
EXPLORE_CALL_PROB = 0.5
DATASET = "dataset.jsonl"
OFFSET_CALL_RATES = (0.02, 0.05, 0.1, 0.2)   # candidate offsets: these call-rate quantiles
OFFSET_REPEATS = 2                           # measurements per offset, order alternating


@dataclass(frozen=True)
class CalibrationRun:
    """What one scheduler calibration labels and measures with, from the command line down."""

    max_tokens: int = 64          # new tokens per calibration prompt
    b0: int = 5                   # most strong-drafter calls per step while labelling; the
                                  # runtime budget is chosen from the data, at most this
    seed: int = 0
    settings: SamplerSettings = SamplerSettings()   # the regime calibrated for


@dataclass
class Branches:
    """Both branches of one decision: committed tokens and step ms of each."""

    tokens_call: int
    ms_call: float
    tokens_skip: int
    ms_skip: float

    @property
    def label(self) -> float:
        return self.tokens_call / self.ms_call - self.tokens_skip / self.ms_skip


def _play(session: Session, drafters: Drafters, build: TreeBuild, layer: int, call: bool,
          curve: LatencyCurve, spent_ms: float, settings: SamplerSettings) -> tuple[float, float]:
    """Finish the step from `build` with this layer called or skipped; (expected committed
    tokens under the regime's acceptance, step ms)."""
    cfg, history = session.tree, session.history
    t0 = time.perf_counter()
    build.expand([layer], FixedSchedule(frozenset({layer} if call else set())), drafters, cfg,
                 history)
    build.expand(range(layer + 1, cfg.depth + 1), REFERENCE, drafters, cfg, history)
    tree = build.tree.subtree(prune(build.tree, cfg.budget))
    draft_ms = 1000 * (time.perf_counter() - t0)
    rows = cfg.rows_for(len(tree))
    logits = verify(session.family.target, session.cache, tree, rows)
    probs = np.array(target_probs(logits, settings), dtype=np.float64)
    return expected_path_length(tree, probs), spent_ms + draft_ms + curve(rows)


def label_prompt(session: Session, ids: list[int], timing: Timing, curve: LatencyCurve,
                 run: CalibrationRun, rng: np.random.Generator) -> list[dict]:
    """Generate up to `run.max_tokens` (greedy or sampled per `run.settings`), labelling every
    decision point on the way."""
    settings, b0 = run.settings, run.b0
    cfg = session.tree
    strong = session.strong
    drafters = Drafters(session.ngram, strong)
    rows: list[dict] = []

    def step(root: int) -> VerifiedStep:
        history = session.history
        build = TreeBuild.rooted_at(root)
        spent_ms = 0.0
        for layer in range(1, cfg.depth + 1):
            if len(build.called) < b0:
                x = features(build.state(layer, cfg, history), timing.t_tgt_ms, timing.t_mid_ms)
                snap = strong.snapshot()
                call = _play(session, drafters, build.copy(), layer, True, curve, spent_ms,
                             settings)
                strong.restore(snap)
                skip = _play(session, drafters, build.copy(), layer, False, curve, spent_ms,
                             settings)
                strong.restore(snap)
                b = Branches(*call, *skip)
                rows.append({"x": x.tolist(), "label": b.label, "layer": layer,
                             "branches": asdict(b)})
            explore = len(build.called) < b0 and rng.random() < EXPLORE_CALL_PROB
            t0 = time.perf_counter()
            build.expand([layer], FixedSchedule(frozenset({layer} if explore else set())),
                         drafters, cfg, history)
            spent_ms += 1000 * (time.perf_counter() - t0)
        tree = build.tree.subtree(prune(build.tree, cfg.budget))
        return tree_step(session, drafters, tree, cfg.rows_for(len(tree)), settings, rng)

    play(session, ids, settings, rng, run.max_tokens, step)
    return rows


def latency_curve(family: Family, curve_file: Path) -> LatencyCurve:
    """The verification curve a work directory labels with: measured on its first use and
    kept in `curve_file`, so a resumed run labels with the same one."""
    if curve_file.exists():
        points = {int(k): v for k, v in json.loads(curve_file.read_text()).items()}
    else:
        points = verification_latency(family.target, sizes=(1, 4, 8, 16, 32, 64))
        _write_json(curve_file, points)
    return LatencyCurve(points)


def build_dataset(family: Family, prompts: list[dict], out_dir: Path, timing: Timing,
                  run: CalibrationRun = CalibrationRun(),
                  progress: Optional[Callable[[int], None]] = None) -> dict[str, list[dict]]:
    """Label every prompt not labelled yet in `out_dir` (resumable), appending as it goes.
    A work directory holds one decoding regime: resuming it with other sampling settings is
    an error, not a mixed dataset."""
    out_dir = Path(out_dir)
    out_dir.mkdir(parents=True, exist_ok=True)
    # Read or measured once, when the first prompt is labelled (after the regime check).
    curve = functools.cache(lambda: latency_curve(family, out_dir / "latency.json"))

    def label(i: int, p: dict) -> dict:
        rows = label_prompt(Session(family, family.tree), family.tokenizer.encode(p["prompt"]),
                            timing, curve(), run, np.random.default_rng([run.seed, i]))
        return {"rows": rows}

    done = resume(out_dir / DATASET, prompts, run.settings, label, progress)
    return {k: e["rows"] for k, e in done.items()}


def train_mlp(dataset: dict[str, list[dict]], holdout: float = 0.25, epochs: int = 1000,
              seed: int = 0) -> tuple[SchedulerMLP, dict]:
    """Distil the labels into the MLP (MSE on standardised labels, AdamW, full batch).

    Prompts, not rows, are split: a quarter is held out (reported, never trained on), and a
    fifth of the rest validates: training keeps the parameters with the best validation gain
    (label mass collected by the decisions), since a 17-64-32-1 net overfits a few thousand
    noisy labels long before its training loss stops falling.
    """
    ids = sorted(dataset)
    rng = np.random.default_rng(seed)
    rng.shuffle(ids)
    n_hold = max(1, int(round(holdout * len(ids)))) if len(ids) > 2 else 0
    n_val = max(1, int(round(0.2 * (len(ids) - n_hold)))) if len(ids) - n_hold > 1 else 0
    held, val, train = ids[:n_hold], ids[n_hold:n_hold + n_val], ids[n_hold + n_val:]

    def arrays(names):
        rows = [r for n in names for r in dataset[n]]
        return (np.array([r["x"] for r in rows], np.float32).reshape(-1, len(FEATURE_NAMES)),
                np.array([r["label"] for r in rows], np.float32))

    (x_tr, y_tr), (x_va, y_va), (x_ho, y_ho) = arrays(train), arrays(val), arrays(held)
    if len(x_tr) == 0:
        raise ValueError("no labelled decisions to train on")
    mlp = SchedulerMLP.init(seed)
    std = x_tr.std(0)
    mlp.params.update(in_mean=mx.array(x_tr.mean(0)), in_std=mx.array(np.where(std > 1e-6, std, 1.0)),
                      out_mean=mx.array([float(y_tr.mean())]),
                      out_std=mx.array([float(y_tr.std()) or 1.0]))
    trainable = {k: v for k, v in mlp.params.items() if k.startswith("l")}
    fixed = {k: v for k, v in mlp.params.items() if not k.startswith("l")}
    x, y = mx.array(x_tr), mx.array(y_tr)

    def loss_fn(p):
        pred = mlp_forward({**fixed, **p}, x)
        return mx.mean(((pred - y) / fixed["out_std"]) ** 2)

    opt = optim.AdamW(learning_rate=3e-3, weight_decay=1e-2)
    step = mx.value_and_grad(loss_fn)
    best, best_gain, best_epoch = dict(trainable), -np.inf, 0
    for epoch in range(1, epochs + 1):
        _, grads = step(trainable)
        opt.update(trainable, grads)
        mx.eval(trainable, opt.state)
        if len(x_va) and epoch % 10 == 0:
            gain = _decision_metrics(SchedulerMLP({**fixed, **trainable}), x_va, y_va)["gain_policy"]
            if gain > best_gain:
                best, best_gain, best_epoch = dict(trainable), gain, epoch
    if not len(x_va):
        best, best_epoch = trainable, epochs
    mlp = SchedulerMLP({**fixed, **best})
    return mlp, {"train_rows": len(x_tr), "validation_rows": len(x_va),
                 "heldout_rows": len(x_ho), "train_prompts": len(train),
                 "validation_prompts": len(val), "heldout_prompts": len(held),
                 "epochs": epochs, "best_epoch": best_epoch,
                 "train": _decision_metrics(mlp, x_tr, y_tr),
                 "heldout": _decision_metrics(mlp, x_ho, y_ho) if len(x_ho) else None}


def _decision_metrics(mlp: SchedulerMLP, x: np.ndarray, y: np.ndarray) -> dict:
    """How good the decisions are: sign accuracy, and the label mass the policy collects
    compared with always calling, never calling (0) and the oracle (tokens/ms, summed)."""
    pred = np.array(mlp.value(mx.array(x)))
    call = pred > 0
    return {"mse": float(np.mean((pred - y) ** 2)), "sign_accuracy": float(np.mean(call == (y > 0))),
            "call_rate": float(call.mean()), "gain_policy": float(y[call].sum()),
            "gain_always": float(y.sum()), "gain_oracle": float(y[y > 0].sum())}


def shifted(mlp: SchedulerMLP, offset: float) -> SchedulerMLP:
    """The MLP whose value is `offset` lower (calls iff the original value > offset)."""
    return SchedulerMLP({**mlp.params, "out_mean": mlp.params["out_mean"] - offset})


def calibration_units(prompts: list[dict], repeats: int = OFFSET_REPEATS) -> int:
    """Progress units of a calibration run: prompts to label, then offsets x repeats."""
    return len(prompts) + (len(OFFSET_CALL_RATES) + 2) * repeats


def candidate_offsets(mlp: SchedulerMLP, x: np.ndarray) -> list[float]:
    """0, the offsets at which the policy would call on OFFSET_CALL_RATES of the dataset's
    decisions, and one above every value (never call)."""
    v = np.array(mlp.value(mx.array(x)))
    offsets = {0.0, float(v.max()) + 1e-3}
    offsets.update(float(np.quantile(v, 1.0 - q)) for q in OFFSET_CALL_RATES)
    return sorted(offsets)


def tune_offset(family: Family, prompts: list[dict], mlp: SchedulerMLP, timing: Timing,
                offsets: list[float], run: CalibrationRun, repeats: int = OFFSET_REPEATS,
                progress: Optional[Callable[[int], None]] = None) -> tuple[float, list[dict]]:
    """Tokens/s (greedy or sampled per `run.settings`, seeded) of the scheduler at each offset on
    `prompts` (order alternating across repeats), and the measured cost of one decision run
    (features, look-ahead, one MLP evaluation); returns the fastest offset and the
    measurements."""
    tokens = {o: 0 for o in offsets}
    seconds = {o: 0.0 for o in offsets}
    calls = {o: 0 for o in offsets}
    deciding = {o: 0.0 for o in offsets}
    evaluations = {o: 0 for o in offsets}
    for rep in range(repeats):
        for o in (offsets if rep % 2 == 0 else offsets[::-1]):
            schedule = LearnedSchedule(shifted(mlp, o), timing.t_tgt_ms, timing.t_mid_ms, run.b0)
            for p in prompts:
                r = generate(family, p["prompt"], "treegraft-learned", max_tokens=run.max_tokens,
                             schedule=schedule, settings=run.settings, seed=run.seed)
                tokens[o] += r.generation_tokens
                seconds[o] += r.generation_tokens / r.tokens_per_sec if r.tokens_per_sec else 0.0
                calls[o] += r.drafter_calls
                deciding[o] += sum(s.t_schedule for s in r.step_stats)
            evaluations[o] += schedule.evaluations
            if progress:
                progress(1)
    table = [{"offset": o, "tokens_per_sec": tokens[o] / seconds[o] if seconds[o] else 0.0,
              "drafter_calls": calls[o], "evaluations": evaluations[o],
              "decision_ms": 1000 * deciding[o] / max(1, evaluations[o])} for o in offsets]
    best = max(table, key=lambda row: row["tokens_per_sec"])
    return best["offset"], table


def pooled_decision_ms(table: list[dict]) -> float:
    """One decision run's cost over every offset's runs: an evaluation costs the same at any
    offset, and the chosen offset alone may have decided rarely or never (its steps ran as
    plain stretches, or drafting did not pay), which would price decisions at nothing."""
    runs = sum(row["evaluations"] for row in table)
    return sum(row["decision_ms"] * row["evaluations"] for row in table) / max(1, runs)


def budget_table(dataset: dict[str, list[dict]], mlp: SchedulerMLP, decision_ms: float,
                 most: int) -> list[dict]:
    """What the scheduler gains and costs at states reached after c calls in a step, for
    c = 0 .. most - 1 (tokens/ms summed over the dataset).

    gain: the label mass of the policy's calls there (its one-step value). cost: every run of
    decisions starting there (after the step's c-th call, or at layer 1 for c = 0) is one MLP
    evaluation with its look-ahead, `decision_ms` of step time: the value it loses is
    tokens/ms - tokens/(ms + decision_ms), from the skip branch's measured tokens and ms.
    """
    table = [{"calls": c, "states": 0, "runs": 0, "gain": 0.0, "cost": 0.0} for c in range(most)]
    i_layer, i_called = FEATURE_NAMES.index("layer_over_depth"), FEATURE_NAMES.index("called_over_depth")
    for rows in dataset.values():
        if not rows:
            continue
        x = np.array([r["x"] for r in rows], np.float32)
        value = np.array(mlp.value(mx.array(x)))
        before = -1                        # calls made before the previous row's layer
        for r, xr, v in zip(rows, x, value):
            c = int(round(float(xr[i_called] / xr[i_layer]) * r["layer"]))
            starts_run, before = r["layer"] == 1 or c != before, c
            if c >= most:
                continue
            t = table[c]
            t["states"] += 1
            if v > 0:
                t["gain"] += r["label"]
            if starts_run:
                b = r["branches"]
                tok, ms = b["tokens_skip"], b["ms_skip"]
                t["runs"] += 1
                t["cost"] += tok / ms - tok / (ms + decision_ms)
    return table


def choose_b0(table: list[dict], most: int) -> int:
    """The runtime budget: calls stop at the first count c whose decisions cost at least what
    they gain, or where no decision was labelled (0: the scheduler is not worth evaluating at
    all); `most` if none does."""
    for row in table:
        if row["gain"] <= row["cost"]:
            return row["calls"]
    return most


def dataset_timing(out_dir: Path, measure: Callable[[], Timing]) -> Timing:
    """T_tgt/T_mid as the work directory's dataset was labelled with (features hold them):
    measured once per work directory, so a resumed run labels with the same values."""
    f = Path(out_dir) / "timing.json"
    if f.exists():
        return Timing(**json.loads(f.read_text()))
    timing = measure()
    f.parent.mkdir(parents=True, exist_ok=True)
    _write_json(f, asdict(timing))
    return timing


def _write_json(path: Path, obj) -> None:
    """Write a work-directory record whole or not at all: a resumed run trusts what it reads."""
    tmp = path.with_suffix(".tmp")
    tmp.write_text(json.dumps(obj))
    tmp.replace(path)


def provenance(prompts_file: Path, prompts: list[dict]) -> dict:
    data = Path(prompts_file).read_bytes()
    return {"file": str(prompts_file), "sha256": hashlib.sha256(data).hexdigest(),
            "prompt_ids": [p["id"] for p in prompts]}


def calibrate(family: Family, prompts_file: Path, prompts: list[dict], out_dir: Path,
              timing: Timing, artifact_dir: Path, run: CalibrationRun = CalibrationRun(),
              progress: Optional[Callable[[int], None]] = None) -> dict:
    """Label (resumably), train, correct the value's zero point end to end, choose the
    runtime budget (at most `run.b0`, the labelling budget) and save the scheduler artifact;
    returns its metadata. `progress` advances once per prompt labelled
    and once per offset measured (calibration_units in all)."""
    b0, settings = run.b0, run.settings
    dataset = build_dataset(family, prompts, out_dir, timing, run, progress)
    dataset = {p["id"]: dataset[p["id"]] for p in prompts if p["id"] in dataset}
    mlp, metrics = train_mlp(dataset, seed=run.seed)
    x = np.array([r["x"] for rows in dataset.values() for r in rows], np.float32)
    offsets = candidate_offsets(mlp, x)
    offset, table = tune_offset(family, prompts, mlp, timing, offsets, run, progress=progress)
    mlp = shifted(mlp, offset)
    metrics["call_rate_after_offset"] = float((np.array(mlp.value(mx.array(x))) > 0).mean())
    decision_ms = pooled_decision_ms(table)
    budget = budget_table(dataset, mlp, decision_ms, b0)
    tree: TreeConfig = family.tree
    meta = {"t_tgt_ms": timing.t_tgt_ms, "t_mid_ms": timing.t_mid_ms,
            "b0": choose_b0(budget, b0),
            "budget": {"most": b0, "decision_ms": decision_ms, "by_calls": budget,
                       "rule": "b0 = the first calls-this-step count whose decisions' label "
                               "gain is at most their evaluation cost"},
            "label": "tokens/ms(call) - tokens/ms(skip), tokens = expected committed tokens "
                     "under the sampling's acceptance, reference policy: weak drafter after "
                     "the decision; verification ms from the measured latency curve",
            "sampling": asdict(settings),
            "value_offset": {"offset": offset, "folded_into": "out_mean",
                             "measured": table, "repeats": OFFSET_REPEATS},
            "tree": asdict(tree), "max_tokens": run.max_tokens, "seed": run.seed,
            "calibration_prompts": provenance(prompts_file, prompts),
            "machine": machine_info(), "metrics": metrics}
    mlp.save(artifact_dir, meta)
    return meta
