"""One training step of cnn28 in float32 and under ``device_args.autocast: bf16`` (issue 15).

The model as ``fedml-ssfl run`` builds it (``device_args.memory_format: auto``, then
:func:`fedml_ssfl.models.precision.apply_precision`), a fixed random batch of 28x28 images, plain
SGD with momentum: forward, cross-entropy, ``zero_grad``, backward, step. The two precisions
alternate step by step after a warm-up, so a machine whose load drifts shifts both alike; the
figure is the median step time (CPU seconds of this process on a CPU, wall seconds with a CUDA
synchronisation on a GPU). Usage::

    python benchmarks/autocast_step.py [--device cpu|cuda] [--batch 64] [--steps 200] [--norms bn gn]
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

import torch  # noqa: E402
from step_timing import alternate  # noqa: E402  (benchmarks/step_timing.py)

from fedml_ssfl.bench import machine_info  # noqa: E402
from fedml_ssfl.models import build_model  # noqa: E402
from fedml_ssfl.models.layout import apply_layout  # noqa: E402
from fedml_ssfl.models.precision import AUTOCAST_CHOICES, apply_precision, check_autocast_device  # noqa: E402


def step_times(device: torch.device, norm: str, batch: int, steps: int, warmup: int = 5) -> dict[str, float]:
    """Median seconds of one training step per ``device_args.autocast`` choice."""
    gen = torch.Generator().manual_seed(0)
    x = torch.randn(batch, 1, 28, 28, generator=gen).to(device)
    y = torch.randint(0, 10, (batch,), generator=gen).to(device)
    runs = {}
    for choice in AUTOCAST_CHOICES:
        torch.manual_seed(0)
        model = build_model("cnn28", num_classes=10, in_channels=1, image_size=28, norm=norm)
        model = apply_precision(apply_layout(model, "auto", device.type), choice).to(device)
        runs[choice] = (model, torch.optim.SGD(model.parameters(), lr=0.01, momentum=0.9))
    return alternate(runs, x, y, steps, warmup)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--device", default="cpu", choices=("cpu", "cuda"))
    parser.add_argument("--batch", type=int, default=64)
    parser.add_argument("--steps", type=int, default=200, help="timed steps per precision (after 5 warm-up steps)")
    parser.add_argument("--norms", nargs="+", default=["bn", "gn"], choices=("bn", "gn", "none"))
    parser.add_argument("--threads", type=int, default=1, help="torch CPU threads (0: torch's default)")
    parser.add_argument("--json", default="", help="also write the figures to this file")
    args = parser.parse_args()
    if args.threads:
        torch.set_num_threads(args.threads)
    device = torch.device(args.device)
    problem = check_autocast_device("bf16", device)
    if problem or (device.type == "cuda" and not torch.cuda.is_available()):
        sys.exit(problem or "--device cuda: no CUDA device is visible")
    rows = []
    for norm in args.norms:
        t = step_times(device, norm, args.batch, args.steps)
        rows.append(
            {"norm": norm, "fp32_ms": 1e3 * t["off"], "bf16_ms": 1e3 * t["bf16"], "ratio": t["bf16"] / t["off"]}
        )
        print(
            f"cnn28-{norm}, batch {args.batch}, {device.type}: fp32 {rows[-1]['fp32_ms']:.2f} ms, "
            f"bf16 {rows[-1]['bf16_ms']:.2f} ms per step (bf16 / fp32 = {rows[-1]['ratio']:.2f}x)"
        )
    if args.json:
        info = machine_info(torch.get_num_threads())
        Path(args.json).write_text(json.dumps({"machine": info, "batch": args.batch, "rows": rows}, indent=2) + "\n")


if __name__ == "__main__":
    main()
