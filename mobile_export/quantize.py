"""int8 static quantization of an edge graph: QDQ, per-channel, calibrated on client data.

What is quantized: the backbone (convolutions, residual adds, pooling, activations) with
uint8 activations and int8 per-channel weights (U8S8, the layout onnxruntime's CPU kernels
are fastest with). What stays float: the uint8 -> float normalization at the head, and the
classifier with the whole tail behind it (softmax, max/argmax, the threshold lookup and the
comparison), so probabilities and confidences are not rounded to 8 bits before thresholding.
"""

from __future__ import annotations

import tempfile
from collections.abc import Iterator
from pathlib import Path

import numpy as np

from .edge_label import INPUT_NAMES

QUANTIZED_OP_TYPES = ("Conv", "Gemm", "MatMul", "Add", "Relu", "MaxPool", "AveragePool", "GlobalAveragePool")
"""Operator types quantized in the backbone (everything else stays float)."""


def float_tail_nodes(model) -> list[str]:
    """Names of the nodes kept in float: the classifier feeding the softmax and all after it.

    Raises
    ------
    ValueError
        If the graph has no Softmax producing the ``probs`` output.
    """
    producers = {out: node for node in model.graph.node for out in node.output}
    probs = producers.get("probs")
    while probs is not None and probs.op_type in ("Identity", "Cast"):
        probs = producers.get(probs.input[0])
    if probs is None or probs.op_type != "Softmax":
        raise ValueError("the edge graph has no Softmax producing 'probs'; cannot find the float tail")
    logits = probs.input[0]
    classifier = producers.get(logits)
    keep = {classifier.name} if classifier is not None else set()
    frontier = {logits}
    changed = True
    while changed:  # every node downstream of the logits
        changed = False
        for node in model.graph.node:
            if node.name not in keep and any(i in frontier for i in node.input):
                keep.add(node.name)
                frontier.update(node.output)
                changed = True
    return sorted(keep)


class _Batches:
    """onnxruntime CalibrationDataReader over uint8 images (defined lazily, see :func:`quantize_int8`)."""

    def __init__(self, images: np.ndarray, batch_size: int):
        self.images, self.batch_size = images, batch_size
        self._it = self._batches()

    def _batches(self) -> Iterator[dict[str, np.ndarray]]:
        for s in range(0, len(self.images), self.batch_size):
            yield {INPUT_NAMES[0]: np.ascontiguousarray(self.images[s : s + self.batch_size])}

    def get_next(self):
        return next(self._it, None)

    def rewind(self) -> None:
        self._it = self._batches()


def quantize_int8(
    float_path: str | Path, out_path: str | Path, calibration_images: np.ndarray, batch_size: int = 64
) -> dict:
    """Quantize the float edge model at ``float_path`` into ``out_path`` (static QDQ, per-channel).

    Parameters
    ----------
    float_path, out_path : path
        The float ``.onnx`` and where the int8 ``.onnx`` goes.
    calibration_images : numpy.ndarray
        uint8 ``(N, C, H, W)`` client (unlabeled) images; activation ranges come from them (MinMax).
        The graph's constant thresholds are in the float tail, which stays float.

    Returns
    -------
    dict
        What was done: formats, calibration size, nodes kept in float, quantized op counts.
    """
    import onnx
    from onnxruntime.quantization import (
        CalibrationDataReader,
        CalibrationMethod,
        QuantFormat,
        QuantType,
        quantize_static,
    )
    from onnxruntime.quantization.shape_inference import quant_pre_process

    if len(calibration_images) == 0:
        raise ValueError("int8 calibration needs at least one client image")

    class Reader(_Batches, CalibrationDataReader):
        pass

    with tempfile.TemporaryDirectory(prefix="mobile_export_q_") as tmp:
        pre = Path(tmp) / "pre.onnx"
        try:  # shape inference + basic optimisation (folds BatchNorm into Conv), as ORT recommends
            quant_pre_process(str(float_path), str(pre))
        except Exception:  # symbolic shape inference cannot read every graph; ONNX's is enough here
            quant_pre_process(str(float_path), str(pre), skip_symbolic_shape=True)
        model = onnx.load(str(pre))
        for i, node in enumerate(model.graph.node):  # nodes_to_exclude works by name
            if not node.name:
                node.name = f"{node.op_type}_{i}"
        onnx.save(model, str(pre))
        keep_float = float_tail_nodes(model)
        quantize_static(
            str(pre),
            str(out_path),
            Reader(np.asarray(calibration_images, dtype=np.uint8), batch_size),
            quant_format=QuantFormat.QDQ,
            per_channel=True,
            activation_type=QuantType.QUInt8,
            weight_type=QuantType.QInt8,
            op_types_to_quantize=list(QUANTIZED_OP_TYPES),
            nodes_to_exclude=keep_float,
            calibrate_method=CalibrationMethod.MinMax,
            extra_options={"WeightSymmetric": True, "ActivationSymmetric": False},
        )
    qmodel = onnx.load(str(out_path))
    counts: dict[str, int] = {}
    for node in qmodel.graph.node:
        counts[node.op_type] = counts.get(node.op_type, 0) + 1
    return {
        "format": "QDQ",
        "weights": "int8 per-channel symmetric",
        "activations": "uint8 asymmetric (MinMax)",
        "calibration_samples": int(len(calibration_images)),
        "quantized_op_types": list(QUANTIZED_OP_TYPES),
        "kept_float": keep_float,
        "op_counts": counts,
    }
