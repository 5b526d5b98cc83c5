"""On a CUDA machine: augmentation on the GPU matches the CPU for the same generator state.

Run where a GPU exists (CI has none): ``python benchmarks/gpu_augment_check.py``. Writes
``benchmarks/results/gpu_augment_check.json`` with the max difference and the timings.
"""

from __future__ import annotations

import json
import sys
import time
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from fedml_ssfl.data.augment import strong_augment, weak_augment  # noqa: E402


def main() -> int:
    if not torch.cuda.is_available():
        print("no CUDA device: nothing to check")
        return 1
    x = torch.rand(256, 3, 32, 32)
    out = {}
    for name, fn in (
        ("weak", lambda t, g: weak_augment(t, g, flip=True)),
        ("strong", lambda t, g: strong_augment(t, g, flip=True)),
    ):
        cpu = fn(x, torch.Generator().manual_seed(1))
        gpu = fn(x.cuda(), torch.Generator().manual_seed(1))
        torch.cuda.synchronize()
        t0 = time.perf_counter()
        for _ in range(20):
            fn(x.cuda(), torch.Generator().manual_seed(1))
        torch.cuda.synchronize()
        out[name] = {
            "max_abs_diff": float((gpu.cpu() - cpu).abs().max()),
            "ms_per_batch_256_gpu": (time.perf_counter() - t0) / 20 * 1000,
        }
    out["device"] = torch.cuda.get_device_name()
    path = ROOT / "benchmarks" / "results" / "gpu_augment_check.json"
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps(out, indent=2) + "\n")
    print(json.dumps(out, indent=2))
    return 0 if all(v["max_abs_diff"] < 1e-3 for k, v in out.items() if k != "device") else 2


if __name__ == "__main__":
    sys.exit(main())
