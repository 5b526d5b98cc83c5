"""What refusing each bad data file of issue 29 costs: peak resident growth and seconds, per file.

Runs the rows of ``tests/test_inputs.py``'s ``MEMORY_CASES`` (a label of 10**9, -1 saved as
uint32, a zip bomb, an npz header claiming 5.8 TiB, 12000x12000 and 400-megapixel PNGs, a deployed
server's label of 10**9) through ``fedml-ssfl`` in one fresh process, each call after the
process's address space is capped at its size plus ``--headroom-mib`` (``RLIMIT_AS``, as the test
does; the default input limit is then a quarter of the headroom), and records per row the exit
status, the error line, the peak resident growth (``VmHWM`` after ``/proc/self/clear_refs``) and
the wall seconds. Writes ``benchmarks/results/input_memory.json``.

Usage::

    python benchmarks/input_memory.py                     # 400 MiB of headroom, as the test
    python benchmarks/input_memory.py --headroom-mib 2048
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import sys
import tempfile
from datetime import UTC, datetime
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

from tests.conftest import run_bounded  # noqa: E402  (the bounded child the tests use)
from tests.test_inputs import MEMORY_CASES, PRELOAD  # noqa: E402


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--headroom-mib", type=int, default=400, help="address space each call may add (default 400)")
    ap.add_argument("--out", type=Path, default=ROOT / "benchmarks" / "results" / "input_memory.json")
    args = ap.parse_args()
    rows = []
    with tempfile.TemporaryDirectory(prefix="input_memory-") as tmp:
        calls = []
        for n, (_, dataset, make, _, _) in enumerate(MEMORY_CASES):
            data = Path(tmp) / f"data{n}"
            made = make(data)
            argv = made or ["run", "--set", f"data_args.dataset={dataset}", "--set", f"data_args.data_cache_dir={data}"]
            argv += [
                "--set",
                f"common_args.output_dir={Path(tmp) / 'runs'}",
                "--set",
                "tracking_args.progress_bar=false",
            ]
            calls.append(f"__import__('fedml_ssfl.cli').cli.main({argv!r})")
        sizes = {
            n: sum(f.stat().st_size for f in (Path(tmp) / f"data{n}").rglob("*") if f.is_file())
            for n in range(len(calls))
        }
        results = run_bounded(PRELOAD, calls, headroom=args.headroom_mib * 2**20)
        for n, ((name, *_), res) in enumerate(zip(MEMORY_CASES, results)):
            line = res.err.strip().splitlines()[-1] if res.err.strip() else ""
            rows.append(
                {
                    "case": name,
                    "file_bytes": sizes[n],
                    "exit_status": res.code,
                    "peak_rss_growth_mib": round(res.peak_growth / 2**20, 2),
                    "seconds": round(res.seconds, 3),
                    "error": line,
                }
            )
            print(f"{name:<36} exit {res.code}  +{res.peak_growth / 2**20:7.2f} MiB  {res.seconds:6.3f} s")
    out = {
        "script": "benchmarks/input_memory.py",
        "command": " ".join(["python", "benchmarks/input_memory.py", *sys.argv[1:]]),
        "date": datetime.now(UTC).isoformat(timespec="seconds"),
        "machine": {"platform": platform.platform(), "cpus": os.cpu_count(), "load_1min": os.getloadavg()[0]},
        "headroom_mib": args.headroom_mib,
        "rows": rows,
    }
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps(out, indent=2) + "\n", encoding="utf-8")
    print(f"wrote {args.out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
