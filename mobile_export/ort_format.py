"""ONNX -> ORT format for ORT-mobile runtimes, and the ``required_operators.config`` of a reduced build.

Conversion follows ``python -m onnxruntime.tools.convert_onnx_models_to_ort`` with its
``Runtime`` optimization style, the one onnxruntime recommends where NNAPI or CoreML may run
the model: the file keeps standard ONNX operators after basic optimizations (constant folding,
so a fixed batch folds the shape arithmetic away), and the extended optimizations (QDQ -> QLinear
fusions, Conv + activation fusions) are saved alongside and applied at load time to the nodes the
CPU execution provider ends up running. The ``Fixed`` style would bake ``com.microsoft`` fused
operators into the file, which NNAPI and CoreML cannot take. On the CPU both styles run at the same
speed (measured: 72-81 us per image either way for the tiny test model).

The operator config lists what the ``.ort`` files need with their runtime optimizations applied
and not applied (as the onnxruntime tool does), for ``build.sh --minimal_build extended
--include_ops_by_config required_operators.config``.
"""

from __future__ import annotations

import logging
import tempfile
from pathlib import Path

CONFIG_NAME = "required_operators.config"


def _session_options(out_path: Path, runtime_optimizations: str, target_platform: str):
    import onnxruntime as ort

    so = ort.SessionOptions()
    so.graph_optimization_level = ort.GraphOptimizationLevel.ORT_ENABLE_ALL
    so.optimized_model_filepath = str(out_path)
    so.log_severity_level = 3
    so.add_session_config_entry("session.save_model_format", "ORT")
    so.add_session_config_entry("optimization.minimal_build_optimizations", runtime_optimizations)
    # int8 QDQ kept as int8 kernels on ARM, as the onnxruntime tool does for --target_platform arm
    so.add_session_config_entry("session.qdqisint8allowed", "1" if target_platform == "arm" else "0")
    return so


def _convert(onnx_path: Path, out_path: Path, runtime_optimizations: str, target_platform: str) -> Path:
    import onnxruntime as ort

    so = _session_options(out_path, runtime_optimizations, target_platform)
    disabled = [] if target_platform == "amd64" else ["NchwcTransformer"]  # x86-only layout
    ort.InferenceSession(
        str(onnx_path), sess_options=so, providers=["CPUExecutionProvider"], disabled_optimizers=disabled
    )
    if not out_path.is_file():
        raise RuntimeError(f"onnxruntime did not write {out_path}")
    return out_path


def convert_to_ort(onnx_path: str | Path, ort_path: str | Path, target_platform: str = "arm") -> Path:
    """Save ``onnx_path`` as an ORT-format model at ``ort_path`` (``Runtime`` optimization style)."""
    return _convert(Path(onnx_path), Path(ort_path), "save", target_platform)


def write_required_operators(config_path: str | Path, pairs: list[tuple[Path, Path]]) -> dict[str, object]:
    """Write the reduced-build operator config for the ``(onnx, ort)`` pairs; return its path and operators.

    The operators are those of each ``.ort`` file as saved and with its runtime optimizations
    applied (a second, temporary conversion), collected by onnxruntime's own
    ``create_config_from_models``; its format is ``domain;opset;Op1,Op2`` (see
    ``onnxruntime.tools.reduced_build_config_parser``). The header names the ``.ort`` files
    instead of the temporary paths the tool would write.
    """
    from onnxruntime.tools.ort_format_model import create_config_from_models
    from onnxruntime.tools.reduced_build_config_parser import parse_config

    logging.getLogger("ort_format_model.utils").setLevel(logging.WARNING)  # its "Created config in <tmp>" line
    path = Path(config_path)
    with tempfile.TemporaryDirectory(prefix="mobile_export_ops_") as tmp:
        files = []
        for i, (onnx_path, ort_path) in enumerate(pairs):
            files += [Path(ort_path), _convert(Path(onnx_path), Path(tmp) / f"{i}.applied.ort", "apply", "arm")]
        raw = Path(tmp) / CONFIG_NAME
        create_config_from_models(files, raw, enable_type_reduction=False)
        body = [line for line in raw.read_text(encoding="utf-8").splitlines() if line and not line.startswith("#")]
    names = ", ".join(Path(o).name for _, o in pairs)
    header = [
        f"# operators needed by {names} (as saved and with their runtime optimizations applied)",
        "# reduced build: onnxruntime/build.sh --minimal_build extended --include_ops_by_config <this file>",
    ]
    path.write_text("\n".join(header + body) + "\n", encoding="utf-8")
    required, _ = parse_config(str(path))
    ops = {domain: sorted({op for by_opset in required[domain].values() for op in by_opset}) for domain in required}
    return {"path": path.name, "models": [Path(o).name for _, o in pairs], "operators": ops}
