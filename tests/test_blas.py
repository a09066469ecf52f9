"""The system OpenBLAS preload: which file it picks, when it stands aside, and that a fresh
`import treegraft_mlx` (no LD_PRELOAD) really puts MLX on it."""

import ctypes
import os
import subprocess
import sys
from pathlib import Path

import pytest

from treegraft_mlx import blas

DEBIAN_OPENBLAS = Path("/usr/lib/x86_64-linux-gnu/openblas-pthread/libblas.so.3")


def touch(path: Path) -> Path:
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_bytes(b"")
    return path


def test_finds_pthread_openblas_first(tmp_path):
    pthread = touch(tmp_path / "x86_64-linux-gnu/openblas-pthread/libblas.so.3")
    (tmp_path / "x86_64-linux-gnu/libblas.so.3").symlink_to(pthread)
    assert blas.find_openblas("x86_64", str(tmp_path)) == str(pthread)


def test_finds_the_machines_multiarch_dir(tmp_path):
    arm = touch(tmp_path / "aarch64-linux-gnu/openblas-pthread/libblas.so.3")
    touch(tmp_path / "x86_64-linux-gnu/openblas-pthread/libblas.so.3")
    assert blas.find_openblas("aarch64", str(tmp_path)) == str(arm)


def test_generic_libblas_only_when_it_resolves_to_openblas(tmp_path):
    generic = tmp_path / "x86_64-linux-gnu/libblas.so.3"
    generic.parent.mkdir(parents=True)
    generic.symlink_to(touch(tmp_path / "x86_64-linux-gnu/blas/libblas.so.3"))  # reference BLAS
    assert blas.find_openblas("x86_64", str(tmp_path)) is None
    generic.unlink()
    generic.symlink_to(touch(tmp_path / "x86_64-linux-gnu/openblas-openmp/libblas.so.3"))
    assert blas.find_openblas("x86_64", str(tmp_path)) == str(generic)


def test_no_library_no_path(tmp_path):
    assert blas.find_openblas("x86_64", str(tmp_path)) is None


@pytest.fixture
def loads(monkeypatch) -> list:
    """A Linux process with OpenBLAS at a fake path, mlx.core not yet imported, the preload
    enabled; the CDLL calls it would make, recorded instead of made."""
    calls: list = []
    monkeypatch.setattr(sys, "platform", "linux")
    monkeypatch.delitem(sys.modules, "mlx.core", raising=False)
    monkeypatch.delenv(blas.DISABLE_ENV, raising=False)
    monkeypatch.setattr(blas, "find_openblas", lambda: "/fake/libblas.so.3")
    monkeypatch.setattr(ctypes, "CDLL", lambda path, mode: calls.append((path, mode)))
    return calls


def test_loads_globally_before_mlx(loads):
    assert blas.preload_openblas() == "/fake/libblas.so.3"
    assert loads == [("/fake/libblas.so.3", ctypes.RTLD_GLOBAL)]


def test_too_late_once_mlx_core_is_imported(loads, monkeypatch):
    monkeypatch.setitem(sys.modules, "mlx.core", object())
    assert blas.preload_openblas() is None and loads == []


def test_disabled_by_env(loads, monkeypatch):
    monkeypatch.setenv(blas.DISABLE_ENV, "1")
    assert blas.preload_openblas() is None and loads == []


def test_linux_only(loads, monkeypatch):
    monkeypatch.setattr(sys, "platform", "darwin")
    assert blas.preload_openblas() is None and loads == []


def test_nothing_to_load(loads, monkeypatch):
    monkeypatch.setattr(blas, "find_openblas", lambda: None)
    assert blas.preload_openblas() is None and loads == []


def test_load_failure_is_silent(loads, monkeypatch):
    def fail(path: str, mode: int) -> None:
        raise OSError("wrong ELF class")

    monkeypatch.setattr(ctypes, "CDLL", fail)
    assert blas.preload_openblas() is None


PROBE = """
import warnings
{first}
from treegraft_mlx import device
with warnings.catch_warnings(record=True) as caught:
    warnings.simplefilter("always")
    device.warn_if_slow_blas()
print(device.blas_library(), len(caught))
"""


@pytest.mark.skipif(not DEBIAN_OPENBLAS.is_file(), reason="libopenblas0-pthread not installed")
@pytest.mark.parametrize("first, fast",
                         [("import treegraft_mlx", True), ("import mlx.core", False)])
def test_fresh_interpreter_without_ld_preload(first, fast):
    """Imported first, treegraft_mlx puts MLX on OpenBLAS and stays quiet; after mlx.core it is
    too late and warn_if_slow_blas says so."""
    env = {k: v for k, v in os.environ.items() if k not in ("LD_PRELOAD", blas.DISABLE_ENV)}
    out = subprocess.run([sys.executable, "-c", PROBE.format(first=first)], env=env,
                         capture_output=True, text=True, check=True).stdout.split()
    lib, warned = out[-2], int(out[-1])
    assert ("openblas" in lib) == fast and warned == (0 if fast else 1)
