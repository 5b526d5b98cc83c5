"""Checks every exported model goes through: ONNX checker, ORT-mobile usability, parity, the edge contract.

Nothing here imports torch: the torch side of a parity check arrives as numpy arrays
(:class:`Predictions`), so the same functions check a float model against torch and an int8
model against the float one.
"""

from __future__ import annotations

import io
import json
import logging
import os
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np

# the edge contract, defined once (that file runs alone on devices)
from .edge_label import (
    EDGE_FORMAT_VERSION,
    FORMAT_TAG,
    INPUT_DTYPES,
    INPUT_NAMES,
    OUTPUT_DTYPES,
    OUTPUT_NAMES,
    image_rule_metadata,
    model_batch_size,
    run_batches,
)

PROB_RTOL = 1e-3
PROB_ATOL = 1e-5


@dataclass
class Predictions:
    """What one backend made of a batch of images (all numpy, one row per image)."""

    probs: np.ndarray  # (N, K) float32
    label: np.ndarray  # (N,) int64
    confidence: np.ndarray  # (N,) float32
    mask: np.ndarray  # (N,) bool

    def accuracy(self, labels: np.ndarray) -> float:
        return float((self.label == np.asarray(labels)).mean()) if len(labels) else float("nan")

    @property
    def mask_rate(self) -> float:
        return float(self.mask.mean()) if len(self.mask) else float("nan")


# ---------------------------------------------------------------------------------------------
# onnxruntime sessions


def make_session(path: str | Path, threads: int = 0):
    """A CPU onnxruntime session for an ``.onnx`` or ``.ort`` file."""
    import onnxruntime as ort

    so = ort.SessionOptions()
    if threads:
        so.intra_op_num_threads = threads
    so.log_severity_level = 3
    return ort.InferenceSession(str(path), sess_options=so, providers=["CPUExecutionProvider"])


def run_session(session, images: np.ndarray, thresholds=None, batch_size: int = 256) -> Predictions:
    """Run the edge graph over ``images`` (see :func:`mobile_export.edge_label.run_batches`).

    ``thresholds`` None: the model's own (its constant); given: ``mask`` is for them.
    """
    probs, label, conf, mask = run_batches(session, images, thresholds, batch_size)
    if probs is None:
        k = session.get_outputs()[0].shape[1]
        return Predictions(
            np.zeros((0, k), np.float32), np.zeros(0, np.int64), np.zeros(0, np.float32), np.zeros(0, bool)
        )
    return Predictions(probs.astype(np.float32), label.astype(np.int64), conf.astype(np.float32), mask != 0)


# ---------------------------------------------------------------------------------------------
# checks


def onnx_full_check(path: str | Path) -> dict[str, Any]:
    """``onnx.checker.check_model(full_check=True)`` (structure, types and strict shape inference).

    Returns ``{"passed": bool, "error": str | None}``.
    """
    import onnx

    try:
        onnx.checker.check_model(onnx.load(str(path)), full_check=True)
    except Exception as exc:  # onnx raises ValidationError / InferenceError and friends
        return {"passed": False, "error": f"{type(exc).__name__}: {exc}"}
    return {"passed": True, "error": None}


USABILITY_EPS = {
    "NNAPI": "nnapi",
    "CoreML NeuralNetwork": "coreml_neuralnetwork",
    "CoreML MLProgram": "coreml_mlprogram",
}
"""The execution providers onnxruntime's usability check reports on, and their keys in the export report."""


def _usability_checks():
    """(name, key, check) per execution provider: onnxruntime's partition estimate, ``check(model, fixed)``."""
    from onnxruntime.tools.mobile_helpers import usability_checker as uc

    def coreml(ops_file: str):
        return lambda model, fixed: uc.check_coreml_partitions(model, fixed, ops_file)

    checks = {
        "NNAPI": uc.check_nnapi_partitions,
        "CoreML NeuralNetwork": coreml("coreml_supported_neuralnetwork_ops.md"),
        "CoreML MLProgram": coreml("coreml_supported_mlprogram_ops.md"),
    }
    return [(name, USABILITY_EPS[name], checks[name]) for name in USABILITY_EPS]


def _partition_figures(info) -> dict[str, Any]:
    """The figures of one of onnxruntime's ``PartitioningInfo`` objects, and its verdict."""
    return {
        "supported_nodes": info.num_supported_nodes,
        "nodes": info.num_nodes,
        "share": round(info.num_supported_nodes / info.num_nodes, 4) if info.num_nodes else 0.0,
        "partitions": info.num_partitions,
        "partition_sizes": [len(group) for group in info.supported_groups],
        "unsupported_ops": sorted(info.unsupported_ops),
        "dynamic_shape_nodes": info.nodes_unsupported_due_to_dynamic_input,
        "verdict": info.suitability().name,
    }


def usability_coverage(path: str | Path, logger: logging.Logger | None = None) -> dict[str, dict[str, Any]]:
    """NNAPI / CoreML coverage of an ONNX model, from onnxruntime's usability checker's own functions.

    Does what ``python -m onnxruntime.tools.check_onnx_model_mobile_usability`` does (the graph after
    onnxruntime's basic optimizations, with ONNX shape inference), but keeps the figures of the
    ``PartitioningInfo`` objects its ``check_*_partitions`` functions return instead of their log text.

    Returns
    -------
    dict
        Per execution provider (``nnapi``, ``coreml_neuralnetwork``, ``coreml_mlprogram``):
        ``supported_nodes``, ``nodes``, ``share``, ``partitions``, ``partition_sizes``,
        ``unsupported_ops``, ``dynamic_shape_nodes``, ``verdict`` (YES / MAYBE / NO); for a model with
        dynamic inputs that is not a YES as it is, also ``if_shapes_fixed`` (the same figures, shapes
        assumed fixed), as the tool estimates. ``logger``, when given, receives the tool's own
        analysis text (INFO).
    """
    import tempfile

    from onnxruntime.tools.mobile_helpers import usability_checker as uc
    from onnxruntime.tools.onnx_model_utils import ModelProtoWithShapeInfo, optimize_model

    log = logger or logging.getLogger("mobile_export.usability")
    with tempfile.TemporaryDirectory(prefix="mobile_export_usability_") as tmp:
        optimized = Path(tmp) / Path(path).name
        optimize_model(Path(path), optimized, use_external_initializers=True)  # basic level, as the tool does
        model = ModelProtoWithShapeInfo(optimized).model_with_shape_info
    dynamic_inputs, _ = uc.check_shapes(model.graph, log)
    out: dict[str, dict[str, Any]] = {}
    for name, key, check in _usability_checks():
        log.info("Checking %s", name)
        info = check(model, True)  # dynamic shapes count against a node, as on a device
        info.print_analysis(log, name)
        out[key] = _partition_figures(info)
        if dynamic_inputs and out[key]["verdict"] != "YES":
            fixed = check(model, False)
            log.info("Partition information if the model was updated to make the shapes fixed:")
            fixed.print_analysis(log, name)
            out[key]["if_shapes_fixed"] = _partition_figures(fixed)
        log.info("Model should perform well with %s as is: %s", name, out[key]["verdict"])
    return out


def mobile_usability(path: str | Path, report_path: str | Path, label: str | None = None) -> dict[str, Any]:
    """onnxruntime's ORT-mobile usability check (:func:`usability_coverage`); its analysis saved to ``report_path``.

    The check is advisory (it says whether NNAPI / CoreML would take the model, and which ops
    keep a model on the CPU execution provider); it fails only if it cannot analyse the model.
    ``coverage`` holds the figures; the text at ``report_path`` is the tool's own analysis, for a
    person. ``label`` replaces the model's path in the saved text.
    """
    buf = io.StringIO()
    logger = logging.getLogger(f"mobile_export.usability.{Path(path).name}")
    logger.setLevel(logging.INFO)
    logger.propagate = False
    handler = logging.StreamHandler(buf)
    handler.setFormatter(logging.Formatter("%(levelname)s: %(message)s"))
    logger.addHandler(handler)
    coverage, error = None, None
    try:
        logger.info("Checking %s for usability with ORT Mobile.", label or path)
        coverage = usability_coverage(path, logger)
    except Exception as exc:  # the checker's own failures (an unreadable model, shape inference)
        error = f"{type(exc).__name__}: {exc}"
        logger.error("usability check could not analyse the model: %s", error)
    finally:
        logger.removeHandler(handler)
    text = buf.getvalue()
    if label:
        text = text.replace(str(path), label)
    Path(report_path).write_text(text, encoding="utf-8")
    try_eps = any(
        c["verdict"] != "NO" or c.get("if_shapes_fixed", {}).get("verdict", "NO") != "NO"
        for c in (coverage or {}).values()
    )  # the tool's rule: some EP is not a NO, as is or fixed
    verdict = (
        "NNAPI or CoreML may help; compare them against the CPU EP" if try_eps else "use the CPU execution provider"
    )
    return {
        "passed": error is None,
        "error": error,
        "report": Path(report_path).name,
        "recommendation": verdict,
        "coverage": coverage,
    }


def coverage_line(coverage: dict[str, dict[str, Any]] | None) -> str:
    """``NNAPI 17/21 nodes in 2 partitions, CoreML MLProgram 18/21 in 2, ...`` (or why there is none)."""
    if not coverage:
        return "no coverage figures"
    names = {v: k for k, v in USABILITY_EPS.items()}
    return ", ".join(
        f"{names[k]} {c['supported_nodes']}/{c['nodes']} nodes in {c['partitions']} partitions"
        for k, c in coverage.items()
    )


_ORT_TYPES = {"uint8": "tensor(uint8)", "float32": "tensor(float)", "int64": "tensor(int64)"}


def input_shape(session) -> list[int | str]:
    """The ``images`` input's shape as the file holds it, ``"N"`` for a dynamic batch: the source of truth."""
    images = next(i for i in session.get_inputs() if i.name == INPUT_NAMES[0])
    return [d if isinstance(d, int) and d > 0 else "N" for d in images.shape]


def check_contract(session, images: np.ndarray, default_thresholds, batch_size: int | None) -> dict[str, Any]:
    """Does the model in ``session`` keep the edge contract? Names, dtypes, shape, version, metadata, thresholds.

    Checks: ``images`` is the only input (uint8, batch ``batch_size`` or dynamic when None) and
    nothing is overridable (``thresholds`` a constant, not an input with a default); the outputs
    are :data:`~mobile_export.edge_label.OUTPUT_NAMES` with :data:`~mobile_export.edge_label.OUTPUT_DTYPES`;
    ``model_version`` and the ``format`` metadata say this contract; the ``input_shape`` metadata
    is the ``images`` input's shape and the image rule's keys are there; run on ``images``, ``mask``
    is ``confidence >= default_thresholds[label]`` as 0/1.
    """
    failures = []
    inputs = {i.name: i for i in session.get_inputs()}
    if list(inputs) != list(INPUT_NAMES):
        failures.append(f"inputs are {list(inputs)}, expected {list(INPUT_NAMES)}")
    overridable = [i.name for i in session.get_overridable_initializers()]
    if overridable:
        failures.append(
            f"{overridable} can be fed as inputs (initializers listed among the graph's inputs); "
            "expected constants only"
        )
    images_in = inputs.get(INPUT_NAMES[0])
    if images_in is not None and images_in.type != _ORT_TYPES[INPUT_DTYPES[INPUT_NAMES[0]]]:
        failures.append(f"images is {images_in.type}, expected {_ORT_TYPES[INPUT_DTYPES[INPUT_NAMES[0]]]}")
    got_batch = model_batch_size(session)
    if got_batch != batch_size:
        failures.append(f"images batch is {got_batch or 'dynamic'}, expected {batch_size or 'dynamic'}")
    outputs = {o.name: o.type for o in session.get_outputs()}
    want = {name: _ORT_TYPES[OUTPUT_DTYPES[name]] for name in OUTPUT_NAMES}
    if outputs != want:
        failures.append(f"outputs are {outputs}, expected {want}")
    meta = session.get_modelmeta()
    props = meta.custom_metadata_map
    if meta.version != EDGE_FORMAT_VERSION or props.get("format") != FORMAT_TAG:
        failures.append(
            f"model_version {meta.version} / format {props.get('format')!r}, "
            f"expected {EDGE_FORMAT_VERSION} / {FORMAT_TAG!r}"
        )
    shape = input_shape(session) if images_in is not None else None
    if shape is not None and props.get("input_shape") != json.dumps(shape):
        failures.append(f"metadata input_shape is {props.get('input_shape')}, the images input's shape {shape}")
    if shape is not None and len(shape) == 4:
        rule = image_rule_metadata(shape[1])
        wrong = {k: props.get(k) for k, v in rule.items() if props.get(k) != v}
        if wrong:
            failures.append(f"image rule metadata {wrong}, expected {rule}")
    mask_ok = None
    if not failures:
        probs, label, conf, mask = run_batches(session, images)
        thr = np.asarray(default_thresholds, dtype=np.float32)
        mask_ok = bool(mask.dtype == np.uint8 and np.array_equal(mask, (conf >= thr[label]).astype(np.uint8)))
        if not mask_ok:
            failures.append("mask is not confidence >= the default thresholds[label]")
    return {
        "passed": not failures,
        "failures": failures,
        "inputs": list(inputs),
        "overridable": overridable,
        "input_shape": shape,
        "outputs": outputs,
        "batch_size": got_batch or "dynamic",
        "model_version": meta.version,
        "default_thresholds_mask": mask_ok,
    }


def compare_float(
    reference: Predictions, got: Predictions, rtol: float = PROB_RTOL, atol: float = PROB_ATOL
) -> dict[str, Any]:
    """Parity of a float model with its reference: probabilities close, labels and masks identical."""
    n = len(reference.label)
    if len(got.label) != n:
        return {"passed": False, "samples": n, "error": f"{len(got.label)} predictions for {n} images"}
    close = np.isclose(got.probs, reference.probs, rtol=rtol, atol=atol)
    diff = np.abs(got.probs.astype(np.float64) - reference.probs.astype(np.float64))
    out = {
        "samples": n,
        "rtol": rtol,
        "atol": atol,
        "max_abs_prob_diff": float(diff.max()) if diff.size else 0.0,
        "probs_outside_tolerance": int((~close).sum()),
        "label_mismatches": int((got.label != reference.label).sum()),
        "mask_mismatches": int((got.mask != reference.mask).sum()),
        "confidence_max_abs_diff": float(np.abs(got.confidence - reference.confidence).max()) if n else 0.0,
    }
    out["passed"] = out["probs_outside_tolerance"] == 0 and out["label_mismatches"] == 0 and out["mask_mismatches"] == 0
    return out


def compare_int8(
    float_test: Predictions,
    int8_test: Predictions,
    test_labels: np.ndarray,
    float_unlabeled: Predictions | None,
    int8_unlabeled: Predictions | None,
    max_acc_drop: float,
    min_agreement: float,
    unlabeled_source: str = "client_unlabeled",
) -> dict[str, Any]:
    """The int8 gates: test accuracy drop, pseudo-label agreement, mask-rate movement.

    Agreement is measured on client (unlabeled) data where given, as that is where
    pseudo-labels are made, and always reported on the test set too. The gate uses the
    unlabeled figure when there is one, else the test figure. ``unlabeled_source`` names the
    images given as unlabeled (``agreement_measured_on``): ``"client_unlabeled"``, or
    ``"server_labeled"`` where the exporting party (a deployment's server) holds no client image.
    """
    acc_f, acc_q = float_test.accuracy(test_labels), int8_test.accuracy(test_labels)
    out: dict[str, Any] = {
        "test_samples": len(test_labels),
        "float_test_acc": acc_f,
        "int8_test_acc": acc_q,
        "test_acc_drop_points": 100.0 * (acc_f - acc_q),
        "max_acc_drop_points": 100.0 * max_acc_drop,
        "test_label_agreement": float((float_test.label == int8_test.label).mean()) if len(test_labels) else 1.0,
        "float_test_mask_rate": float_test.mask_rate,
        "int8_test_mask_rate": int8_test.mask_rate,
        "min_agreement": min_agreement,
    }
    agreement = out["test_label_agreement"]
    where = "test"
    if float_unlabeled is not None and int8_unlabeled is not None and len(float_unlabeled.label):
        agreement = float((float_unlabeled.label == int8_unlabeled.label).mean())
        where = unlabeled_source
        out.update(
            {
                "unlabeled_samples": len(float_unlabeled.label),
                "unlabeled_label_agreement": agreement,
                "float_mask_rate": float_unlabeled.mask_rate,
                "int8_mask_rate": int8_unlabeled.mask_rate,
                "mask_rate_change_points": 100.0 * (int8_unlabeled.mask_rate - float_unlabeled.mask_rate),
                "mask_agreement": float((float_unlabeled.mask == int8_unlabeled.mask).mean()),
            }
        )
    else:
        out["mask_rate_change_points"] = 100.0 * (int8_test.mask_rate - float_test.mask_rate)
    out["agreement_measured_on"] = where
    out["label_agreement"] = agreement
    failures = []
    if acc_f - acc_q > max_acc_drop + 1e-12:
        failures.append(
            f"test accuracy dropped {100 * (acc_f - acc_q):.2f} points "
            f"({100 * acc_f:.2f}% -> {100 * acc_q:.2f}%), more than {100 * max_acc_drop:.2f}"
        )
    if agreement < min_agreement:
        failures.append(
            f"pseudo-label agreement with the float model is {100 * agreement:.2f}% on {where} data, "
            f"below {100 * min_agreement:.2f}%"
        )
    out["passed"] = not failures
    out["failures"] = failures
    return out


# ---------------------------------------------------------------------------------------------
# artifacts


def file_sha256(path: str | Path) -> str:
    import hashlib

    h = hashlib.sha256()
    with open(path, "rb") as fh:
        for chunk in iter(lambda: fh.read(1 << 20), b""):
            h.update(chunk)
    return h.hexdigest()


def artifact_info(path: str | Path) -> dict[str, Any]:
    p = Path(path)
    return {"path": p.name, "bytes": os.path.getsize(p), "sha256": file_sha256(p)}
