"""Exports the learned scheduler MLP to a Core ML package, for macOS apps that embed it.

The package is an ML Program (fp32, macOS 13+) built op by op with the MIL builder, so it
needs no torch and mirrors `scheduler.mlp_forward` exactly: one input "features" of shape
(1, 17) and one output "value" of shape (1, 1). Core ML prediction only runs on macOS, so
`numpy_predict` checks a saved package anywhere: it reads the package back from disk (spec
plus weight blob) and interprets the stored op sequence in numpy, never touching the
artifact it came from.
"""

from __future__ import annotations

import json
import os
import shutil
import tempfile
from pathlib import Path

import numpy as np

from .scheduler import FEATURE_NAMES, HIDDEN, SchedulerMLP, load_artifact

MIN_TARGET = "macOS13"        # first ML Program target whose fp32 ops cover what we emit
META_KEYS = ("format_version", "b0", "t_tgt_ms", "t_mid_ms", "hidden")


def _checked_params(artifact_dir: Path) -> tuple[dict[str, np.ndarray], dict]:
    """The artifact's parameters as float32 numpy, validated before anything is written.

    load_artifact already names missing files and a wrong format; unreadable contents (a
    truncated safetensors, broken JSON) and bad shapes or values are reported here, with the
    artifact's path, instead of surfacing as an opaque error inside coremltools.
    """
    try:
        mlp, meta = load_artifact(artifact_dir)
    except FileNotFoundError:
        raise
    except Exception as e:
        raise ValueError(f"cannot read scheduler artifact {artifact_dir}: {e}") from e
    dims = (len(FEATURE_NAMES), *HIDDEN, 1)
    expected = {"in_mean": (dims[0],), "in_std": (dims[0],), "out_mean": (1,), "out_std": (1,)}
    for i, (a, b) in enumerate(zip(dims[:-1], dims[1:]), start=1):
        expected[f"l{i}.weight"], expected[f"l{i}.bias"] = (b, a), (b,)
    params = {k: np.asarray(mlp.params[k], dtype=np.float32) for k in SchedulerMLP.PARAM_NAMES}
    for k, shape in expected.items():
        if params[k].shape != shape:
            raise ValueError(f"{artifact_dir}: {k} has shape {params[k].shape}, expected {shape}")
        if not np.all(np.isfinite(params[k])):
            raise ValueError(f"{artifact_dir}: {k} has non-finite values")
    if np.any(params["in_std"] == 0):
        raise ValueError(f"{artifact_dir}: in_std has zeros")
    return params, meta


def _build_program(p: dict[str, np.ndarray]):
    """MIL program for mlp_forward; every parameter is a named const in the package."""
    from coremltools import target
    from coremltools.converters.mil import Builder as mb
    from coremltools.converters.mil.mil import types

    def const(name: str, val: np.ndarray):
        return mb.const(val=val.astype(np.float32), name=name)

    # Multiplying by the reciprocal is what coremltools' divide_to_multiply pass makes of a
    # real_div by a const; emitting it directly keeps the stored ops exactly the ones below.
    inv_std = (1.0 / p["in_std"].astype(np.float64)).astype(np.float32)

    @mb.program(input_specs=[mb.TensorSpec(shape=(1, len(FEATURE_NAMES)), dtype=types.fp32)],
                opset_version=getattr(target, MIN_TARGET))
    def prog(features):
        z = mb.sub(x=features, y=const("in_mean", p["in_mean"]), name="centered")
        z = mb.mul(x=z, y=const("in_inv_std", inv_std), name="z")
        for i in (1, 2):
            z = mb.linear(x=z, weight=const(f"l{i}_weight", p[f"l{i}.weight"]),
                          bias=const(f"l{i}_bias", p[f"l{i}.bias"]), name=f"l{i}")
            z = mb.relu(x=z, name=f"h{i}")
        y = mb.linear(x=z, weight=const("l3_weight", p["l3.weight"]),
                      bias=const("l3_bias", p["l3.bias"]), name="l3")
        y = mb.mul(x=y, y=const("out_std", p["out_std"]), name="scaled")
        return mb.add(x=y, y=const("out_mean", p["out_mean"]), name="value")

    return prog


def export_coreml(artifact_dir: Path, out_path: Path) -> Path:
    """Write the artifact's scheduler as `out_path` (an .mlpackage directory); return it.

    The package is built in a temporary directory next to the destination and renamed into
    place, so a failure at any point leaves no partial package (and an existing one intact
    unless the final swap itself fails).
    """
    import coremltools as ct

    artifact_dir, out_path = Path(artifact_dir), Path(out_path)
    if out_path.suffix != ".mlpackage":
        raise ValueError(f"Core ML package path must end in .mlpackage, got {out_path}")
    params, meta = _checked_params(artifact_dir)

    # No graph passes: they would fold identity normalisation away and fuse out_std/out_mean
    # into l3, so the package would no longer hold the artifact's parameters by name. The
    # Core ML compiler on the Mac does its own fusion when the package is compiled.
    model = ct.convert(_build_program(params), convert_to="mlprogram",
                       minimum_deployment_target=getattr(ct.target, MIN_TARGET),
                       compute_precision=ct.precision.FLOAT32,
                       pass_pipeline=ct.PassPipeline.EMPTY)
    model.short_description = ("TreeGraft learned scheduler: predicted value of calling the "
                               "strong drafter for the next tree layer (call iff value > 0 and "
                               "fewer than b0 calls this step)")
    model.input_description["features"] = "float32 (1, 17): " + ", ".join(FEATURE_NAMES)
    model.output_description["value"] = "float32 (1, 1): call-minus-skip value"
    model.user_defined_metadata["features"] = ",".join(meta["features"])
    for key in (k for k in META_KEYS if k in meta):     # Core ML metadata values are strings
        v = meta[key]
        model.user_defined_metadata[key] = ",".join(map(str, v)) if isinstance(v, list) else str(v)
    if "sampling" in meta:      # which decoding it was calibrated for (temp 0: greedy)
        model.user_defined_metadata["sampling"] = json.dumps(meta["sampling"], sort_keys=True)

    out_path.parent.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(prefix=f".{out_path.name}.", dir=out_path.parent))
    try:
        built = tmp / out_path.name
        model.save(str(built))
        if out_path.exists():              # directories cannot be os.replace'd over each other
            os.replace(out_path, tmp / "previous.mlpackage")
        os.replace(built, out_path)
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
    return out_path


def _load_main(package_path: Path):
    """(spec, pymil main function) of a saved package, read from disk without Core ML.

    `skip_model_load` avoids compiling the model (macOS only); the milproto loader rebuilds
    the program from the spec and resolves blob-stored consts from the package's weights dir.
    """
    import coremltools as ct
    from coremltools.converters.mil.frontend.milproto.load import load as milproto_to_pymil

    package_path = Path(package_path)
    if not (package_path / "Manifest.json").exists():
        raise FileNotFoundError(f"{package_path} is not a Core ML package")
    model = ct.models.MLModel(str(package_path), skip_model_load=True)
    spec = model.get_spec()
    prog = milproto_to_pymil(spec, spec.specificationVersion, model.weights_dir)
    return spec, prog.functions["main"]


def read_coreml_consts(package_path: Path) -> dict[str, np.ndarray]:
    """Every const tensor stored in the package, by its MIL name (e.g. "l1_weight")."""
    _, main = _load_main(package_path)
    return {op.outputs[0].name: np.asarray(op.outputs[0].val)
            for op in main.operations if op.op_type == "const"}


def read_coreml_metadata(package_path: Path) -> dict[str, str]:
    """The package's user-defined metadata (features, format_version, b0, ...)."""
    import coremltools as ct

    model = ct.models.MLModel(str(package_path), skip_model_load=True)
    return dict(model.user_defined_metadata)


_NUMPY_OPS = {
    "sub": lambda a: a["x"] - a["y"],
    "mul": lambda a: a["x"] * a["y"],
    "add": lambda a: a["x"] + a["y"],
    "real_div": lambda a: a["x"] / a["y"],
    "relu": lambda a: np.maximum(a["x"], np.float32(0)),
    "linear": lambda a: a["x"] @ a["weight"].T + (a["bias"] if "bias" in a else 0),
}


def numpy_predict(package_path: Path, x: np.ndarray) -> np.ndarray:
    """Evaluate the saved package on (n, 17) features in float32 numpy; returns (n,) values.

    Interprets the stored ops in order, so it checks what a Mac would run: op order, wiring
    and the parameters as written to the package. Rows are evaluated as a batch (every op is
    row-wise), although the package itself takes one row per prediction.
    """
    spec, main = _load_main(package_path)
    (in_name,), (out_name,) = main.inputs, [o.name for o in spec.description.output]
    env: dict[str, np.ndarray] = {in_name: np.asarray(x, dtype=np.float32)}
    for op in main.operations:
        if op.op_type == "const":
            env[op.outputs[0].name] = np.asarray(op.outputs[0].val, dtype=np.float32)
            continue
        if op.op_type not in _NUMPY_OPS:
            raise NotImplementedError(f"numpy_predict has no rule for op {op.op_type!r}")
        args = {k: env[v.name] for k, v in op.inputs.items()}
        env[op.outputs[0].name] = _NUMPY_OPS[op.op_type](args).astype(np.float32)
    return env[out_name][..., 0]
