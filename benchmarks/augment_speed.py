"""CPU cost of the weak and strong views per batch (issue 15): ``weak_augment`` and ``strong_augment``
on float 28x28 grey and 32x32 RGB batches, as the rounds call them.

Median CPU milliseconds of this process per call over ``--repeats`` calls (one torch thread), for a
few batch sizes; the random draws come from one seeded generator. Run it in another checkout to
compare versions (``--label`` names the row set). Usage::

    python benchmarks/augment_speed.py [--repeats 200] [--label NAME] [--out benchmarks/results/augment_speed.json]

``--out`` is merged: rows of other labels already in the file are kept.
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

import torch  # noqa: E402

from fedml_ssfl.bench import machine_info  # noqa: E402
from fedml_ssfl.data.augment import strong_augment, weak_augment  # noqa: E402

CASES = [((n, 1, 28, 28), False) for n in (10, 64, 256)] + [((64, 3, 32, 32), True)]


def median_ms(fn, repeats: int) -> float:
    for _ in range(10):
        fn()
    times = []
    for _ in range(repeats):
        start = time.process_time()
        fn()
        times.append((time.process_time() - start) * 1e3)
    return statistics.median(times)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--repeats", type=int, default=200)
    parser.add_argument("--label", default="current")
    parser.add_argument("--out", type=Path, default=ROOT / "benchmarks" / "results" / "augment_speed.json")
    args = parser.parse_args()
    torch.set_num_threads(1)
    gen = torch.Generator().manual_seed(0)
    rows = []
    for shape, flip in CASES:
        x = torch.rand(shape, generator=torch.Generator().manual_seed(1))
        row = {
            "label": args.label,
            "shape": list(shape),
            "weak_ms": median_ms(lambda x=x, flip=flip: weak_augment(x, gen, flip=flip), args.repeats),
            "strong_ms": median_ms(lambda x=x, flip=flip: strong_augment(x, gen, flip=flip), args.repeats),
        }
        rows.append(row)
        print(json.dumps(row))
    old = json.loads(args.out.read_text()) if args.out.exists() else {"rows": []}
    kept = [r for r in old["rows"] if r["label"] != args.label]
    machines = {**old.get("machines", {}), args.label: machine_info(1)}
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps({"machines": machines, "rows": kept + rows}, indent=2) + "\n")
    print(f"wrote {args.out}")


if __name__ == "__main__":
    main()
