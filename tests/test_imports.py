"""`import fedml_ssfl` (and the local runtime, CLI) must work without importing fedml or mpi4py."""

from __future__ import annotations

import json
import math
import os
import subprocess
import sys

import pytest

from fedml_ssfl.tracking import FINAL_METRICS, metric_tag, read_metrics
from tests.conftest import SMALL

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
    """`import fedml_ssfl.cli` and building its parser stay free of every package in HEAVY_MODULES,
    and of torch: `fedml-ssfl --help` and `list` answer in a fraction of a second (the export
    command's options come from mobile_export.arguments, not mobile_export.export)."""
    from fedml_ssfl.bench import HEAVY_MODULES

    code = (
        "import sys, fedml_ssfl.cli\n"
        "fedml_ssfl.cli.build_parser()\n"
        f"print([m for m in {(*HEAVY_MODULES, 'torch')!r} if m in sys.modules])\n"
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


TENSORBOARD_AT_FIRST_ROUND = """
import json, sys
import fedml_ssfl.runtime.local as local

real, seen = local.run_round, []

def run_round(*args, **kwargs):
    if not seen:  # the first round starts: which TensorBoard modules are loaded by now
        seen.append(sorted(m for m in sys.modules if m.split(".")[0] == "tensorboard" or "tensorboard" in m))
    return real(*args, **kwargs)

local.run_round = run_round
from fedml_ssfl.cli import main
status = main(["run", *sys.argv[1:]])
print("TENSORBOARD_AT_FIRST_ROUND", json.dumps(seen[0]))
sys.exit(status)
"""


def test_tensorboard_is_imported_after_the_first_round_and_still_gets_every_tag(tmp_path):
    """With TensorBoard on, the run's writer is made when round 1 is logged (issue 15: its import,
    0.3 to 1 s, is off the path to the first round), and the event files hold what an eager writer
    wrote: one scalar tag per numeric metrics.jsonl key at each round's step, the final metrics, the
    config text at step 0 and the hparams session."""
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    sets = [*SMALL, "tracking_args.enable_tensorboard=true", f"common_args.output_dir={tmp_path}"]
    res = subprocess.run(
        [sys.executable, "-c", TENSORBOARD_AT_FIRST_ROUND, *(x for s in sets for x in ("--set", s))],
        capture_output=True,
        text=True,
        timeout=300,
        env={**os.environ, "OMP_NUM_THREADS": "1"},
    )
    assert res.returncode == 0, res.stdout + res.stderr
    line = next(ln for ln in res.stdout.splitlines() if ln.startswith("TENSORBOARD_AT_FIRST_ROUND"))
    assert json.loads(line.split(" ", 1)[1]) == [], f"imported before the first round: {line}"

    (run_dir,) = [p for p in tmp_path.iterdir() if p.is_dir()]
    rows = read_metrics(run_dir / "metrics.jsonl")
    summary = json.loads((run_dir / "summary.json").read_text())
    assert [r["round"] for r in rows] == [1, 2]
    assert len(list((run_dir / "tb").glob("events.out.tfevents.*"))) == 2  # the run's, and the hparams session's
    events = EventAccumulator(str(run_dir / "tb"), size_guidance={"scalars": 0, "tensors": 0})
    events.Reload()
    per_round = {metric_tag(k) for r in rows for k, v in r.items() if k != "round" and _numeric(v)}
    final = {metric_tag(k) for k in FINAL_METRICS if _numeric(summary.get(k))}
    assert {"test/acc", "comm/bytes_up", "client/loss", "algo/lr"} <= per_round
    assert set(events.Tags()["scalars"]) == per_round | final
    for tag in per_round - final:
        assert [e.step for e in events.Scalars(tag)] == [1, 2], tag
    assert [e.value for e in events.Scalars("test/acc")] == pytest.approx([r["test_acc"] for r in rows])
    (config,) = events.Tensors("config/text_summary")
    assert config.step == 0 and "comm_round: 2" in config.tensor_proto.string_val[0].decode()
    assert "_hparams_/session_start_info" in events.PluginTagToContent("hparams")


def _numeric(value) -> bool:
    return isinstance(value, (int, float)) and not isinstance(value, bool) and math.isfinite(value)
