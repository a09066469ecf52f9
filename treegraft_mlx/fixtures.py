"""Where the bundled `tg-tiny` fixture family is installed, and what its manifest says."""

from __future__ import annotations

import json
from pathlib import Path

FIXTURE_ROOT = Path(__file__).parent / "fixtures"


def fixture_path(name: str = "tg-tiny") -> Path:
    """Installed directory of a bundled model family (target/, drafters/<name>/, treegraft.json)."""
    path = FIXTURE_ROOT / name
    if not (path / "treegraft.json").exists():
        raise FileNotFoundError(f"bundled family {name!r} is not installed at {path}")
    return path


def family_manifest(path: Path) -> dict:
    """The family manifest: roles and the relative directory of each model."""
    return json.loads((Path(path) / "treegraft.json").read_text())
