"""Checks every exported model goes through: ONNX checker, ORT-mobile usability, parity, ORT format.

Nothing here imports torch: the torch side of a parity check arrives as numpy arrays
(:class:`Predictions`), so the same functions check a float model against torch and an int8
model against the float one.
"""

from __future__ import annotations

import io
import logging
import os
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np

from .edge_label import INPUT_NAMES, OUTPUT_NAMES  # the edge contract, defined once (that file runs alone)

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


def run_session(session, images: np.ndarray, thresholds: np.ndarray, batch_size: int = 256) -> Predictions:
    """Run the edge graph over ``images`` in batches."""
    parts: list[list[np.ndarray]] = [[], [], [], []]
    thr = np.asarray(thresholds, dtype=np.float32)
    for start in range(0, len(images), batch_size):
        out = session.run(list(OUTPUT_NAMES), dict(zip(INPUT_NAMES, (images[start : start + batch_size], thr))))
        for acc, arr in zip(parts, out):
            acc.append(arr)
    if not parts[0]:
        k = len(thr)
        return Predictions(np.zeros((0, k), np.float32), np.zeros(0, np.int64), np.zeros(0, np.float32),
                           np.zeros(0, bool))
    probs, label, conf, mask = (np.concatenate(p) for p in parts)
    return Predictions(probs.astype(np.float32), label.astype(np.int64), conf.astype(np.float32), mask.astype(bool))


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


def mobile_usability(path: str | Path, report_path: str | Path) -> dict[str, Any]:
    """onnxruntime's ORT-mobile usability check; its log is saved to ``report_path``.

    The check is advisory (it says whether NNAPI / CoreML would take the model, and which ops
    keep a model on the CPU execution provider); it fails only if it cannot analyse the model.
    """
    from onnxruntime.tools.mobile_helpers import usability_checker

    buf = io.StringIO()
    logger = logging.getLogger(f"mobile_export.usability.{Path(path).name}")
    logger.setLevel(logging.INFO)
    logger.propagate = False
    handler = logging.StreamHandler(buf)
    handler.setFormatter(logging.Formatter("%(levelname)s: %(message)s"))
    logger.addHandler(handler)
    try:
        try_eps = bool(usability_checker.analyze_model(Path(path), skip_optimize=False, logger=logger))
        error = None
    except Exception as exc:  # the checker's own failures
        try_eps, error = False, f"{type(exc).__name__}: {exc}"
        logger.error("usability check could not analyse the model: %s", error)
    finally:
        logger.removeHandler(handler)
    text = buf.getvalue()
    Path(report_path).write_text(text, encoding="utf-8")
    verdict = ("NNAPI or CoreML may help; compare them against the CPU EP" if try_eps
               else "use the CPU execution provider")
    return {"passed": error is None, "error": error, "report": str(report_path), "recommendation": verdict}


def compare_float(reference: Predictions, got: Predictions, rtol: float = PROB_RTOL,
                  atol: float = PROB_ATOL) -> dict[str, Any]:
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


def compare_int8(float_test: Predictions, int8_test: Predictions, test_labels: np.ndarray,
                 float_unlabeled: Predictions | None, int8_unlabeled: Predictions | None,
                 max_acc_drop: float, min_agreement: float) -> dict[str, Any]:
    """The int8 gates: test accuracy drop, pseudo-label agreement, mask-rate movement.

    Agreement is measured on client (unlabeled) data where given, as that is where
    pseudo-labels are made, and always reported on the test set too. The gate uses the
    unlabeled figure when there is one, else the test figure.
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
        where = "client_unlabeled"
        out.update({
            "unlabeled_samples": len(float_unlabeled.label),
            "unlabeled_label_agreement": agreement,
            "float_mask_rate": float_unlabeled.mask_rate,
            "int8_mask_rate": int8_unlabeled.mask_rate,
            "mask_rate_change_points": 100.0 * (int8_unlabeled.mask_rate - float_unlabeled.mask_rate),
            "mask_agreement": float((float_unlabeled.mask == int8_unlabeled.mask).mean()),
        })
    else:
        out["mask_rate_change_points"] = 100.0 * (int8_test.mask_rate - float_test.mask_rate)
    out["agreement_measured_on"] = where
    out["label_agreement"] = agreement
    failures = []
    if acc_f - acc_q > max_acc_drop + 1e-12:
        failures.append(f"test accuracy dropped {100 * (acc_f - acc_q):.2f} points "
                        f"({100 * acc_f:.2f}% -> {100 * acc_q:.2f}%), more than {100 * max_acc_drop:.2f}")
    if agreement < min_agreement:
        failures.append(f"pseudo-label agreement with the float model is {100 * agreement:.2f}% on {where} data, "
                        f"below {100 * min_agreement:.2f}%")
    out["passed"] = not failures
    out["failures"] = failures
    return out


# ---------------------------------------------------------------------------------------------
# ORT format


def convert_to_ort(onnx_path: str | Path, ort_path: str | Path, target_platform: str = "arm") -> Path:
    """Save ``onnx_path`` in ORT format (``.ort``) for ORT-mobile runtimes.

    Fully optimised (level "all", as onnxruntime's ``convert_onnx_models_to_ort`` does), but
    without the x86-only NCHWc layout transformer unless ``target_platform == "amd64"``, so
    the file runs on ARM phones and x86 hosts alike.
    """
    import onnxruntime as ort

    ort_path = Path(ort_path)
    so = ort.SessionOptions()
    so.graph_optimization_level = ort.GraphOptimizationLevel.ORT_ENABLE_ALL
    so.optimized_model_filepath = str(ort_path)
    so.add_session_config_entry("session.save_model_format", "ORT")
    so.log_severity_level = 3
    disabled = [] if target_platform == "amd64" else ["NchwcTransformer"]
    ort.InferenceSession(str(onnx_path), sess_options=so, providers=["CPUExecutionProvider"],
                         disabled_optimizers=disabled)
    if not ort_path.is_file():
        raise RuntimeError(f"onnxruntime did not write {ort_path}")
    return ort_path


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
