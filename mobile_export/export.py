"""Export a trained model to ONNX for on-device pseudo-labeling, and verify every artifact.

The exported graph does the whole job of an edge device::

    images (N, C, H, W) uint8, R, G, B (or L) planes, 0..255
      -> float, /255, (x - mean) / std        the dataset's normalization, inside the graph
      -> model -> softmax                     probs (N, K)
      -> max / argmax                         confidence (N,), label (N,) int64
      -> confidence >= thresholds[label]      mask (N,) uint8, 0 or 1

``thresholds`` is a per-class constant of the graph (FedSEAL's class-wise thresholds, or one tau
broadcast to every class): it is traced as a second input and :func:`graph.finalize` makes it a
constant, so ``images`` is the only input. The thresholds, the class names, mean and std, the
input shape and the image rule (layout, channel order, resize), the algorithm, round and a hash
of the run's config ride in the model's metadata; the model's ``model_version`` is the edge
contract's version (:data:`~mobile_export.edge_label.EDGE_FORMAT_VERSION`).

``model.onnx`` / ``model.int8.onnx`` keep a dynamic batch (bulk labeling in Python, int8
calibration); the ``.ort`` files for phones are converted from a copy with the batch fixed
(``batch_size``, default 1), because NNAPI and CoreML take only fixed shapes. Beside them,
``required_operators.config`` lists the operators a reduced onnxruntime build needs.

Every export is verified (see :mod:`mobile_export.verify`) and a failed check fails it:
``onnx.checker`` full check, onnxruntime's mobile usability check (report saved, NNAPI / CoreML
coverage parsed into the report), the edge contract of every file (names, dtypes, batch,
version, the baked-in defaults), parity with torch on real test images (probabilities within
rtol 1e-3 / atol 1e-5, identical labels and masks) for the ``.onnx`` and the ``.ort`` file, and
for the int8 model (static QDQ, per-channel, calibrated on client data, see
:mod:`mobile_export.quantize`) the gates: test accuracy drop at most 1 point and pseudo-label
agreement with the float model at least 98%. Everything lands in ``export_report.json``.

Entry points: :func:`export_run` (a run directory or checkpoint), :func:`export_model` (any
registry model plus its data facts), and the ``fedml-ssfl export`` hooks
:func:`add_export_arguments` / :func:`run_export_from_args`.
"""

from __future__ import annotations

import argparse
import json
import logging
import math
import re
import sys
import tempfile
import time
import warnings
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

import numpy as np
import torch
from torch import nn

from . import graph, ort_format, verify
from .arguments import (  # the command line's defaults, importable without torch (fedml-ssfl builds its parser)
    DEFAULT_CALIBRATION_SAMPLES,
    DEFAULT_OPSET,
    DEFAULT_ORT_BATCH,
    DEFAULT_PARITY_SAMPLES,
    DEFAULT_WEIGHTS,
    MAX_ACC_DROP,
    MIN_AGREEMENT,
    add_export_arguments,
)
from .edge_label import FORMAT_TAG, INPUT_NAMES, OUTPUT_DTYPES, OUTPUT_NAMES, THRESHOLDS, image_rule_metadata
from .verify import Predictions

log = logging.getLogger(__name__)

DEFAULT_THRESHOLD = 0.95
"""tau used when neither the caller, the checkpoint nor the config gives one (FixMatch's 0.95)."""
REPORT_NAME = "export_report.json"


class ExportError(RuntimeError):
    """An export was refused or one of its checks failed; the message says which and why."""


class ExporterFallbackWarning(UserWarning):
    """The dynamo exporter failed and the legacy TorchScript exporter was used instead."""


# ---------------------------------------------------------------------------------------------
# the graph


class EdgeModel(nn.Module):
    """A classifier wrapped with the dataset's normalization in front and the pseudo-label tail behind.

    Parameters
    ----------
    net : nn.Module
        A registry model (normalised float input -> logits), in eval mode.
    mean, std : sequence of float
        Per-channel statistics for inputs scaled to ``[0, 1]`` (``ImageDataset.mean/std``).
    """

    def __init__(self, net: nn.Module, mean, std) -> None:
        super().__init__()
        self.net = net
        self.register_buffer("mean", torch.tensor(list(mean), dtype=torch.float32).view(1, -1, 1, 1))
        self.register_buffer("std", torch.tensor(list(std), dtype=torch.float32).view(1, -1, 1, 1))

    def forward(self, images: torch.Tensor, thresholds: torch.Tensor):
        """uint8 images (N, C, H, W) and thresholds (K,) -> probs, label, confidence, mask (uint8 0/1).

        ``thresholds`` is an argument so that the exporters keep it as a named graph value; the
        exported file holds it as a constant (:func:`graph.finalize`).
        """
        x = images.to(torch.float32) / 255.0  # same order of operations as data.augment.to_float/normalize
        x = (x - self.mean) / self.std
        probs = torch.softmax(self.net(x), dim=1)
        confidence, label = probs.max(dim=1)
        # The tail is written so that NNAPI / CoreML take the backbone and softmax as one partition and
        # leave the whole tail to the CPU: torch.gather (ONNX GatherElements, which neither takes)
        # rather than thresholds[label] (an Unsqueeze they take between two they do not: a 1-node
        # partition), and Where rather than Cast for the uint8 mask, for the same reason. uint8, not
        # bool: onnxruntime's Objective-C / Swift API has no bool tensors.
        one, zero = torch.ones((), dtype=torch.uint8), torch.zeros((), dtype=torch.uint8)
        mask = torch.where(confidence >= torch.gather(thresholds, 0, label), one, zero)
        return probs, label, confidence, mask


@dataclass
class EdgeMetadata:
    """Facts about an exported model that travel inside it (ONNX ``metadata_props``)."""

    class_names: list[str]
    mean: list[float]
    std: list[float]
    in_channels: int
    image_size: int
    thresholds: list[float]
    threshold_source: str = "default"
    algorithm: str = ""
    round: int = -1
    config_hash: str = ""
    model: str = ""
    norm: str = ""
    dataset: str = ""
    weights: str = "global_state"

    @property
    def num_classes(self) -> int:
        return len(self.class_names)

    @property
    def model_version(self) -> str:
        """Identity of the weights: the run's config hash and the round (shared by float and int8)."""
        tail = "" if self.weights == DEFAULT_WEIGHTS else f":{self.weights}"
        return f"{self.config_hash or 'unknown'}:round{self.round}{tail}"

    def props(self, precision: str) -> dict[str, str]:
        """String key/values for ``onnx.helper.set_model_props`` (``input_shape`` with a dynamic batch, ``N``)."""
        return {
            "format": FORMAT_TAG,
            "class_names": json.dumps(self.class_names),
            "num_classes": str(self.num_classes),
            "mean": json.dumps(self.mean),
            "std": json.dumps(self.std),
            "input_shape": json.dumps(["N", self.in_channels, self.image_size, self.image_size]),
            "input_dtype": "uint8",
            **image_rule_metadata(self.in_channels),
            "inputs": ",".join(INPUT_NAMES),
            "outputs": ",".join(OUTPUT_NAMES),
            "output_dtypes": json.dumps(OUTPUT_DTYPES),
            "default_thresholds": json.dumps(self.thresholds),
            "threshold_source": self.threshold_source,
            "algorithm": self.algorithm,
            "round": str(self.round),
            "config_hash": self.config_hash,
            "model_version": self.model_version,
            "model": self.model,
            "norm": self.norm,
            "dataset": self.dataset,
            "weights": self.weights,
            "precision": precision,
        }


def check_thresholds(values, num_classes: int, where: str = "thresholds") -> list[float]:
    """One tau (broadcast to every class) or one value per class, each in [0, 1].

    Raises
    ------
    ExportError
        Wrong length or a value outside [0, 1].
    """
    vals = [float(v) for v in np.asarray(values, dtype=np.float64).reshape(-1)]
    if len(vals) == 1:
        vals = vals * num_classes
    if len(vals) != num_classes:
        raise ExportError(
            f"{where}: got {len(vals)} values for a model with {num_classes} classes; pass one tau "
            f"(broadcast to every class) or exactly {num_classes} values, one per class"
        )
    bad = [v for v in vals if not (math.isfinite(v) and 0.0 <= v <= 1.0)]
    if bad:
        raise ExportError(f"{where}: every threshold must lie in [0, 1]; got {bad[0]}")
    return vals


# ---------------------------------------------------------------------------------------------
# torch -> ONNX


_OP_PATTERNS = (
    re.compile(r"op='([\w.:]+)', overload='(\w+)'"),  # dynamo: No ONNX function found for <OpOverload(...)>
    re.compile(r"target=torch\.ops\.([\w.]+)"),  # dynamo: Error when translating node ...
    re.compile(r"operator '?([\w]+::[\w.]+)'?"),  # legacy: Exporting the operator 'aten::x' ...
    re.compile(r"namespace '?([\w]+::[\w.]+)'?"),  # legacy: unrecognized namespace ns::op
    re.compile(r"\b(aten(?:::|\.)\w+)"),
)


def unsupported_op_name(text: str) -> str | None:
    """The operator an exporter error message complains about, if it names one."""
    for pat in _OP_PATTERNS:
        m = pat.search(text)
        if m:
            return ".".join(g for g in m.groups() if g) if pat.groups > 1 else m.group(1)
    return None


def _first_line(exc: BaseException) -> str:
    for line in str(exc).splitlines():
        line = line.strip()
        if line:
            return f"{type(exc).__name__}: {line}"[:300]
    return type(exc).__name__


def _dynamo_error_text(exc: BaseException) -> str:
    parts, seen = [], set()
    while exc is not None and id(exc) not in seen:
        seen.add(id(exc))
        parts.append(str(exc))
        exc = exc.__cause__ or exc.__context__
    return "\n".join(parts)


def export_onnx(
    module: nn.Module,
    path: str | Path,
    example: tuple[torch.Tensor, torch.Tensor],
    *,
    opset: int = DEFAULT_OPSET,
    dynamo: bool = True,
) -> dict[str, Any]:
    """``torch.onnx.export`` with a dynamic batch axis: dynamo first, legacy as a fallback.

    Returns
    -------
    dict
        ``{"exporter": "dynamo" | "legacy", "opset": int, "fallback_reason": str | None}``.

    Raises
    ------
    ExportError
        Neither exporter could handle the model; names the operator when the error does.
    """
    path = Path(path)
    common = dict(
        input_names=[*INPUT_NAMES, THRESHOLDS],
        output_names=list(OUTPUT_NAMES),
        opset_version=opset,
        external_data=False,
        verbose=False,
    )
    fallback_reason, dynamo_text = None, ""
    if dynamo:
        try:
            batch = torch.export.Dim("batch", min=1)
            torch.onnx.export(
                module,
                example,
                str(path),
                dynamo=True,
                dynamic_shapes={"images": {0: batch}, "thresholds": None},
                **common,
            )
        except Exception as exc:  # torch.export / onnxscript raise many types
            dynamo_text = _dynamo_error_text(exc)
            op = unsupported_op_name(dynamo_text)
            fallback_reason = (f"unsupported op {op}: " if op else "") + _first_line(exc)
        else:
            got = model_opset(path)
            if got == opset:
                return {"exporter": "dynamo", "opset": opset, "fallback_reason": None}
            fallback_reason = f"the dynamo exporter could not write opset {opset} (it wrote {got})"
        warnings.warn(
            f"{fallback_reason}; falling back to the legacy TorchScript exporter", ExporterFallbackWarning, stacklevel=2
        )
    axes = {"images": {0: "batch"}, **{name: {0: "batch"} for name in OUTPUT_NAMES}}
    try:
        with warnings.catch_warnings():
            warnings.simplefilter("ignore", DeprecationWarning)
            warnings.simplefilter("ignore", torch.jit.TracerWarning)
            torch.onnx.export(module, example, str(path), dynamo=False, dynamic_axes=axes, **common)
    except Exception as exc:
        text = f"{exc}\n{dynamo_text}"
        op = unsupported_op_name(text)
        what = f"operator {op}" if op else "an operation"
        model_name = type(getattr(module, "net", module)).__name__
        raise ExportError(
            f"the ONNX exporter cannot handle {what} in model {model_name} at opset {opset} "
            f"({_first_line(exc)}). Replace it with supported torch ops, or try another --opset."
        ) from exc
    got = model_opset(path)
    if got != opset:
        raise ExportError(f"the ONNX exporters could not write opset {opset} (got {got}); choose another --opset")
    return {"exporter": "legacy", "opset": opset, "fallback_reason": fallback_reason}


def model_opset(path: str | Path) -> int:
    """The default-domain opset an ONNX file was written for."""
    import onnx

    model = onnx.load(str(path), load_external_data=False)
    return next((int(o.version) for o in model.opset_import if o.domain in ("", "ai.onnx")), -1)


GRAPH_DOC = (
    "Input: images uint8 (N, C, H, W), pixel values 0..255, channels R, G, B (or L), normalized inside "
    "(metadata mean, std). Outputs: probs float32 (N, K), label int64 (N,), confidence float32 (N,), "
    "mask uint8 (N,): 1 where confidence >= thresholds[label] (a constant: metadata default_thresholds), else 0."
)


def write_metadata(path: str | Path, meta: EdgeMetadata, precision: str) -> dict[str, Any]:
    """Finish the exported file at ``path``: metadata, constant thresholds, version, opsets (:func:`graph.finalize`)."""
    return graph.finalize(path, meta.props(precision), meta.thresholds, GRAPH_DOC, f"{meta.model or 'model'}_edge")


# ---------------------------------------------------------------------------------------------
# the report


@dataclass
class ExportReport:
    """What an export produced and what its checks measured (``export_report.json``)."""

    out_dir: str
    status: str = "running"  # running | ok | failed
    error: str | None = None
    failed_check: str | None = None
    source: dict[str, Any] = field(default_factory=dict)
    metadata: dict[str, Any] = field(default_factory=dict)
    exporter: dict[str, Any] = field(default_factory=dict)
    artifacts: dict[str, Any] = field(default_factory=dict)
    checks: dict[str, Any] = field(default_factory=dict)
    quantization: dict[str, Any] | None = None
    seconds: dict[str, float] = field(default_factory=dict)

    @property
    def ok(self) -> bool:
        return self.status == "ok"

    @property
    def path(self) -> Path:
        return Path(self.out_dir) / REPORT_NAME

    def to_dict(self) -> dict[str, Any]:
        return asdict(self)

    def write(self) -> Path:
        self.path.write_text(json.dumps(self.to_dict(), indent=2, default=_json_default) + "\n", encoding="utf-8")
        return self.path

    def record(self, name: str, result: dict[str, Any]) -> None:
        """Store a check's result; a failed check fails the export (report written first)."""
        self.checks[name] = result
        if not result.get("passed", False):
            self.fail(name, _check_failure_text(name, result))

    def fail(self, check: str, message: str) -> None:
        self.status, self.failed_check, self.error = "failed", check, message
        self.write()
        raise ExportError(f"{message} (report: {self.path})")


def _json_default(obj):
    if isinstance(obj, (np.integer,)):
        return int(obj)
    if isinstance(obj, (np.floating,)):
        return float(obj)
    if isinstance(obj, np.ndarray):
        return obj.tolist()
    return str(obj)


def _check_failure_text(name: str, r: dict[str, Any]) -> str:
    if r.get("failures"):
        return f"check '{name}' failed: " + "; ".join(r["failures"])
    if r.get("error"):
        return f"check '{name}' failed: {r['error']}"
    if "probs_outside_tolerance" in r:
        return (
            f"check '{name}' failed on {r['samples']} images: {r['probs_outside_tolerance']} probabilities "
            f"outside rtol {r['rtol']} / atol {r['atol']} (max abs diff {r['max_abs_prob_diff']:.3g}), "
            f"{r['label_mismatches']} label and {r['mask_mismatches']} mask mismatches"
        )
    return f"check '{name}' failed: {r}"


# ---------------------------------------------------------------------------------------------
# reference predictions


@torch.no_grad()
def torch_predictions(
    model: nn.Module, images: np.ndarray, mean, std, thresholds, batch_size: int = 500
) -> Predictions:
    """The project's own eval path (``to_float`` + ``normalize`` + model), then softmax / max / threshold.

    Independent of :class:`EdgeModel`, so a wrong in-graph normalization shows up in parity.
    """
    from fedml_ssfl.data.augment import normalize, to_float

    model.eval()
    thr = torch.as_tensor(np.asarray(thresholds, dtype=np.float32))
    probs = []
    for s in range(0, len(images), batch_size):
        x = normalize(to_float(torch.from_numpy(np.ascontiguousarray(images[s : s + batch_size]))), mean, std)
        probs.append(torch.softmax(model(x), dim=1))
    k = len(thr)
    p = torch.cat(probs) if probs else torch.zeros(0, k)
    conf, label = p.max(dim=1)
    return Predictions(p.numpy(), label.numpy().astype(np.int64), conf.numpy(), (conf >= thr[label]).numpy())


# ---------------------------------------------------------------------------------------------
# export of a model


def make_out_dir(out_dir: str | Path) -> Path:
    """Create the output folder (and its parents), or an :class:`ExportError` naming what is in the way.

    Raises
    ------
    ExportError
        ``out_dir`` or a parent is a file, or a folder on the way is not writable.
    """
    from fedml_ssfl.atomic import make_folder

    try:
        return make_folder(out_dir)
    except OSError as exc:
        raise ExportError(f"output folder {out_dir}: {exc}; or pass --out another folder") from None


def _session(report: ExportReport, path: Path, check: str):
    try:
        return verify.make_session(path)
    except Exception as exc:  # onnxruntime names the op it has no kernel for
        report.record(check, {"passed": False, "error": f"onnxruntime cannot load {path.name}: {_first_line(exc)}"})


def _to_ort(report: ExportReport, onnx_path: Path, ort_path: Path) -> Path:
    try:
        return ort_format.convert_to_ort(onnx_path, ort_path)
    except Exception as exc:  # onnxruntime's own errors
        report.fail(
            f"ort_format_{ort_path.name}", f"ORT-format conversion for {ort_path.name} failed: {_first_line(exc)}"
        )


MAX_ONNX_BYTES = 2**31 - 2**20
"""The weights one ONNX file can hold: protobuf's 2 GiB, less 1 MiB for the graph and metadata."""


def check_onnx_size(model: nn.Module) -> int:
    """The bytes of ``model``'s weights (parameters and buffers); refused beyond :data:`MAX_ONNX_BYTES`.

    Checked before exporting: an ONNX file over 2 GiB cannot be written in one piece, and the
    exporters fail on it deep inside protobuf. An edge model is megabytes.
    """
    tensors = {id(t): t for t in [*model.parameters(), *model.buffers()]}
    nbytes = sum(t.numel() * t.element_size() for t in tensors.values())
    if nbytes > MAX_ONNX_BYTES:
        raise ExportError(
            f"the model's weights take {nbytes / 2**30:.2f} GiB, more than the 2 GiB one ONNX file can "
            "hold (protobuf's limit); export a smaller model for the edge"
        )
    return nbytes


def check_batch_size(batch_size) -> int | None:
    """The ``.ort`` batch: an int >= 1, or None for 0 (a dynamic batch).

    Raises
    ------
    ExportError
        Not an integer, or negative.
    """
    if isinstance(batch_size, bool) or not isinstance(batch_size, (int, np.integer)) or batch_size < 0:
        raise ExportError(
            f"--batch-size: the .ort files' batch must be an integer >= 1 (or 0 for a dynamic "
            f"batch), got {batch_size!r}"
        )
    return int(batch_size) or None


class _Artifacts:
    """The ``.ort`` side of one precision: the fixed-batch graph it is converted from, checks and files."""

    def __init__(
        self, report: ExportReport, onnx_path: Path, tmp: Path, batch: int | None, meta: EdgeMetadata, precision: str
    ) -> None:
        self.report, self.onnx_path, self.batch, self.meta = report, onnx_path, batch, meta
        stem = onnx_path.name[: -len(".onnx")]  # model | model.int8
        self.prefix = "" if precision == "float32" else "int8_"
        self.ort_path = onnx_path.with_name(f"{stem}.ort")
        self.config_path = onnx_path.with_name(f"{stem}.{ort_format.CONFIG_NAME}")
        self.usability_txt = onnx_path.with_name(f"mobile_usability{stem[len('model') :]}.txt")
        if batch is None:
            self.ort_source = onnx_path
        else:
            self.ort_source = graph.fix_batch_size(onnx_path, tmp / f"{stem}.batch{batch}.onnx", batch)

    def usability(self) -> None:
        """onnxruntime's mobile usability check of the ``.ort``'s graph (and of the dynamic ``.onnx``, to compare)."""
        batch_words = f"batch {self.batch}" if self.batch else "dynamic batch"
        label = f"{self.ort_path.name}'s graph ({self.onnx_path.name} with {batch_words})"
        result = verify.mobile_usability(self.ort_source, self.usability_txt, label=label)
        result.update(model=self.ort_path.name, batch_size=self.batch or "dynamic")
        if self.batch is not None:
            dyn = verify.mobile_usability(self.onnx_path, self.usability_txt.with_suffix(".onnx.txt"))
            result["onnx"] = {
                "model": self.onnx_path.name,
                "batch_size": "dynamic",
                **{k: dyn[k] for k in ("report", "coverage", "error")},
            }
            result["passed"] = result["passed"] and dyn["passed"]
        self.report.record(f"{self.prefix}mobile_usability", result)

    def convert(self):
        """Write the ``.ort`` file; its onnxruntime session."""
        _to_ort(self.report, self.ort_source, self.ort_path)
        return _session(self.report, self.ort_path, f"onnxruntime_load_{self.ort_path.name}")

    def contract(self, name: str, session, images: np.ndarray, batch: int | None) -> None:
        self.report.record(name, verify.check_contract(session, images[:3], self.meta.thresholds, batch))

    def operators(self) -> dict[str, Any]:
        info = ort_format.write_required_operators(self.config_path, [(self.ort_source, self.ort_path)])
        return {**verify.artifact_info(self.config_path), **info}


def export_model(
    model: nn.Module,
    out_dir: str | Path,
    meta: EdgeMetadata,
    *,
    test_images: np.ndarray,
    test_labels: np.ndarray | None = None,
    unlabeled_images: np.ndarray | None = None,
    calibration_images: np.ndarray | None = None,
    opset: int = DEFAULT_OPSET,
    dynamo: bool = True,
    quantize: bool = True,
    max_acc_drop: float = MAX_ACC_DROP,
    min_agreement: float = MIN_AGREEMENT,
    batch_size: int = DEFAULT_ORT_BATCH,
    source: dict[str, Any] | None = None,
    unlabeled_source: str = "client_unlabeled",
) -> ExportReport:
    """Export ``model`` (any registry model) and verify every artifact.

    Parameters
    ----------
    model : nn.Module
        Takes normalised float input, returns logits; put in eval mode here.
    out_dir : path
        Receives ``model.onnx``, ``model.ort``, ``model.int8.onnx``, ``model.int8.ort``, the
        ``required_operators`` configs, the mobile-usability reports and ``export_report.json``.
    meta : EdgeMetadata
        Data facts and provenance; ``meta.thresholds`` are the graph's (constant) thresholds.
    test_images, test_labels : numpy.ndarray
        uint8 ``(N, C, H, W)`` images for the parity check (and labels for accuracy, if known).
    unlabeled_images, calibration_images : numpy.ndarray, optional
        Client (unlabeled) images: int8 agreement / mask rate are measured on the first,
        activation ranges calibrated on the second. ``calibration_images`` is needed when
        ``quantize``.
    unlabeled_source : str
        What ``unlabeled_images`` are, as the report's ``agreement_measured_on`` says:
        ``"client_unlabeled"``, or ``"server_labeled"`` (a deployment's server, which holds no
        client image).
    opset, dynamo : int, bool
        ONNX opset; use the dynamo exporter (the legacy one is the fallback either way).
    quantize : bool
        Also build and gate the int8 model.
    max_acc_drop, min_agreement : float
        The int8 gates (fractions: 0.01 is one point).
    batch_size : int
        The batch the ``.ort`` files are fixed to (default 1: NNAPI and CoreML take only fixed
        shapes); 0 keeps it dynamic. The ``.onnx`` files keep a dynamic batch either way.

    Returns
    -------
    ExportReport
        With ``status == "ok"``; it is also written to ``out_dir/export_report.json``.

    Raises
    ------
    ExportError
        Bad input, an op the exporter cannot handle, or a failed check (the report is still
        written, with ``status: failed`` and the failing check).
    """
    batch = check_batch_size(batch_size)
    out = make_out_dir(out_dir)
    meta.thresholds = check_thresholds(meta.thresholds, meta.num_classes)
    thresholds = np.asarray(meta.thresholds, dtype=np.float32)
    images = _check_images(test_images, meta, "test_images")
    labels = None if test_labels is None else np.asarray(test_labels, dtype=np.int64)
    if quantize and (calibration_images is None or len(calibration_images) == 0):
        raise ExportError(
            "int8 quantization needs client images to calibrate on; pass calibration_images "
            "or export with quantize=False (--no-int8)"
        )
    report = ExportReport(out_dir=str(out), source=dict(source or {}), metadata=meta.props("float32"))
    timer = time.perf_counter()

    check_onnx_size(model)  # before .to("cpu"): a model on the meta device stays unallocated
    model = model.to("cpu").eval()
    edge = EdgeModel(model, meta.mean, meta.std).eval()
    onnx_path = out / "model.onnx"
    example = (
        torch.zeros(2, meta.in_channels, meta.image_size, meta.image_size, dtype=torch.uint8),
        torch.as_tensor(thresholds),
    )
    try:
        report.exporter = export_onnx(edge, onnx_path, example, opset=opset, dynamo=dynamo)
    except ExportError as exc:
        report.fail("export", str(exc))
    report.exporter["graph"] = write_metadata(onnx_path, meta, "float32")
    report.exporter["ort_batch_size"] = batch or "dynamic"
    report.seconds["export"] = time.perf_counter() - timer

    with tempfile.TemporaryDirectory(prefix="mobile_export_") as tmp:
        report.record("onnx_checker", verify.onnx_full_check(onnx_path))
        float_ort = _Artifacts(report, onnx_path, Path(tmp), batch, meta, "float32")
        float_ort.usability()

        t = time.perf_counter()
        reference = torch_predictions(model, images, meta.mean, meta.std, thresholds)
        float_session = _session(report, onnx_path, "onnxruntime_load")
        float_ort.contract("contract_onnx", float_session, images, None)
        float_test = verify.run_session(float_session, images)  # images alone: the graph's constant thresholds
        parity = verify.compare_float(reference, float_test)
        if labels is not None:
            parity["torch_test_acc"] = reference.accuracy(labels)
            parity["onnx_test_acc"] = float_test.accuracy(labels)
        parity["mask_rate"] = float_test.mask_rate
        report.record("parity_onnx", parity)

        ort_session = float_ort.convert()
        float_ort.contract("contract_ort", ort_session, images, batch)
        ort_test = verify.run_session(ort_session, images)
        report.record("parity_ort", verify.compare_float(reference, ort_test))
        report.seconds["verify_float"] = time.perf_counter() - t
        report.artifacts = {
            "onnx": verify.artifact_info(onnx_path),
            "ort": {**verify.artifact_info(float_ort.ort_path), "batch_size": batch or "dynamic"},
        }
        report.artifacts["required_operators"] = float_ort.operators()
        pairs = [(float_ort.ort_source, float_ort.ort_path)]

        if quantize:
            t = time.perf_counter()
            int8_ort = _quantize_and_gate(
                report,
                onnx_path,
                float_session,
                float_test,
                meta,
                thresholds,
                images,
                labels,
                unlabeled_images,
                calibration_images,
                max_acc_drop,
                min_agreement,
                Path(tmp),
                batch,
                unlabeled_source,
            )
            pairs.append((int8_ort.ort_source, int8_ort.ort_path))
            report.seconds["int8"] = time.perf_counter() - t
        else:
            report.checks["int8"] = {"skipped": True, "reason": "quantize=False (--no-int8)"}
        combined = ort_format.write_required_operators(out / ort_format.CONFIG_NAME, pairs)
        report.artifacts["required_operators_all"] = {**verify.artifact_info(out / ort_format.CONFIG_NAME), **combined}

    for key, check in (
        ("onnx", "contract_onnx"),
        ("ort", "contract_ort"),
        ("int8_onnx", "int8_contract_onnx"),
        ("int8_ort", "int8_contract_ort"),
    ):
        if key in report.artifacts:  # the shape read from each file's images input (for apps without metadata)
            report.artifacts[key]["input_shape"] = report.checks[check]["input_shape"]
    report.seconds["total"] = time.perf_counter() - timer
    report.status = "ok"
    report.write()
    return report


def _quantize_and_gate(
    report: ExportReport,
    onnx_path: Path,
    float_session,
    float_test: Predictions,
    meta: EdgeMetadata,
    thresholds: np.ndarray,
    images: np.ndarray,
    labels: np.ndarray | None,
    unlabeled_images,
    calibration_images,
    max_acc_drop: float,
    min_agreement: float,
    tmp: Path,
    batch: int | None,
    unlabeled_source: str = "client_unlabeled",
) -> _Artifacts:
    from .quantize import quantize_int8

    out = onnx_path.parent
    q_path = out / "model.int8.onnx"
    calib = _check_images(calibration_images, meta, "calibration_images")
    try:
        report.quantization = quantize_int8(onnx_path, q_path, calib)
    except Exception as exc:
        report.fail("int8_quantize", f"int8 quantization failed: {_first_line(exc)}")
    report.quantization["graph"] = write_metadata(q_path, meta, "int8")
    report.record("int8_onnx_checker", verify.onnx_full_check(q_path))
    q_ort = _Artifacts(report, q_path, tmp, batch, meta, "int8")
    q_ort.usability()
    unl = (
        None
        if unlabeled_images is None or len(unlabeled_images) == 0
        else _check_images(unlabeled_images, meta, "unlabeled_images")
    )
    float_unl = verify.run_session(float_session, unl, thresholds) if unl is not None else None
    gate_labels = labels if labels is not None else float_test.label  # without labels: accuracy vs float labels
    q_session = _session(report, q_path, "onnxruntime_load_model.int8.onnx")
    q_ort.contract("int8_contract_onnx", q_session, images, None)
    ort_session = q_ort.convert()
    q_ort.contract("int8_contract_ort", ort_session, images, batch)
    for name, session in (("int8_gates", q_session), ("int8_ort_gates", ort_session)):
        q_test = verify.run_session(session, images, thresholds)
        q_unl = verify.run_session(session, unl, thresholds) if unl is not None else None
        result = verify.compare_int8(
            float_test, q_test, gate_labels, float_unl, q_unl, max_acc_drop, min_agreement, unlabeled_source
        )
        result["accuracy_against"] = "test labels" if labels is not None else "float model labels"
        report.record(name, result)
    report.artifacts["int8_onnx"] = verify.artifact_info(q_path)
    report.artifacts["int8_ort"] = {**verify.artifact_info(q_ort.ort_path), "batch_size": batch or "dynamic"}
    report.artifacts["int8_required_operators"] = q_ort.operators()
    report.artifacts["int8_to_float_size"] = report.artifacts["int8_onnx"]["bytes"] / report.artifacts["onnx"]["bytes"]
    return q_ort


def _check_images(images, meta: EdgeMetadata, where: str) -> np.ndarray:
    arr = images.numpy() if isinstance(images, torch.Tensor) else np.asarray(images)
    want = (meta.in_channels, meta.image_size, meta.image_size)
    if arr.dtype != np.uint8 or arr.ndim != 4 or tuple(arr.shape[1:]) != want:
        raise ExportError(
            f"{where}: expected uint8 images of shape (N, {want[0]}, {want[1]}, {want[2]}), "
            f"got {arr.dtype} {tuple(arr.shape)}"
        )
    return np.ascontiguousarray(arr)


# ---------------------------------------------------------------------------------------------
# export of a run


@dataclass
class RunSource:
    """A run's checkpoint and resolved config, found from a run directory or a checkpoint path."""

    checkpoint_path: Path
    config_path: Path
    checkpoint: dict[str, Any]
    config: Any  # ExperimentConfig


def load_run_source(source: str | Path) -> RunSource:
    """Find and read the checkpoint and ``config.yaml`` behind ``source`` (RUN_DIR or CHECKPOINT).

    Raises
    ------
    ExportError
        Nothing there, a folder that is not a run, a run without a checkpoint, a file that is not a
        checkpoint (an exported model, a truncated or foreign file), no config beside the checkpoint,
        or an unreadable checkpoint / config.
    """
    from fedml_ssfl.checkpoint import CheckpointError, load_checkpoint
    from fedml_ssfl.config import ConfigError, load_config

    src = Path(source).expanduser()
    if src.is_dir():
        ckpt = src / "checkpoints" / "last.pt"
        if ckpt.is_dir():
            raise ExportError(f"{ckpt} is a folder, not a checkpoint file; pass a checkpoint `fedml-ssfl run` wrote")
        if not ckpt.is_file() and not (src / "config.yaml").is_file():
            raise ExportError(
                f"{src} is not a run folder (it has no config.yaml and no checkpoints/last.pt); pass "
                "a run folder written by `fedml-ssfl run`, or a checkpoint file"
            )
        if not ckpt.is_file():
            raise ExportError(
                f"run {src} has no checkpoint (expected {ckpt}): the run has not saved one yet; let "
                "it finish a round (or lower tracking_args.checkpoint_every), or pass a checkpoint file"
            )
        configs = [src / "config.yaml"]
    elif src.is_file():
        if src.suffix.lower() in (".onnx", ".ort"):
            raise ExportError(
                f"{src} is an exported model, not a checkpoint; pass the run folder it was exported "
                "from (or its checkpoints/last.pt)"
            )
        ckpt = src
        configs = [src.parent / "config.yaml", src.parent.parent / "config.yaml"]
    else:
        raise ExportError(f"{src} does not exist; pass a run directory (with checkpoints/last.pt) or a checkpoint file")
    try:
        payload = load_checkpoint(ckpt)
    except CheckpointError as exc:
        cause = exc.__cause__
        if cause is None:  # damaged content or another format: the checkpoint's own message says which
            raise ExportError(str(exc)) from exc
        raise ExportError(
            f"{ckpt} is not a fedml_ssfl checkpoint ({_first_line(cause)}): it is another kind of "
            "file or truncated; pass a run folder (with checkpoints/last.pt) or the checkpoint file "
            "`fedml-ssfl run` wrote"
        ) from exc
    config_path = next((c for c in configs if c.is_file()), None)
    if config_path is None:
        raise ExportError(
            f"no config.yaml found for checkpoint {ckpt} (looked at {', '.join(map(str, configs))}); "
            "export needs the run's resolved config to rebuild the model and load its data"
        )
    try:
        cfg = load_config(config_path)
    except ConfigError as exc:
        raise ExportError(f"{config_path}: {exc}") from exc
    return RunSource(checkpoint_path=ckpt, config_path=config_path, checkpoint=payload, config=cfg)


def resolve_thresholds(explicit, num_classes: int, checkpoint: dict[str, Any], cfg) -> tuple[list[float], str]:
    """Default thresholds for the graph: explicit > the checkpoint's per-class ones > the config's tau > 0.95."""
    if explicit is not None:
        return check_thresholds(explicit, num_classes, "--threshold"), "explicit"
    algo_state = checkpoint.get("algorithm") or {}
    saved = algo_state.get("thresholds") if isinstance(algo_state, dict) else None
    if saved is not None:
        values = saved.detach().cpu().numpy() if isinstance(saved, torch.Tensor) else np.asarray(saved)
        return check_thresholds(values, num_classes, "checkpoint thresholds"), "checkpoint"
    tau = getattr(cfg.ssfl_args, "threshold", None)
    if isinstance(tau, (int, float)) and not isinstance(tau, bool):
        return check_thresholds([tau], num_classes, "ssfl_args.threshold"), "config ssfl_args.threshold"
    return [DEFAULT_THRESHOLD] * num_classes, "default"


def select_weights(payload: dict[str, Any], key: str, where: Path) -> dict[str, torch.Tensor]:
    """The state dict at dotted ``key`` inside the checkpoint's algorithm state (integer parts match int keys)."""
    node: Any = payload.get("algorithm") or {}
    walked = []
    for part in key.split("."):
        options = node if isinstance(node, dict) else {}
        match = next((k for k in options if str(k) == part), None)
        if match is None:
            here = ".".join(["algorithm", *walked])
            avail = ", ".join(str(k) for k in options) or "nothing"
            raise ExportError(
                f"checkpoint {where} has no '{part}' under '{here}' (there: {avail}); "
                f"choose the model with --weights, e.g. {DEFAULT_WEIGHTS}"
            )
        node = options[match]
        walked.append(part)
    if not (isinstance(node, dict) and node and all(isinstance(v, torch.Tensor) for v in node.values())):
        raise ExportError(f"checkpoint {where}: 'algorithm.{key}' is not a model state dict")
    return node


def client_image_pools(cfg, dataset, calibration_samples: int, eval_samples: int) -> tuple[np.ndarray, np.ndarray, str]:
    """Disjoint calibration and evaluation samples of the training images the exporting party holds (seeded).

    In simulation the clients' unlabeled images (``"client_unlabeled"``). In a deployment the export
    runs where the run folder is, on the server, which holds no client image: its own labeled (and
    validation) images (``"server_labeled"``). The third value names which, for the report.
    """
    from fedml_ssfl.experiment import deployed, make_split

    split = make_split(cfg, dataset)
    pools = [idx for idx in split.client_unlabeled if idx.numel()]
    where = "client_unlabeled" if pools and not deployed(cfg) else "server_labeled"
    idx = torch.cat(pools).numpy() if where == "client_unlabeled" else np.arange(len(dataset.train_images))
    rng = np.random.default_rng(cfg.common_args.random_seed)
    idx = rng.permutation(np.unique(idx))
    n_cal = min(calibration_samples, max(len(idx) // 2, 1))
    images = dataset.train_images.numpy()
    return images[np.sort(idx[:n_cal])], images[np.sort(idx[n_cal : n_cal + eval_samples])], where


def _script_run(cfg) -> bool:
    """Whether ``cfg`` is a FedML script's run (its data and model lived in the script)."""
    from fedml_ssfl.experiment import script_data
    from fedml_ssfl.models.script import SCRIPT_MODEL_PREFIX

    return script_data(cfg) or cfg.model_args.model.startswith(SCRIPT_MODEL_PREFIX)


@dataclass
class _CardData:
    """The data facts :func:`export_run` reads, for a script's run: from the model card and ``--data``."""

    name: str
    class_names: list[str]
    num_classes: int
    mean: list[float]
    std: list[float]
    in_channels: int
    image_size: int
    test_images: torch.Tensor
    test_labels: torch.Tensor


def _script_run_source(run: RunSource, model_spec: str, data: str | Path) -> tuple[_CardData, nn.Module]:
    """A FedML script's run: its model from the checkpoint's model card (and ``--model``), test images from ``--data``.

    Raises
    ------
    ExportError
        No model card, no ``--data``, a model that cannot be built, images of another shape.
    """
    from fedml_ssfl.config import ConfigError
    from fedml_ssfl.data.local_files import DataFormatError, read_local_images
    from fedml_ssfl.trained import build_from_card, read_card

    try:
        card = read_card(run.checkpoint, run.checkpoint_path)
        net = build_from_card(card, model_spec=model_spec)
    except ConfigError as exc:
        raise ExportError(str(exc)) from None
    if not data:
        raise ExportError(
            f"{run.checkpoint_path} is a FedML script's run, which keeps none of the script's data: pass --data PATH, "
            f"labeled test images (.npz or class folders, {card['in_channels']}x{card['image_size']}x"
            f"{card['image_size']}), for the parity checks and the int8 gates"
        )
    try:
        images = read_local_images(data, num_classes=int(card["num_classes"]))
    except DataFormatError as exc:
        raise ExportError(f"--data: {exc}") from None
    want = (int(card["in_channels"]), int(card["image_size"]), int(card["image_size"]))
    if tuple(images.images.shape[1:]) != want or bool((images.labels < 0).any()):
        raise ExportError(
            f"--data {data}: holds images {tuple(images.images.shape[1:])}, labels "
            f"{'missing on some' if bool((images.labels < 0).any()) else 'given'}; the run's model takes {want}, and "
            "the gates need every image's label"
        )
    facts = _CardData(
        name=str(card.get("dataset", "")),
        class_names=[str(c) for c in card["class_names"]],
        num_classes=int(card["num_classes"]),
        mean=list(card["norm_mean"]),
        std=list(card["norm_std"]),
        in_channels=want[0],
        image_size=want[1],
        test_images=images.images,
        test_labels=images.labels,
    )
    return facts, net


def export_run(
    source: str | Path,
    out_dir: str | Path,
    *,
    opset: int = DEFAULT_OPSET,
    thresholds: list[float] | None = None,
    quantize: bool = True,
    parity_samples: int | None = None,
    dynamo: bool = True,
    calibration_samples: int = DEFAULT_CALIBRATION_SAMPLES,
    max_acc_drop: float = MAX_ACC_DROP,
    min_agreement: float = MIN_AGREEMENT,
    weights: str = DEFAULT_WEIGHTS,
    batch_size: int = DEFAULT_ORT_BATCH,
    model_spec: str = "",
    data: str | Path = "",
) -> ExportReport:
    """Export a run's model (RUN_DIR or its checkpoint file) to ``out_dir``, verified.

    Parameters
    ----------
    source : path
        A run directory (``checkpoints/last.pt`` + ``config.yaml``) or a checkpoint file.
    out_dir : path
        Where the models and ``export_report.json`` go.
    opset : int
        ONNX opset (default 18).
    thresholds : list of float, optional
        Default thresholds: one tau for all classes or one per class. Default: the checkpoint's
        class-wise thresholds (FedSEAL), else ``ssfl_args.threshold``, else 0.95.
    quantize : bool
        Build and gate the int8 model (default True).
    parity_samples : int, optional
        Test images for parity and the gates; default 1,000 (all when the test set is smaller);
        0 for the whole test set.
    dynamo : bool
        Use the dynamo exporter first (default); False goes straight to the legacy exporter.
    calibration_samples : int
        Client images to calibrate the int8 model on (default 256).
    max_acc_drop, min_agreement : float
        The int8 gates as fractions (defaults 0.01 and 0.98).
    weights : str
        Which model of the checkpoint's algorithm state: ``global_state`` (default) or a dotted
        path to another state dict, e.g. ``group_states.1`` (the model FedAvg-SSL sends to the
        clients of group 1).
    batch_size : int
        The batch the ``.ort`` files are fixed to (default 1); 0 keeps it dynamic. The
        ``.onnx`` files keep a dynamic batch.
    model_spec : str
        A FedML script's run: ``module:Name`` of the class (or function) building its model with no
        arguments; default the class the checkpoint's model card records, imported from the script's
        folder (:func:`fedml_ssfl.trained.build_from_card`).
    data : path
        A FedML script's run (required there): labeled test images, ``.npz`` or class folders, in the
        run's image shape, for the parity checks, the int8 calibration (the first half when the int8
        model is built) and gates. The normalisation is the checkpoint's (its model card).

    Returns
    -------
    ExportReport

    Raises
    ------
    ExportError
        A run without a checkpoint, thresholds of the wrong length, an op the exporter cannot
        handle, or a failed check.
    """
    from fedml_ssfl.config import ConfigError
    from fedml_ssfl.experiment import load_experiment_dataset, model_factory

    check_batch_size(batch_size)
    run = load_run_source(source)
    cfg, payload = run.config, run.checkpoint
    if parity_samples is not None and parity_samples < 0:
        raise ExportError(f"parity_samples must be >= 0 (0: the whole test set), got {parity_samples}")
    if _script_run(cfg):
        dataset, net = _script_run_source(run, model_spec, data)
    else:
        try:
            dataset = load_experiment_dataset(cfg)
            net = model_factory(cfg, dataset)()
        except (ConfigError, FileNotFoundError) as exc:
            raise ExportError(f"cannot rebuild the run's data and model from {run.config_path}: {exc}") from exc
    state = select_weights(payload, weights, run.checkpoint_path)
    try:
        net.load_state_dict(state, strict=True)
    except RuntimeError as exc:
        raise ExportError(
            f"checkpoint {run.checkpoint_path} does not fit model {cfg.model_args.model}-"
            f"{cfg.model_args.norm} from {run.config_path}: {exc}"
        ) from exc
    values, where = resolve_thresholds(thresholds, dataset.num_classes, payload, cfg)
    card = payload.get("model_card") if isinstance(payload.get("model_card"), dict) else {}
    fingerprint = payload.get("fingerprint") or cfg.fingerprint()
    if payload.get("fingerprint") and payload["fingerprint"] != cfg.fingerprint():
        log.warning(
            "checkpoint fingerprint %s differs from %s's (%s); using the checkpoint's",
            payload["fingerprint"],
            run.config_path.name,
            cfg.fingerprint(),
        )
    meta = EdgeMetadata(
        class_names=list(dataset.class_names),
        mean=[float(v) for v in card.get("norm_mean", dataset.mean)],  # what the run used (its model card)
        std=[float(v) for v in card.get("norm_std", dataset.std)],
        in_channels=dataset.in_channels,
        image_size=dataset.image_size,
        thresholds=values,
        threshold_source=where,
        algorithm=str(payload.get("algorithm_name", cfg.algorithm)),
        round=int(payload.get("round", -1)),
        config_hash=str(fingerprint),
        model=cfg.model_args.model,
        norm=cfg.model_args.norm,
        dataset=str(card.get("dataset", cfg.data_args.dataset)),
        weights=weights,
    )
    n_test = len(dataset.test_images)
    n = n_test if parity_samples == 0 else min(n_test, parity_samples or DEFAULT_PARITY_SAMPLES)
    if _script_run(cfg):  # the --data images: calibration and agreement on them
        held = "export_data"
        pool = dataset.test_images.numpy()
        n_cal = min(calibration_samples, max(len(pool) // 2, 1))
        calib, unlabeled = pool[:n_cal], pool[n_cal:] if len(pool) > n_cal else pool
    else:
        calib, unlabeled, held = client_image_pools(cfg, dataset, calibration_samples, n)
    src = {
        "source": str(source),
        "checkpoint": str(run.checkpoint_path),
        "config": str(run.config_path),
        "weights": weights,
        "test_images": n,
        "test_images_available": n_test,
        "agreement_images": held,
    }
    return export_model(
        net,
        out_dir,
        meta,
        test_images=dataset.test_images[:n].numpy(),
        test_labels=dataset.test_labels[:n].numpy(),
        unlabeled_images=unlabeled,
        calibration_images=calib,
        opset=opset,
        dynamo=dynamo,
        quantize=quantize,
        max_acc_drop=max_acc_drop,
        min_agreement=min_agreement,
        batch_size=batch_size,
        source=src,
        unlabeled_source=held,
    )


# ---------------------------------------------------------------------------------------------
# command line (``fedml-ssfl export`` and ``python -m mobile_export export``)


def default_out_dir(source: str | Path) -> Path:
    src = Path(source)
    if src.is_file():
        run_dir = src.parent.parent if src.parent.name == "checkpoints" else src.parent
        return run_dir / "export"
    return src / "export"


def format_report(report: ExportReport) -> str:
    """A few lines for the terminal."""
    lines = [
        f"exported {report.metadata.get('model')}-{report.metadata.get('norm')} "
        f"({report.metadata.get('algorithm')}, round {report.metadata.get('round')}) with the "
        f"{report.exporter.get('exporter')} exporter, opset {report.exporter.get('opset')}"
    ]
    for art in report.artifacts.values():
        if isinstance(art, dict):
            lines.append(f"  {art['path']:<37} {art['bytes'] / 2**20:8.2f} MiB")
    u = report.checks.get("mobile_usability", {})
    if u:
        lines.append(f"  {u['model']} (batch {u['batch_size']}): {verify.coverage_line(u.get('coverage'))}")
        if "onnx" in u:
            lines.append(f"  {u['onnx']['model']} (dynamic batch): {verify.coverage_line(u['onnx'].get('coverage'))}")
    p = report.checks.get("parity_onnx", {})
    if p:
        lines.append(
            f"  parity with torch on {p['samples']} test images: max |dp| {p['max_abs_prob_diff']:.2e}, "
            f"{p['label_mismatches']} label / {p['mask_mismatches']} mask mismatches"
        )
    g = report.checks.get("int8_gates")
    if g:
        lines.append(
            f"  int8: test acc {100 * g['float_test_acc']:.2f}% -> {100 * g['int8_test_acc']:.2f}%, "
            f"pseudo-label agreement {100 * g['label_agreement']:.2f}% ({g['agreement_measured_on']}), "
            f"mask rate moved {g['mask_rate_change_points']:+.2f} points"
        )
    lines.append(f"  report: {report.path}")
    return "\n".join(lines)


def run_export_from_args(args: argparse.Namespace, prog: str = "export") -> int:
    """Run an export from parsed :func:`add_export_arguments` arguments; 0 on success, 1 on failure.

    A refused or failed export prints one line, ``<prog>: error: <reason>``, to stderr.
    """
    out = Path(args.out) if args.out else default_out_dir(args.source)
    if not logging.getLogger().isEnabledFor(logging.DEBUG):  # the exporters' pass-by-pass INFO chatter
        for name in ("onnxscript", "onnx_ir", "onnxruntime", "torch.onnx"):
            logging.getLogger(name).setLevel(logging.WARNING)
    try:
        report = export_run(
            args.source,
            out,
            opset=args.opset,
            thresholds=args.thresholds,
            quantize=args.quantize,
            parity_samples=args.parity_samples,
            dynamo=args.dynamo,
            calibration_samples=args.calibration_samples,
            max_acc_drop=args.max_acc_drop / 100.0,
            min_agreement=args.min_agreement / 100.0,
            weights=args.weights,
            batch_size=args.batch_size,
            model_spec=getattr(args, "model_spec", ""),
            data=getattr(args, "data", ""),
        )
    except ExportError as exc:
        print(f"{prog}: error: {exc}", file=sys.stderr)
        return 1
    print(format_report(report))
    return 0


def main(argv: list[str] | None = None) -> int:
    parser = add_export_arguments(
        argparse.ArgumentParser(
            prog="python -m mobile_export export", description="Export a trained run to ONNX / ORT / int8, verified"
        )
    )
    logging.basicConfig(level=logging.INFO, format="%(levelname)s %(name)s: %(message)s")
    return run_export_from_args(parser.parse_args(argv))


if __name__ == "__main__":
    sys.exit(main())
