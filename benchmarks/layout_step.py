"""One training step in NCHW and in channels_last (NHWC), for ``device_args.memory_format: auto`` (issue 15).

For each model, normalisation, batch and image size: forward, cross-entropy, ``zero_grad``,
backward and an SGD step with momentum on a fixed random batch, the two layouts alternating step by
step after 3 warm-up steps, so a machine whose load drifts shifts both alike. The figure is each
layout's median CPU seconds per step (one torch thread by default) and NHWC / NCHW. Usage::

    python benchmarks/layout_step.py [--steps 20] [--json benchmarks/results/layout_step.json]
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
from fedml_ssfl.models.layout import apply_layout, resolve_layout  # noqa: E402

CASES = (  # model, norm, batch, channels, side
    ("cnn28", "bn", 64, 1, 28),
    ("cnn28", "gn", 64, 1, 28),
    ("resnet18", "bn", 8, 3, 32),
    ("resnet18", "bn", 32, 3, 32),
    ("resnet18", "bn", 8, 3, 16),
    ("resnet18", "gn", 8, 3, 32),
    ("wrn28_2", "bn", 32, 3, 32),
)


def step_ms(model_name: str, norm: str, batch: int, channels: int, side: int, steps: int) -> dict[str, float]:
    """Median CPU milliseconds per training step in each layout."""
    gen = torch.Generator().manual_seed(0)
    x = torch.randn(batch, channels, side, side, generator=gen)
    y = torch.randint(0, 10, (batch,), generator=gen)
    runs = {}
    for layout in ("contiguous", "channels_last"):
        torch.manual_seed(0)
        model = build_model(model_name, num_classes=10, in_channels=channels, image_size=side, norm=norm)
        model = apply_layout(model, layout, "cpu")
        runs[layout] = (model, torch.optim.SGD(model.parameters(), lr=0.01, momentum=0.9))
    return {layout: 1e3 * t for layout, t in alternate(runs, x, y, steps, warmup=3).items()}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--steps", type=int, default=20, help="timed steps per layout (after 3 warm-up steps)")
    parser.add_argument("--threads", type=int, default=1, help="torch CPU threads (0: torch's default)")
    parser.add_argument("--json", default="", help="also write the figures to this file")
    args = parser.parse_args()
    if args.threads:
        torch.set_num_threads(args.threads)
    rows = []
    for model_name, norm, batch, channels, side in CASES:
        ms = step_ms(model_name, norm, batch, channels, side, args.steps)
        model = build_model(model_name, num_classes=10, in_channels=channels, image_size=side, norm=norm)
        auto = "channels_last" if resolve_layout("auto", model) == torch.channels_last else "contiguous"
        row = {"model": f"{model_name}-{norm}", "batch": batch, "shape": [channels, side, side], "auto": auto}
        rows.append(row | {"nchw_ms": ms["contiguous"], "nhwc_ms": ms["channels_last"]})
        print(
            f"{row['model']}, batch {batch}, {channels}x{side}x{side}: NCHW {ms['contiguous']:.1f} ms, NHWC "
            f"{ms['channels_last']:.1f} ms (NHWC / NCHW {ms['channels_last'] / ms['contiguous']:.3f}); auto: {auto}",
            flush=True,
        )
    if args.json:
        info = machine_info(torch.get_num_threads())
        Path(args.json).write_text(json.dumps({"machine": info, "steps": args.steps, "rows": rows}, indent=2) + "\n")


if __name__ == "__main__":
    main()
