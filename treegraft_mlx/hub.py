"""Where models come from: a local directory, or a Hub repo id downloaded on first use.

As `mlx_lm` does, through `huggingface_hub`: only the files a model needs, resumed where an
interrupted download stopped, with its progress bars, honouring HF_HUB_OFFLINE, HF_HOME and
HF_ENDPOINT. Every failure becomes a LoadError that names the repo and what to do.
"""

from __future__ import annotations

import os
from pathlib import Path
from typing import Optional, Union

from .errors import LoadError

# config, generation config, tokenizer files and chat templates, safetensors and their index
ALLOW_PATTERNS = ["*.json", "*.safetensors", "tokenizer.model", "*.tiktoken", "*.txt", "*.jinja"]


def is_repo_id(text: str) -> bool:
    """`owner/name`, as the Hub spells repos: not a path that exists or starts like one."""
    return (text.count("/") == 1 and not text.startswith((".", "/", "~"))
            and all(text.split("/")) and not Path(text).expanduser().exists())


def resolve_path(path_or_repo: Union[str, Path], revision: Optional[str] = None) -> Path:
    """A local model directory, or a repo id's snapshot (downloaded on first use)."""
    path = Path(path_or_repo).expanduser()
    if path.is_dir():
        return path
    if path.exists():
        raise LoadError(f"{path} is a file; expected a model directory")
    if is_repo_id(str(path_or_repo)):
        return fetch(str(path_or_repo), revision)
    raise LoadError(f"model path {str(path_or_repo)!r} does not exist (nor is it a Hub repo id, "
                    "owner/name)")


def fetch(repo: str, revision: Optional[str] = None) -> Path:
    """The local snapshot of `repo` at `revision` (default: main), downloaded unless the cache
    already holds it; offline (HF_HUB_OFFLINE=1) only the cache is read."""
    from huggingface_hub import constants, snapshot_download
    from huggingface_hub.errors import (GatedRepoError, LocalEntryNotFoundError,
                                        RepositoryNotFoundError, RevisionNotFoundError)

    where = f"{repo!r}" + (f" at revision {revision!r}" if revision else "")
    try:
        return Path(snapshot_download(repo, revision=revision, allow_patterns=ALLOW_PATTERNS))
    except GatedRepoError:
        raise LoadError(f"{where} is gated on the Hub: accept its terms on its page, then log in "
                        "(`hf auth login`, or set HF_TOKEN) and retry") from None
    except RevisionNotFoundError:
        raise LoadError(f"{repo!r} has no revision {revision!r} on the Hub") from None
    except RepositoryNotFoundError:
        raise LoadError(f"{where} was not found on the Hub ({constants.ENDPOINT}): check the "
                        "name; a private repo needs a login (`hf auth login` or HF_TOKEN)") from None
    except LocalEntryNotFoundError:
        if constants.HF_HUB_OFFLINE:
            raise LoadError(f"{where} is not in the local cache ({constants.HF_HUB_CACHE}) and "
                            "HF_HUB_OFFLINE is set: unset it to download, or run `treegraft pull "
                            f"{repo}` where the Hub can be reached") from None
        raise LoadError(f"{where} is not in the local cache and the Hub ({constants.ENDPOINT}) "
                        "cannot be reached: check the connection or HF_ENDPOINT") from None
    except OSError as e:
        raise LoadError(f"{where}: the download failed ({e}); run again to resume it") from None


def cached_repos() -> list[tuple[str, Path]]:
    """Every model repo in the local cache with a snapshot that has a config.json: (id, path)
    of its newest snapshot."""
    from huggingface_hub import constants

    root = Path(constants.HF_HUB_CACHE)
    out = []
    for repo_dir in sorted(root.glob("models--*")) if root.is_dir() else []:
        snapshots = [s for s in (repo_dir / "snapshots").glob("*") if (s / "config.json").exists()]
        if snapshots:
            newest = max(snapshots, key=lambda s: s.stat().st_mtime)
            out.append((repo_dir.name[len("models--"):].replace("--", "/", 1), newest))
    return out


def treegraft_cache() -> Path:
    """Where treegraft keeps what it derives from models (measured timings, quantized copies):
    TREEGRAFT_CACHE, or ~/.cache/treegraft_mlx."""
    return Path(os.environ.get("TREEGRAFT_CACHE") or Path.home() / ".cache" / "treegraft_mlx")
