"""benchmarks/ssfl_results.py: each labels-at-server row is compared with server_only under its own config."""

from __future__ import annotations

import importlib.util
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]


def _module():
    spec = importlib.util.spec_from_file_location("ssfl_results", ROOT / "benchmarks" / "ssfl_results.py")
    mod = importlib.util.module_from_spec(spec)
    sys.modules["ssfl_results"] = mod
    spec.loader.exec_module(mod)
    return mod


S = _module()


def _row(split: str, name: str):
    return next(r for r in S.ROWS if (r.split, r.name) == (split, name))


def test_every_server_row_has_the_reference_of_its_own_compare_config():
    server_rows = [r for r in S.ROWS if not r.idle and not r.reference and (r.split, r.name) in S.REF_OF]
    assert len(server_rows) >= 20
    for r in server_rows:
        ref = _row(r.split, S.REF_OF[(r.split, r.name)])
        assert S._compare_key(ref) == S._compare_key(r), (r.name, ref.name)
    # the naive baselines' compare config (plain SGD) is not server_only.yaml's
    fixmatch = S.REF_OF[("mnist5k", "fedavg_fixmatch")]
    assert fixmatch != "server_only"
    assert S.compare_config(_row("mnist5k", fixmatch)).train_args.momentum == 0.0


def test_vs_reference_cell_is_the_paired_difference_with_the_same_config_reference():
    ref = S.REF_OF[("mnist5k", "fedavg_fixmatch")]
    runs = [
        {"row": "server_only", "split": "mnist5k", "seed": 0, "labels": "server", "final_acc": 0.74},
        {"row": ref, "split": "mnist5k", "seed": 0, "labels": "server", "final_acc": 0.50, "reference": True},
        {"row": "fedavg_fixmatch", "split": "mnist5k", "seed": 0, "labels": "server", "final_acc": 0.70},
    ]
    for r in runs:
        r.update(best_acc=r["final_acc"], seconds_per_round=1.0, config="c", overrides=[])
    page = S.render({"machine": "m", "date": "d"}, runs, "")
    line = next(x for x in page.splitlines() if x.startswith("| fedavg_fixmatch |"))
    cells = [c.strip() for c in line.split("|")]
    assert cells[5] == "50.0" and cells[6] == "+20.0", line
    assert "| server_only, compare run of configs/mnist5k/fedavg_fixmatch.yaml (mnist5k) |" in page
