"""The browser chat page's files (treegraft_mlx/web), read once from the package, and the
headers they are served with: their content types and a strict Content-Security-Policy."""

from __future__ import annotations

from dataclasses import dataclass
from importlib.resources import files
from typing import TYPE_CHECKING, Iterator

if TYPE_CHECKING:
    from importlib.resources.abc import Traversable

CONTENT_TYPES = {".html": "text/html; charset=utf-8", ".js": "text/javascript; charset=utf-8",
                 ".css": "text/css; charset=utf-8", ".png": "image/png"}
TEXT = "text/plain; charset=utf-8"     # licence files and anything else without a known type

# Defence in depth behind the page's sanitising of model output: the page runs only its own
# scripts and styles, talks only to this server, shows images only from it or inline data,
# and cannot be framed or post forms anywhere.
CSP = ("default-src 'none'; script-src 'self'; style-src 'self'; img-src 'self' data:; "
       "connect-src 'self'; base-uri 'none'; form-action 'none'; frame-ancestors 'none'")


@dataclass(frozen=True)
class Asset:
    body: bytes
    content_type: str

    def headers(self) -> dict[str, str]:
        return {"Content-Type": self.content_type, "Content-Security-Policy": CSP,
                "X-Content-Type-Options": "nosniff", "Referrer-Policy": "no-referrer",
                "Cache-Control": "no-cache"}


def load_assets() -> dict[str, Asset]:
    """Every file of the page by the path it is served at: `/` is index.html, every file
    (index.html too) is also at /static/<its path under web/>. Nothing else is served, so
    no request path can reach a file outside these."""
    assets: dict[str, Asset] = {}
    for path, node in _walk(files("treegraft_mlx") / "web", ""):
        suffix = path[path.rfind("."):] if "." in path.rsplit("/", 1)[-1] else ""
        assets["/static/" + path] = Asset(node.read_bytes(), CONTENT_TYPES.get(suffix, TEXT))
    assets["/"] = assets["/static/index.html"]
    return assets


def _walk(node: "Traversable", prefix: str) -> Iterator[tuple[str, "Traversable"]]:
    for child in sorted(node.iterdir(), key=lambda c: c.name):
        if child.is_dir():
            yield from _walk(child, f"{prefix}{child.name}/")
        else:
            yield prefix + child.name, child
