"""Edge side of fedml_ssfl: trained models to ONNX for on-device pseudo-labeling.

Two halves with different dependencies:

* :mod:`mobile_export.export` (with :mod:`.verify`, :mod:`.quantize`, :mod:`.graph` for the
  ONNX edits and :mod:`.ort_format` for the ORT files and the reduced-build operator config):
  torch -> ONNX, ORT format and int8, each verified. Needs torch and the project; runs where
  training ran. Its command-line options live in :mod:`mobile_export.arguments` (argparse only,
  so ``fedml-ssfl`` builds its parser without importing torch).
* :mod:`mobile_export.edge_label`: the on-device runner, and the edge contract (names, dtypes,
  version) the exporter writes. numpy + onnxruntime only (and Pillow if it reads image files); it
  can be copied to a device on its own.

This package imports nothing heavy on import, so ``python -m mobile_export.edge_label`` works
on a device without torch. The export names below load on first use.
"""

from __future__ import annotations

from typing import Any

_EXPORT_NAMES = {
    "EdgeMetadata",
    "EdgeModel",
    "ExportError",
    "ExportReport",
    "add_export_arguments",
    "export_model",
    "export_run",
    "run_export_from_args",
}
_EDGE_NAMES = {"EdgeInputError", "EdgeLabeler", "EnsembleState", "label_images", "load_images"}

__all__ = sorted(_EXPORT_NAMES | _EDGE_NAMES)


def __getattr__(name: str) -> Any:
    if name in _EXPORT_NAMES:
        from . import export

        return getattr(export, name)
    if name in _EDGE_NAMES:
        from . import edge_label

        return getattr(edge_label, name)
    raise AttributeError(f"module 'mobile_export' has no attribute {name!r}")
