"""Evaluation speed against its batch size (issue 30): CPU seconds per 1,000 test images.

For each shipped model at its input size (cnn28 with GroupNorm and with BatchNorm, FedSiam's MNIST
and CIFAR CNNs, the EMNIST CNN, WRN-28-2 at 32x32), in NCHW and in channels_last (the layout set on
the weights and the inputs as ``device_args.memory_format`` sets it), the package's own evaluation
(:func:`fedml_ssfl.metrics.evaluate`: uint8 images in, the plain input pipeline, inference mode)
runs over ``--images`` random images at each batch size. The batch sizes and layouts alternate
within each repeat, so a machine whose load drifts shifts them alike; the figure is each one's
median over ``--repeats`` (CPU seconds of this process, one torch thread by default, scaled to
1,000 images), with wall seconds beside it. Usage::

    python benchmarks/eval_batch.py [--repeats 5] [--models wrn28_2-bn ...] [--out benchmarks/results/eval_batch.json]

``--out`` is merged by model row: rows of models not measured this time are kept.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

import torch  # noqa: E402

from fedml_ssfl.bench import machine_info  # noqa: E402
from fedml_ssfl.contract import DataInfo  # noqa: E402
from fedml_ssfl.metrics import evaluate  # noqa: E402
from fedml_ssfl.models import build_model  # noqa: E402
from fedml_ssfl.models.layout import apply_layout, resolve_layout  # noqa: E402

CASES = {  # row name: model, norm, channels, side, classes
    "cnn28-gn": ("cnn28", "gn", 1, 28, 10),
    "cnn28-bn": ("cnn28", "bn", 1, 28, 10),
    "fedsiam_mnist_cnn": ("fedsiam_mnist_cnn", "none", 1, 28, 10),
    "emnist_cnn": ("emnist_cnn", "none", 1, 28, 62),
    "fedsiam_cifar_cnn-bn": ("fedsiam_cifar_cnn", "bn", 3, 32, 10),
    "wrn28_2-bn": ("wrn28_2", "bn", 3, 32, 10),
}
LAYOUTS = ("contiguous", "channels_last")


def measure(name: str, batches: list[int], images: int, repeats: int) -> dict:
    """Median CPU and wall seconds per 1,000 images of each (layout, batch) for one row of :data:`CASES`."""
    model_name, norm, channels, side, classes = CASES[name]
    gen = torch.Generator().manual_seed(0)
    x = torch.randint(0, 256, (images, channels, side, side), dtype=torch.uint8, generator=gen)
    y = torch.randint(0, classes, (images,), generator=gen)
    info = DataInfo(classes, channels, side, (0.5,) * channels, (0.25,) * channels, flip=False)
    models = {}
    for layout in LAYOUTS:
        torch.manual_seed(0)
        model = build_model(model_name, num_classes=classes, in_channels=channels, image_size=side, norm=norm)
        models[layout] = apply_layout(model, layout, "cpu")
    cpu: dict[tuple[str, int], list[float]] = {(la, b): [] for la in LAYOUTS for b in batches}
    wall: dict[tuple[str, int], list[float]] = {k: [] for k in cpu}
    accs: dict[tuple[str, int], float] = {}
    cpu_dev = torch.device("cpu")
    for key in cpu:  # warm-up: one pass of each
        evaluate(models[key[0]], x, y, info, cpu_dev, key[1])
    keys = list(cpu)
    for rep in range(repeats):
        order = keys[rep % len(keys) :] + keys[: rep % len(keys)]  # a rotating order
        for layout, batch in order:
            c0, w0 = time.process_time(), time.perf_counter()
            out = evaluate(models[layout], x, y, info, cpu_dev, batch)
            cpu[(layout, batch)].append((time.process_time() - c0) * 1000 / images)
            wall[(layout, batch)].append((time.perf_counter() - w0) * 1000 / images)
            accs[(layout, batch)] = out["acc"]
    auto = resolve_layout("auto", models["contiguous"], "cpu")
    rows = []
    for layout, batch in keys:
        rows.append(
            {
                "layout": layout,
                "batch": batch,
                "cpu_s_per_1000": statistics.median(cpu[(layout, batch)]),
                "cpu_range": [min(cpu[(layout, batch)]), max(cpu[(layout, batch)])],
                "wall_s_per_1000": statistics.median(wall[(layout, batch)]),
                "acc": accs[(layout, batch)],
            }
        )
    best = min(rows, key=lambda r: r["cpu_s_per_1000"])
    return {
        "model": name,
        "shape": [channels, side, side],
        "auto_layout": "channels_last" if auto == torch.channels_last else "contiguous",
        "best": {"layout": best["layout"], "batch": best["batch"]},
        "rows": rows,
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--models", nargs="+", default=list(CASES), choices=list(CASES))
    parser.add_argument("--batches", nargs="+", type=int, default=[100, 250, 500, 1000])
    parser.add_argument("--images", type=int, default=1000, help="test images per evaluation (default 1000)")
    parser.add_argument("--repeats", type=int, default=5, help="timed evaluations per layout and batch")
    parser.add_argument("--threads", type=int, default=1, help="torch CPU threads (0: torch's default)")
    parser.add_argument("--label", default="", help="a note stored with the figures (e.g. the code's state)")
    parser.add_argument("--out", type=Path, default=ROOT / "benchmarks" / "results" / "eval_batch.json")
    args = parser.parse_args()
    if args.threads:
        torch.set_num_threads(args.threads)
    command = " ".join(["python", "benchmarks/eval_batch.py", *sys.argv[1:]])
    results = []
    for name in args.models:
        machine = machine_info(torch.get_num_threads())
        res = measure(name, args.batches, args.images, args.repeats)
        machine["loadavg_end"] = list(os.getloadavg())
        results.append(res | {"label": args.label, "command": command, "machine": machine})
        cells = ", ".join(f"{r['layout'][:8]}/{r['batch']}: {r['cpu_s_per_1000']:.3f}" for r in res["rows"])
        print(f"{name} (CPU s per 1,000 images; auto layout {res['auto_layout']}): {cells}", flush=True)
    old = json.loads(args.out.read_text()) if args.out.is_file() else {}
    kept = [r for r in old.get("models", []) if r["model"] not in args.models]
    order = list(CASES)
    merged = sorted(kept + results, key=lambda r: order.index(r["model"]))
    payload = {
        "what": "CPU (and wall) seconds per 1,000 images of fedml_ssfl.metrics.evaluate, by layout and batch",
        "images": args.images,
        "repeats": args.repeats,
        "models": merged,
    }
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps(payload, indent=2) + "\n")
    print(f"wrote {args.out}")


if __name__ == "__main__":
    main()
