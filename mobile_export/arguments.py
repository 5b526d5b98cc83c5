"""The ``export`` command's arguments and their defaults (``fedml-ssfl export``, ``python -m mobile_export export``).

argparse only: ``fedml-ssfl`` builds every subcommand's parser at start, and importing
:mod:`mobile_export.export` (torch, numpy and the ONNX helpers) there would put its cost on every
command, ``fedml-ssfl run`` and ``--help`` included (issue 15). :mod:`mobile_export.export`
re-exports these names.
"""

from __future__ import annotations

import argparse

DEFAULT_OPSET = 18
DEFAULT_PARITY_SAMPLES = 1000
DEFAULT_CALIBRATION_SAMPLES = 256
MAX_ACC_DROP = 0.01
"""int8 gate: test accuracy may drop at most this much (1 point)."""
MIN_AGREEMENT = 0.98
"""int8 gate: pseudo-labels must agree with the float model's on at least this fraction."""
DEFAULT_WEIGHTS = "global_state"
DEFAULT_ORT_BATCH = 1
"""Batch size the ``.ort`` files are fixed to by default (NNAPI / CoreML need fixed shapes; a phone labels
one image at a time). 0 keeps the batch dynamic."""


def add_export_arguments(parser: argparse.ArgumentParser) -> argparse.ArgumentParser:
    """Add the ``export`` subcommand's arguments to ``parser``."""
    parser.add_argument("source", help="a run directory (checkpoints/last.pt + config.yaml) or a checkpoint file")
    parser.add_argument("--out", help="output directory (default: RUN_DIR/export)")
    parser.add_argument("--opset", type=int, default=DEFAULT_OPSET, help=f"ONNX opset (default {DEFAULT_OPSET})")
    parser.add_argument(
        "--threshold",
        dest="thresholds",
        type=float,
        nargs="+",
        metavar="TAU",
        help="default thresholds: one tau for every class, or one per class "
        "(default: the checkpoint's class-wise ones, else ssfl_args.threshold, else 0.95)",
    )
    parser.add_argument("--no-int8", dest="quantize", action="store_false", help="skip the int8 model and its gates")
    parser.add_argument(
        "--parity-samples",
        type=int,
        default=None,
        help=f"test images for parity and gates (default {DEFAULT_PARITY_SAMPLES}; 0 = all)",
    )
    parser.add_argument(
        "--calibration-samples",
        type=int,
        default=DEFAULT_CALIBRATION_SAMPLES,
        help=f"client images for int8 calibration (default {DEFAULT_CALIBRATION_SAMPLES})",
    )
    parser.add_argument(
        "--weights",
        default=DEFAULT_WEIGHTS,
        metavar="KEY",
        help="which model in the checkpoint's algorithm state (default: global_state; "
        "e.g. group_states.1 for a FedAvg-SSL group model)",
    )
    parser.add_argument(
        "--batch-size",
        type=int,
        default=DEFAULT_ORT_BATCH,
        metavar="N",
        help=f"fix the batch of the .ort files to N (default {DEFAULT_ORT_BATCH}: NNAPI and CoreML "
        "need fixed shapes; 0 keeps it dynamic); the .onnx files keep a dynamic batch",
    )
    parser.add_argument(
        "--model",
        dest="model_spec",
        default="",
        metavar="MODULE:NAME",
        help="a FedML script's run: the class (or a function) building its model with no arguments "
        "(default: the class the checkpoint records, imported from the script's folder)",
    )
    parser.add_argument(
        "--data",
        default="",
        metavar="PATH",
        help="a FedML script's run: labeled test images (.npz or class folders) for the parity checks, the int8 "
        "calibration and gates (the run keeps none of the script's data)",
    )
    parser.add_argument(
        "--legacy-exporter", dest="dynamo", action="store_false", help="use the TorchScript exporter instead of dynamo"
    )
    parser.add_argument(
        "--max-acc-drop",
        type=float,
        default=100 * MAX_ACC_DROP,
        help="int8 gate: largest test accuracy drop, in points (default 1)",
    )
    parser.add_argument(
        "--min-agreement",
        type=float,
        default=100 * MIN_AGREEMENT,
        help="int8 gate: smallest pseudo-label agreement with the float model, in %% (default 98)",
    )
    return parser
