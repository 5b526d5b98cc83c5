"""`import fedml_ssfl` (and the local runtime, CLI) must work without importing fedml or mpi4py."""

from __future__ import annotations

import subprocess
import sys

CODE = """
import sys
import fedml_ssfl, fedml_ssfl.cli, fedml_ssfl.runtime.local, fedml_ssfl.algorithms
fedml_ssfl.algorithms.available_algorithms()
bad = [m for m in ("fedml", "mpi4py") if m in sys.modules]
print(bad)
sys.exit(1 if bad else 0)
"""


def test_package_import_is_free_of_fedml_and_mpi4py():
    res = subprocess.run([sys.executable, "-c", CODE], capture_output=True, text=True, timeout=120)
    assert res.returncode == 0, res.stdout + res.stderr


def test_the_command_line_module_imports_no_heavy_package():
    """`import fedml_ssfl.cli` and building its parser stay free of every package in HEAVY_MODULES."""
    from fedml_ssfl.bench import HEAVY_MODULES

    code = (
        "import sys, fedml_ssfl.cli\n"
        "fedml_ssfl.cli.build_parser()\n"
        f"print([m for m in {HEAVY_MODULES!r} if m in sys.modules])\n"
    )
    res = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert res.returncode == 0, res.stderr
    assert res.stdout.strip() == "[]", res.stdout


def test_the_run_path_up_to_the_first_round_imports_no_heavy_package(tmp_path):
    """`fedml-ssfl run` (the main job's MNIST-5k data, TensorBoard off) reaches its first round without
    importing onnx, onnxruntime, fedml, mpi4py, matplotlib, tensorboard, torchvision, scikit-learn,
    scipy, pandas or mlxtend: each costs a second or so of start-up (issue 15) and is imported where used."""
    from fedml_ssfl.bench import first_round_seconds

    out = first_round_seconds(
        None,
        [
            f"common_args.output_dir={tmp_path}",
            "tracking_args.enable_tensorboard=false",
            "train_args.comm_round=1",
            "common_args.compare_with=[]",
        ],
        env={"OMP_NUM_THREADS": "1"},
    )
    assert "torch" in out["modules"] and "fedml_ssfl" in out["modules"]  # it got as far as the round
    assert out["heavy"] == [], f"imported before the first round: {out['heavy']}"
