"""Where the bundled `tg-tiny` fixture family is installed, what its manifest says, and how a
run on it says that it is a test model."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Optional, Union

FIXTURE_ROOT = Path(__file__).parent / "fixtures"
REAL_MODEL = "mlx-community/Qwen3-8B-4bit"    # the README's first real model


def fixture_path(name: str = "tg-tiny") -> Path:
    """Installed directory of a bundled model family (target/, drafters/<name>/, treegraft.json)."""
    path = FIXTURE_ROOT / name
    if not (path / "treegraft.json").exists():
        raise FileNotFoundError(f"bundled family {name!r} is not installed at {path}")
    return path


def family_manifest(path: Path) -> dict:
    """The family manifest: roles and the relative directory of each model."""
    return json.loads((Path(path) / "treegraft.json").read_text())


def bundled_model_note(path: Optional[Union[str, Path]], command: str) -> Optional[str]:
    """For a model inside a bundled family: one line saying it is a small test model (its
    text is noise, which a new user could not tell from a broken install) and the `treegraft
    <command>` that runs a real one; None for any other model."""
    if path is None:
        return None
    try:
        name = Path(path).resolve().relative_to(FIXTURE_ROOT.resolve()).parts[0]
    except (ValueError, IndexError):
        return None
    return (f"{name} is a small test model bundled with treegraft: it writes noise, not "
            f"answers; a real model: treegraft {command} --model {REAL_MODEL}")
