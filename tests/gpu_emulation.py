"""Runs GPU kernel bodies, as written for `mx.fast.metal_kernel` / `mx.fast.cuda_kernel`, on the CPU.

`EmulatedKernel` takes the same arguments as MLX's kernel objects and builds the signature the
way MLX does (input types from the arrays' dtypes; `<name>_shape` / `_strides` / `_ndim` where
the body names them; the Metal attribute variables the body names; CUDA template arguments as
`constexpr` / `using` lines in the body). `tests/shim/` supplies the language: the Metal or CUDA
shim, lockstep threads (`lockstep.h`: every thread a fiber, SIMD collectives and barriers with
real semantics) and a driver with guard pages around every buffer (`driver.h`). Each
instantiation compiles once into a small program, cached by content, that runs in a child
process: a kernel that reads out of bounds fails its test, not the test run.
"""

from __future__ import annotations

import hashlib
import os
import signal
import subprocess
import tempfile
from dataclasses import dataclass
from pathlib import Path
from typing import Sequence

import numpy as np

SHIM = Path(__file__).parent / "shim"
COMPILER = ["g++", "-std=c++17", "-O1", "-U_FORTIFY_SOURCE", "-fno-strict-aliasing",
            "-Wno-attributes", f"-I{SHIM}"]


@dataclass(frozen=True)
class DType:
    name: str
    metal: str  # the type name MLX writes into a Metal signature
    cuda: str  # ... into a CUDA signature
    storage: type  # numpy storage (bfloat16 is kept as its uint16 bits)


DTYPES = {d.name: d for d in [
    DType("float32", "float", "float", np.float32),
    DType("float16", "float16_t", "__half", np.float16),
    DType("bfloat16", "bfloat16_t", "__nv_bfloat16", np.uint16),
    DType("uint32", "uint32_t", "uint32_t", np.uint32),
    DType("int32", "int32_t", "int32_t", np.int32),
]}

METAL_ATTRIBUTES = {  # the attribute variables MLX passes when a body names them, with types
    "thread_index_in_simdgroup": "uint", "simdgroup_index_in_threadgroup": "uint",
    "thread_index_in_threadgroup": "uint", "thread_position_in_threadgroup": "uint3",
    "threadgroup_position_in_grid": "uint3", "thread_position_in_grid": "uint3",
    "threads_per_threadgroup": "uint3", "threadgroups_per_grid": "uint3",
    "threads_per_grid": "uint3", "simdgroups_per_threadgroup": "uint",
    "threads_per_simdgroup": "uint", "thread_execution_width": "uint",
}


class EmulationError(RuntimeError):
    """The emulated kernel failed: a lockstep violation, a bad access, or a compile error."""


@dataclass
class Tensor:
    """An array as a kernel sees it: numpy storage (any strides) and its dtype name."""

    data: np.ndarray
    dtype: str

    @classmethod
    def of(cls, values: np.ndarray, dtype: str) -> "Tensor":
        """Rounds float values to dtype (round-to-nearest-even, as the GPU casts)."""
        if dtype == "bfloat16":
            bits = np.ascontiguousarray(values, dtype=np.float32).view(np.uint32)
            bits = (bits + 0x7FFF + ((bits >> 16) & 1)) >> 16
            return cls(bits.astype(np.uint16), dtype)
        return cls(np.asarray(values).astype(DTYPES[dtype].storage), dtype)

    def values(self) -> np.ndarray:
        """Float32 values (bfloat16 widened exactly)."""
        if self.dtype == "bfloat16":
            return (self.data.astype(np.uint32) << 16).view(np.float32)
        return self.data.astype(np.float32)


def dtype_name(dtype) -> str:
    """'float16' from an mx.Dtype, a numpy dtype or a name."""
    if isinstance(dtype, str):
        return dtype
    text = str(dtype)
    if text.startswith("mlx.core."):
        return text.removeprefix("mlx.core.")
    return np.dtype(dtype).name


def as_tensor(x) -> Tensor:
    if isinstance(x, Tensor):
        return x
    if isinstance(x, np.ndarray):
        return Tensor(x, dtype_name(x.dtype))
    import mlx.core as mx  # an mx.array, as kernels.py passes them: keep its strides
    name = dtype_name(x.dtype)
    x = x.view(mx.uint16) if name == "bfloat16" else x
    mx.eval(x)
    return Tensor(np.asarray(memoryview(x)), name)


def cache_dir() -> Path:
    default = Path(tempfile.gettempdir()) / f"treegraft-emulator-{os.getuid()}"
    path = Path(os.environ.get("TREEGRAFT_EMULATOR_CACHE", default))
    path.mkdir(parents=True, exist_ok=True)
    return path


def shim_digest() -> str:
    h = hashlib.sha256(" ".join(COMPILER).encode())
    for p in sorted(SHIM.glob("*.h")):
        h.update(p.read_bytes())
    return h.hexdigest()


def template_value(value, language: str) -> tuple[str, str]:
    """(declaration kind, value as written) of one template argument."""
    if isinstance(value, bool):
        return "bool", "true" if value else "false"
    if isinstance(value, int):
        return "int", str(value)
    d = DTYPES[dtype_name(value)]
    return "typename", d.metal if language == "metal" else d.cuda


class EmulatedKernel:
    """Drop-in for `mx.fast.metal_kernel(...)` / `mx.fast.cuda_kernel(...)` that runs on the CPU."""

    def __init__(self, language: str, name: str, input_names: Sequence[str],
                 output_names: Sequence[str], source: str, header: str = "",
                 ensure_row_contiguous: bool = True):
        if language not in ("metal", "cuda"):
            raise ValueError(f"language must be 'metal' or 'cuda', not {language!r}")
        self.language, self.name = language, name
        self.input_names, self.output_names = list(input_names), list(output_names)
        self.source, self.header = source, header
        self.ensure_row_contiguous = ensure_row_contiguous

    # -- the translation unit, as MLX would write it ------------------------------------

    def _shape_info(self, name: str) -> tuple[bool, bool, bool]:
        return tuple(f"{name}_{part}" in self.source for part in ("shape", "strides", "ndim"))

    def _params(self, in_dtypes: Sequence[str], in_ndims: Sequence[int],
                out_dtypes: Sequence[str]) -> list[tuple[str, str, str]]:
        """(declaration, argument expression) per parameter, in MLX's order."""
        metal = self.language == "metal"
        params = []
        for i, (name, dt, ndim) in enumerate(zip(self.input_names, in_dtypes, in_ndims)):
            t = DTYPES[dt].metal if metal else DTYPES[dt].cuda
            if ndim == 0:
                params.append((f"const {'constant ' if metal else ''}{t}& {name}",
                               f"*static_cast<const {t}*>(b[{i}].data)"))
                continue
            params.append((f"const {'device ' if metal else ''}{t}* {name}",
                           f"static_cast<const {t}*>(b[{i}].data)"))
            shape, strides, nd = self._shape_info(name)
            if shape:
                params.append((f"const constant int* {name}_shape", f"b[{i}].shape.data()")
                              if metal else (f"const __grid_constant__ Shape {name}_shape",
                                             f"shape_of(b[{i}])"))
            if strides:
                params.append((f"const constant int64_t* {name}_strides", f"b[{i}].strides.data()")
                              if metal else (f"const __grid_constant__ Strides {name}_strides",
                                             f"strides_of(b[{i}])"))
            if nd:
                params.append((f"const {'constant ' if metal else ''}int{'&' if metal else ''} "
                               f"{name}_ndim", f"int(b[{i}].shape.size())"))
        for j, (name, dt) in enumerate(zip(self.output_names, out_dtypes)):
            t = DTYPES[dt].metal if metal else DTYPES[dt].cuda
            params.append((f"{'device ' if metal else ''}{t}* {name}",
                           f"static_cast<{t}*>(b[{len(self.input_names) + j}].data)"))
        if metal:
            for attr, t in METAL_ATTRIBUTES.items():
                if attr in self.source:
                    params.append((f"{t} {attr}", f"metal_attributes::{attr}(lane)"))
        return params

    def kernel_definition(self, template: Sequence[tuple[str, object]], in_dtypes: Sequence[str],
                          in_ndims: Sequence[int], out_dtypes: Sequence[str]) -> tuple[str, str]:
        """(header + kernel function as MLX writes them, the name that calls this instantiation)."""
        params = self._params(in_dtypes, in_ndims, out_dtypes)
        decls = ",\n    ".join(p for p, _ in params)
        targs = [(n, *template_value(v, self.language)) for n, v in template]
        fn = f"custom_kernel_{self.name}"
        if self.language == "metal":
            if not targs:
                return f"{self.header}\n[[kernel]] void {fn}(\n    {decls}) {{\n{self.source}\n}}\n", fn
            head = "template <" + ", ".join(f"{k} {n}" for n, k, _ in targs) + ">\n"
            return (f"{self.header}\n{head}[[kernel]] void {fn}(\n    {decls}) {{\n{self.source}\n}}\n",
                    fn + "<" + ", ".join(v for _, _, v in targs) + ">")
        fn += "".join("_" + "".join(c if c.isalnum() else "_" for c in v) for _, _, v in targs)
        consts = "".join(f"  using {n} = {v};\n" if k == "typename" else
                         f"  constexpr {k} {n} = {v};\n" for n, k, v in targs)
        return (f"{self.header}\nnamespace mlx::core::cu {{\n__global__ void {fn}(\n    {decls}) {{\n"
                f"{consts}\n{self.source}\n}}\n}}  // namespace mlx::core::cu\n",
                f"mlx::core::cu::{fn}")

    def translation_unit(self, template: Sequence[tuple[str, object]], in_dtypes: Sequence[str],
                         in_ndims: Sequence[int], out_dtypes: Sequence[str]) -> str:
        """The kernel inside the shim, with the launcher the driver calls for every thread."""
        definition, call = self.kernel_definition(template, in_dtypes, in_ndims, out_dtypes)
        args = ",\n        ".join(a for _, a in self._params(in_dtypes, in_ndims, out_dtypes))
        if self.language == "metal":
            prelude = '#include "driver.h"\n#include "metal_shim.h"\n'
        else:
            prelude = ('#include "driver.h"\n#include "cuda_shim.h"\n'
                       "#define inf std::numeric_limits<float>::infinity()\n"
                       "static Shape shape_of(const driver::Buffer& b) {\n"
                       "  Shape s{};\n"
                       "  for (size_t i = 0; i < b.shape.size(); i++) s.v[i] = b.shape[i];\n"
                       "  return s;\n}\n"
                       "static Strides strides_of(const driver::Buffer& b) {\n"
                       "  Strides s{};\n"
                       "  for (size_t i = 0; i < b.strides.size(); i++) s.v[i] = b.strides[i];\n"
                       "  return s;\n}\n")
        return (f"{prelude}\n{definition}\n"
                "void launch_kernel(std::vector<driver::Buffer>& b, lockstep::Dim3 groups,\n"
                "                   lockstep::Dim3 group_size) {\n"
                "  auto each_thread = [&](const lockstep::Lane& lane) {\n"
                "    (void)lane;\n"
                f"    {call}(\n        {args});\n"
                "  };\n"
                "  lockstep::run(groups, group_size, each_thread);\n}\n")

    # -- compile and run -------------------------------------------------------------------

    def build(self, template: Sequence[tuple[str, object]], in_dtypes: Sequence[str],
              in_ndims: Sequence[int], out_dtypes: Sequence[str]) -> Path:
        """The compiled program for one instantiation (compiled once per content, cached)."""
        unit = self.translation_unit(template, in_dtypes, in_ndims, out_dtypes)
        key = hashlib.sha256((shim_digest() + unit).encode()).hexdigest()[:24]
        exe = cache_dir() / f"{self.language}-{self.name}-{key}"
        if exe.exists():
            return exe
        src = exe.with_suffix(".cpp")
        src.write_text(unit)
        tmp = exe.with_name(exe.name + f".{os.getpid()}.tmp")
        r = subprocess.run(COMPILER + ["-o", str(tmp), str(src)], capture_output=True, text=True)
        if r.returncode != 0:
            raise EmulationError(f"{self.language} kernel {self.name} does not compile:\n{r.stderr}")
        tmp.replace(exe)
        return exe

    def launch_shape(self, grid, threadgroup) -> tuple[tuple[int, ...], tuple[int, ...]]:
        """(threadgroups, threads per threadgroup) as MLX dispatches `grid` (in threads)."""
        if self.language == "cuda":  # blocks of exactly `threadgroup`, enough to cover the grid
            return tuple(-(-g // t) for g, t in zip(grid, threadgroup)), tuple(threadgroup)
        size = tuple(min(t, g) for g, t in zip(grid, threadgroup))  # Metal: dispatch_threads
        if any(g % s for g, s in zip(grid, size)):
            raise EmulationError("non-uniform Metal threadgroups are not emulated")
        return tuple(g // s for g, s in zip(grid, size)), size

    def __call__(self, *, inputs, grid, threadgroup, output_shapes, output_dtypes,
                 template=(), init_value=None, verbose=False, stream=None):
        if init_value is not None:
            raise EmulationError("init_value is not emulated")
        from_mlx = any(not isinstance(x, (np.ndarray, Tensor)) for x in inputs)
        tensors = [as_tensor(x) for x in inputs]
        if self.ensure_row_contiguous:
            tensors = [Tensor(np.ascontiguousarray(t.data), t.dtype) for t in tensors]
        out_dtypes = [dtype_name(d) for d in output_dtypes]
        exe = self.build(template, [t.dtype for t in tensors], [t.data.ndim for t in tensors],
                         out_dtypes)
        groups, size = self.launch_shape(grid, threadgroup)
        with tempfile.TemporaryDirectory(prefix="launch-", dir=cache_dir()) as tmp:
            lines = [f"groups {' '.join(map(str, groups))}",
                     f"group_size {' '.join(map(str, size))}"]
            for i, t in enumerate(tensors):
                lines.append(write_input(Path(tmp) / f"in{i}", t.data))
            outs = []
            for j, (shape, dt) in enumerate(zip(output_shapes, out_dtypes)):
                out = np.empty(tuple(shape), DTYPES[dt].storage)
                path = Path(tmp) / f"out{j}"
                strides = " ".join(str(s // out.itemsize) for s in out.strides)
                lines.append(f"out {path} {out.nbytes} {out.ndim} "
                             f"{' '.join(map(str, out.shape))} {strides}")
                outs.append((path, out, dt))
            launch = Path(tmp) / "launch.txt"
            launch.write_text("\n".join(lines) + "\n")
            r = subprocess.run([str(exe), str(launch)], capture_output=True, text=True,
                               timeout=900)
            if r.returncode != 0:
                cause = (f"killed by {signal.Signals(-r.returncode).name} (an access outside "
                         "its buffers, if SIGSEGV)" if r.returncode < 0 else r.stderr.strip())
                raise EmulationError(f"{self.language} kernel {self.name}: {cause}")
            results = [Tensor(np.fromfile(p, o.dtype).reshape(o.shape), dt) for p, o, dt in outs]
        if from_mlx:
            return [to_mlx(t) for t in results]
        return results


def write_input(path: Path, data: np.ndarray) -> str:
    """Writes the memory span a (possibly strided) view covers; returns its launch line."""
    if any(s < 0 for s in data.strides):
        raise EmulationError("negative strides are not emulated")
    itemsize = data.itemsize
    span = itemsize + sum((n - 1) * s for n, s in zip(data.shape, data.strides)) if data.size else 0
    base = np.lib.stride_tricks.as_strided(data, shape=(span // itemsize,), strides=(itemsize,))
    np.ascontiguousarray(base).tofile(path)
    strides = " ".join(str(s // itemsize) for s in data.strides)
    return f"in {path} {span} {data.ndim} {' '.join(map(str, data.shape))} {strides}"


def to_mlx(t: Tensor):
    import mlx.core as mx
    if t.dtype == "bfloat16":
        return mx.array(t.data).view(mx.bfloat16)
    return mx.array(t.data)

