"""Wall time and result of the default main job, `fedml-ssfl run` with no arguments.

Writes ``benchmarks/results/default_job.json``: wall seconds (whole command, including the
server-only comparison run), the accuracies of both rows, and the machine. ``--set`` passes
config overrides on (e.g. ``device_args.autocast=bf16``, with ``--out`` naming another file).
Usage::

    python benchmarks/default_job.py [--threads 1] [--set SECTION.KEY=VALUE ...] [--out PATH]
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import shutil
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--threads", type=int, default=1, help="CPU threads for torch (default 1, as in the config)")
    parser.add_argument("--out", default=str(ROOT / "benchmarks" / "results" / "default_job.json"))
    parser.add_argument(
        "--set", action="append", default=[], metavar="SECTION.KEY=VALUE", help="a config override (repeatable)"
    )
    args = parser.parse_args(argv)
    exe = shutil.which("fedml-ssfl", path=str(Path(sys.executable).parent)) or "fedml-ssfl"
    with tempfile.TemporaryDirectory() as tmp:
        env = {**os.environ, "OMP_NUM_THREADS": str(args.threads)}
        cmd = [
            exe,
            "run",
            "--set",
            f"common_args.output_dir={tmp}",
            "--set",
            "tracking_args.progress_bar=false",
            "--set",
            f"device_args.num_threads={args.threads}",
        ]
        for override in args.set:
            cmd += ["--set", override]
        t0 = time.perf_counter()
        res = subprocess.run(cmd, capture_output=True, text=True, env=env)
        wall = time.perf_counter() - t0
        if res.returncode != 0:
            print(res.stdout, res.stderr, file=sys.stderr)
            return res.returncode
        summaries = {}
        for path in Path(tmp).rglob("summary.json"):
            s = json.loads(path.read_text())
            summaries[s["algorithm"]] = {k: s[k] for k in ("final_test_acc", "best_test_acc", "seconds_per_round")}
    out = {
        "command": " ".join(["fedml-ssfl run", *(f"--set {o}" for o in args.set)]),
        "wall_seconds": wall,
        "threads": args.threads,
        "machine": f"{platform.machine()}, {os.cpu_count()} cores",
        "date": time.strftime("%Y-%m-%d %H:%M"),
        "runs": summaries,
        "table": res.stdout.strip().splitlines()[-5:],
    }
    Path(args.out).parent.mkdir(parents=True, exist_ok=True)
    Path(args.out).write_text(json.dumps(out, indent=2) + "\n")
    print(json.dumps(out, indent=2))
    return 0


if __name__ == "__main__":
    sys.exit(main())
