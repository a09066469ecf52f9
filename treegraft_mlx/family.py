"""A model family: one target, its drafters (same tokenizer), and the tree settings to use."""

from __future__ import annotations

import json
import shutil
import time
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Callable, Optional, Sequence, Union

from .acceptance import REGIMES, AcceptanceModel, save as save_acceptance
from .drafters.assistant import check_pair
from .fixtures import family_manifest
from .hub import resolve_path
from .loading import LoadError, load_model
from .models import Model
from .pricing import Learned
from .scheduler import load_artifact

# `--draft-model none`, as a drafters argument: no strong drafter at all, a bundle's own
# included (the n-gram drafter alone serves).
NO_DRAFTER = "none"

if TYPE_CHECKING:                 # pipeline.start builds a family: no import back at run time
    from .pipeline import PipelineTarget


@dataclass(frozen=True)
class TreeConfig:
    """Tree shape (paper defaults) and verification budget.

    The budget default is the paper's; on devices where verifying many nodes costs much more
    than one (every CPU), calibrate it and store it in the bundle's manifest.
    """

    top_k: int = 10
    depth: int = 5
    budget: int = 64
    lookback: int = 5
    n_max: int = 5
    # verify_pad[n - 1]: rows to verify n nodes with. Measured per device: on some BLAS a
    # 16-row forward is faster than a 12-row one, so small trees are padded up (empty = never).
    verify_pad: tuple[int, ...] = ()
    # Each step verifies the subtree worth its cost (acceptance estimates and this device's
    # measured step costs, docs/design.md §7) instead of pruning to `budget`; then the pad
    # comes from the measured costs too.
    adaptive: bool = True

    def __post_init__(self):
        if self.top_k < 1 or self.depth < 1 or self.budget < 1 or self.n_max < 1:
            raise ValueError(f"tree settings must be positive: {self}")
        object.__setattr__(self, "verify_pad", tuple(int(m) for m in self.verify_pad))
        if any(m < n for n, m in enumerate(self.verify_pad, start=1)):
            raise ValueError(f"verify_pad must not shrink a block: {self.verify_pad}")

    def rows_for(self, n: int) -> int:
        """Rows the verification forward uses for n tree nodes (n itself, or padded up)."""
        return self.verify_pad[n - 1] if n <= len(self.verify_pad) else n


@dataclass
class Family:
    target: Union[Model, "PipelineTarget"]     # either is called like an mlx_lm model
    tokenizer: object
    drafters: dict[str, object] = field(default_factory=dict)
    tree: TreeConfig = field(default_factory=TreeConfig)
    path: Optional[Path] = None
    model_paths: dict[str, Path] = field(default_factory=dict)  # "target" and each drafter
    scheduler_dir: Optional[Path] = None   # calibrated scheduler artifact, if the bundle has one
    sampled_scheduler_dir: Optional[Path] = None   # one calibrated with sampling, if any
    acceptance: AcceptanceModel = field(default_factory=AcceptanceModel.default)
    _schedulers: dict = field(default_factory=dict, repr=False)
    # What decoding learns about this family on this device while it runs (Learned).
    learned: Learned = field(default_factory=Learned, repr=False)
    # Where decoding reads the time its decisions learn from (drafting and call costs): the
    # wall clock; tests script it so that what the sizer decides never depends on load.
    clock: Callable[[], float] = field(default=time.perf_counter, repr=False)

    def scheduler(self, sampled: bool = False) -> Optional[tuple]:
        """(SchedulerMLP, metadata) of the bundle's scheduler for greedy or sampled decoding
        (sampling falls back to the greedy one), loaded once; None without one."""
        directory = (sampled and self.sampled_scheduler_dir) or self.scheduler_dir
        if directory is None:
            return None
        if directory not in self._schedulers:
            self._schedulers[directory] = load_artifact(directory)
        return self._schedulers[directory]

    @property
    def strong(self):
        """The strong drafter model (the last one named), or None."""
        return list(self.drafters.values())[-1] if self.drafters else None

    @property
    def mtp(self):
        """The target's multi-token-prediction head (models/mtp.py), or None."""
        return getattr(self.target, "mtp", None)


def check_same_tokenizer(a, b, a_name: str, b_name: str) -> None:
    """Drafts are token ids: a drafter must share the target's vocabulary exactly. The error
    names the tokenizer class each side loaded: transformers picks a class by the model's
    type as well as by the tokenizer files, so the same files can load as two tokenizers."""
    va, vb = a.get_vocab(), b.get_vocab()
    classes = (f"\ntokenizer classes: {a_name} {tokenizer_class(a)}, "
               f"{b_name} {tokenizer_class(b)}")
    if va != vb:
        only_a = sorted(set(va) - set(vb))[:5]
        only_b = sorted(set(vb) - set(va))[:5]
        moved = sorted(t for t in set(va) & set(vb) if va[t] != vb[t])[:5]
        raise LoadError(
            f"tokenizer mismatch between {a_name} and {b_name}: vocabulary sizes {len(va)} vs "
            f"{len(vb)}; only in {a_name}: {only_a}; only in {b_name}: {only_b}; "
            f"different ids: {moved}{classes}")
    for attr in ("bos_token_id", "eos_token_id", "pad_token_id"):
        if getattr(a, attr, None) != getattr(b, attr, None):
            raise LoadError(f"tokenizer mismatch between {a_name} and {b_name}: {attr} "
                            f"{getattr(a, attr, None)} vs {getattr(b, attr, None)}{classes}")


def tokenizer_class(tokenizer) -> str:
    """The class transformers loaded, under mlx_lm's wrapper (which keeps it as `_tokenizer`)."""
    return type(getattr(tokenizer, "_tokenizer", tokenizer)).__name__


def target_dir(target_path_or_bundle: Union[str, Path]) -> Path:
    """The target model's directory: a bundle's `target`, or the path itself."""
    root = resolve_path(target_path_or_bundle)
    if (root / "treegraft.json").exists():
        return root / family_manifest(root)["target"]
    return root


def load_family(target_path_or_bundle: Union[str, Path],
                drafters: Union[Sequence[Union[str, Path]], str] = (),
                tree: Optional[TreeConfig] = None, target_stage=None, **model_kwargs) -> Family:
    """Load a family from a bundle directory (with treegraft.json) or a target plus drafters
    (named drafters join a bundle's own; NO_DRAFTER leaves out every one, a bundle's too).
    (`treegraft_mlx.load` also measures this device's costs on first use.) target_stage: load
    only a pipeline stage of the target (`pipeline.Stage`)."""
    own = not drafters_off(drafters)
    drafters = drafters if own else ()
    root = resolve_path(target_path_or_bundle)
    manifest_file = root / "treegraft.json"
    settings, scheduler_dir, sampled_dir = {}, None, None
    acceptance = AcceptanceModel.default()
    if manifest_file.exists():
        manifest = family_manifest(root)
        target_dir = root / manifest["target"]
        drafter_dirs = bundle_drafters(root, manifest) if own else []
        settings = manifest.get("tree", {})
        scheduler_dir = bundle_scheduler(root, manifest)
        sampled_dir = bundle_scheduler(root, manifest, sampled=True)
        if manifest.get("acceptance"):
            acceptance = AcceptanceModel.load(root / manifest["acceptance"])
    else:
        target_dir, drafter_dirs = root, []
    drafter_dirs += [(Path(str(d)).name, resolve_path(d)) for d in drafters]
    target, tokenizer = load_model(target_dir, stage=target_stage, **model_kwargs)
    if getattr(target, "ASSISTANT", False):
        raise LoadError(f"{target_dir} is a Gemma 4 assistant: it drafts for its Gemma 4 "
                        "target (--draft-model), it cannot be the target")
    loaded, paths = {}, {"target": target_dir}
    for name, d in drafter_dirs:
        paths[name] = d
        model, tok = load_model(d, **model_kwargs)
        if getattr(model, "ASSISTANT", False):       # Gemma 4's: drafts from the target
            check_pair(model, target)
        if tok is not None:
            check_same_tokenizer(tokenizer, tok, "target", f"drafter {name}")
        loaded[name] = model
    if tree is None:
        tree = TreeConfig(**{k: v for k, v in settings.items() if k in TreeConfig.__dataclass_fields__})
    return Family(target, tokenizer, loaded, tree, root, paths, scheduler_dir, sampled_dir,
                  acceptance)


def drafters_off(drafters) -> bool:
    """Whether a drafters argument is NO_DRAFTER (alone, or as the one name given)."""
    return drafters == NO_DRAFTER or [str(d) for d in drafters] == [NO_DRAFTER]


def bundle_drafters(root: Path, manifest: Optional[dict] = None) -> list[tuple[str, Path]]:
    """(name, directory) of each drafter a bundle's manifest (read unless given) names; none
    for a plain model directory. Read before anything loads: what a run will draft with."""
    if manifest is None:
        if not (Path(root) / "treegraft.json").exists():
            return []
        manifest = family_manifest(root)
    return [(name, Path(root) / rel) for name, rel in manifest.get("drafters", {}).items()]


def scheduler_entry(sampled: bool) -> str:
    """The manifest key (and the bundle directory) of the greedy or the sampled scheduler."""
    return "scheduler_sampled" if sampled else "scheduler"


def bundle_scheduler(bundle: Path, manifest: Optional[dict] = None,
                     sampled: bool = False) -> Optional[Path]:
    """The calibrated scheduler artifact (greedy, or sampled) a bundle's manifest names (read
    unless given), or None."""
    bundle = Path(bundle)
    if manifest is None:
        if not (bundle / "treegraft.json").exists():
            return None
        manifest = family_manifest(bundle)
    rel = manifest.get(scheduler_entry(sampled))
    return bundle / rel if rel else None


def save_tree_settings(bundle: Path, tree: TreeConfig) -> None:
    """Record calibrated tree settings in a bundle's treegraft.json (written atomically)."""
    update_manifest(bundle, tree=asdict(tree))


def update_manifest(bundle: Path, **entries) -> None:
    """Set top-level entries of a bundle's treegraft.json (written atomically)."""
    manifest_file = Path(bundle) / "treegraft.json"
    if not manifest_file.exists():
        raise LoadError(f"{bundle} is not a bundle (no treegraft.json)")
    manifest = json.loads(manifest_file.read_text())
    manifest.update(entries)
    tmp = manifest_file.with_suffix(".tmp")
    tmp.write_text(json.dumps(manifest, indent=2))
    tmp.replace(manifest_file)


def install_scheduler(bundle: Path, artifact: Path, sampled: bool) -> Path:
    """Copy a calibrated scheduler artifact into a bundle (scheduler/ or scheduler-sampled/)
    and name it in the manifest. Copied beside its destination first, then renamed over it:
    an interrupted install leaves the old artifact whole."""
    entry = scheduler_entry(sampled)
    dest = Path(bundle) / entry.replace("_", "-")
    tmp = dest.with_name(f"{dest.name}.tmp")
    shutil.rmtree(tmp, ignore_errors=True)
    shutil.copytree(artifact, tmp)
    shutil.rmtree(dest, ignore_errors=True)
    tmp.replace(dest)
    update_manifest(bundle, **{entry: dest.name})
    return dest


def store_acceptance(bundle: Path, regime: str, report: dict) -> Path:
    """Merge one regime's fitted acceptance weights into a bundle's acceptance.json (the
    other regimes' kept) and name it in the manifest."""
    out = Path(bundle) / "acceptance.json"
    stored = json.loads(out.read_text()) if out.exists() else {}
    reports = {r: stored[r] for r in REGIMES if r in stored and r != regime}
    reports[regime] = report
    save_acceptance(out, reports, {})
    update_manifest(bundle, acceptance=out.name)
    return out
