"""Time to first round of ``fedml-ssfl run`` (issue 15): wall seconds from starting the command to the
start of its first round, in a fresh interpreter each time, and what was imported by then.

Cases: the main job (``fedml-ssfl run``, MNIST-5k, TensorBoard on) and a tiny digits config with
TensorBoard off. Each is run ``--repeats`` times (median reported), then once more under
``python -X importtime`` for the slowest top-level imports. Writes
``benchmarks/results/first_round.json``. Usage::

    python benchmarks/first_round.py [--repeats 5]
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import tempfile
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from fedml_ssfl.bench import first_round_seconds, machine_info  # noqa: E402

CASES = {
    "main job (mnist5k, TensorBoard on)": (None, []),
    "tiny (digits, TensorBoard off)": (
        None,
        [
            "data_args.dataset=digits",
            "train_args.client_num_in_total=2",
            "train_args.client_num_per_round=2",
            "tracking_args.enable_tensorboard=false",
        ],
    ),
}


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--repeats", type=int, default=5)
    p.add_argument("--python", default=None, help="the interpreter to time (default: this one)")
    args = p.parse_args(argv)
    env = {"PYTHONPATH": str(ROOT) + os.pathsep + os.environ.get("PYTHONPATH", ""), "OMP_NUM_THREADS": "1"}
    out: dict = {"machine": machine_info(1), "cases": {}}
    with tempfile.TemporaryDirectory() as tmp:
        for name, (config, overrides) in CASES.items():
            sets = [*overrides, "train_args.comm_round=1", "common_args.compare_with=[]"]
            sets.append(f"common_args.output_dir={tmp}")
            times = [
                first_round_seconds(config, sets, env=env, python=args.python)["seconds"] for _ in range(args.repeats)
            ]
            detail = first_round_seconds(config, sets, importtime=True, env=env, python=args.python)
            out["cases"][name] = {
                "seconds": statistics.median(times),
                "runs": times,
                "heavy_imported": detail["heavy"],
                "slowest_imports_ms": {k: v / 1000 for k, v in detail["imports_us"].items()},
                "overrides": sets[:-1],
            }
            print(f"{name}: {statistics.median(times):.2f} s (runs {', '.join(f'{t:.2f}' for t in times)})")
            print("  heavy imported:", detail["heavy"] or "none")
            print("  slowest imports (ms):", {k: round(v / 1000) for k, v in list(detail["imports_us"].items())[:8]})
    out["machine"]["loadavg_end"] = list(os.getloadavg())
    path = ROOT / "benchmarks" / "results" / "first_round.json"
    path.write_text(json.dumps(out, indent=1) + "\n", encoding="utf-8")
    print(f"results: {path}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
