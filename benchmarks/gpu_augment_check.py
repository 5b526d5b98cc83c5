"""Augmentation on a device matches the CPU for the same generator state, and how fast it runs there.

For each shape (the main job's 1x28x28 and CIFAR's 3x32x32) a batch of 8-bit images is augmented
weakly and strongly on the CPU and on ``--device`` from the same seeds; the figures are the largest
absolute difference and the milliseconds per call on the device (the batch already there, a CUDA
synchronisation after each call, median of ``--repeats``). On a GPU the two can differ by float
rounding only: the random draws are made on the CPU either way, and equalize counts its CDF by
sorting there (deterministic) instead of the CPU's histogram (the same integers). Usage::

    python benchmarks/gpu_augment_check.py    # cuda; writes benchmarks/results/gpu_augment_check.json
    python benchmarks/gpu_augment_check.py --device cpu --batch 8 --repeats 2 --json /tmp/check.json

Exit status 0 when every difference is below ``--tolerance``, 2 otherwise, 1 without the device.
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from fedml_ssfl.bench import machine_info  # noqa: E402
from fedml_ssfl.data.augment import strong_augment, weak_augment  # noqa: E402

SHAPES = ((1, 28, True), (3, 32, True))  # (channels, side, flip): flips off for digits in the runs, on here


def check(device: torch.device, batch: int, repeats: int) -> list[dict]:
    """One row per shape and view: the largest difference from the CPU, and ms per call on ``device``."""
    rows = []
    for channels, side, flip in SHAPES:
        gen = torch.Generator().manual_seed(0)
        x = torch.randint(0, 256, (batch, channels, side, side), generator=gen).float() / 255
        on_device = x.to(device)
        for view, fn in (("weak", weak_augment), ("strong", strong_augment)):
            cpu = fn(x, torch.Generator().manual_seed(1), flip=flip)
            there = fn(on_device, torch.Generator().manual_seed(1), flip=flip)
            times = []
            for r in range(repeats):
                t0 = time.perf_counter()
                fn(on_device, torch.Generator().manual_seed(2 + r), flip=flip)
                if device.type == "cuda":
                    torch.cuda.synchronize(device)
                times.append(time.perf_counter() - t0)
            rows.append(
                {
                    "shape": [batch, channels, side, side],
                    "view": view,
                    "max_abs_diff": float((there.cpu() - cpu).abs().max()),
                    "ms_per_call": 1e3 * statistics.median(times),
                }
            )
    return rows


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--device", default="cuda")
    parser.add_argument("--batch", type=int, default=256)
    parser.add_argument("--repeats", type=int, default=20)
    parser.add_argument("--tolerance", type=float, default=1e-3)
    parser.add_argument("--json", default=str(ROOT / "benchmarks" / "results" / "gpu_augment_check.json"))
    args = parser.parse_args()
    device = torch.device(args.device)
    if device.type == "cuda" and not torch.cuda.is_available():
        print("--device cuda: no CUDA device is visible: nothing to check")
        return 1
    rows = check(device, args.batch, args.repeats)
    for r in rows:
        shape = tuple(r["shape"])
        print(f"{r['view']:6} {shape}: max |diff| {r['max_abs_diff']:.2e}, {r['ms_per_call']:.2f} ms per call")
    info = machine_info(torch.get_num_threads())
    if device.type == "cuda":
        info["gpu"] = torch.cuda.get_device_name(device)
    path = Path(args.json)
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps({"machine": info, "device": str(device), "rows": rows}, indent=2) + "\n")
    return 0 if all(r["max_abs_diff"] < args.tolerance for r in rows) else 2


if __name__ == "__main__":
    sys.exit(main())
