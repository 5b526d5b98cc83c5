"""WRN-28-2's block ReLUs in place against out of place (issue 30): a training step and an evaluation.

The model as ``fedml-ssfl run`` builds it on CPU (BatchNorm, ``device_args.memory_format: auto``, so
channels_last) at CIFAR's 3x32x32, and a copy whose blocks' ReLUs are out-of-place modules (the code
before issue 30; the final ReLU was in place already). The two compute the same values and gradients
bit for bit (tests/test_wrn.py). Figures: the median CPU seconds of a training step (forward,
cross-entropy, ``zero_grad``, backward, SGD step with momentum; the two taking turns step by step,
``benchmarks/step_timing.py``) and of an evaluation of 1,000 images at the default evaluation batch
(:func:`fedml_ssfl.metrics.evaluate`, the two taking turns), one torch thread. Usage::

    python benchmarks/inplace_relu.py [--batch 64] [--steps 20] [--evals 5] [--out benchmarks/results/inplace_relu.json]
"""

from __future__ import annotations

import argparse
import copy
import json
import os
import statistics
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

import torch  # noqa: E402
from step_timing import alternate  # noqa: E402  (benchmarks/step_timing.py)
from torch import nn  # noqa: E402

from fedml_ssfl.bench import machine_info  # noqa: E402
from fedml_ssfl.contract import DataInfo  # noqa: E402
from fedml_ssfl.metrics import EVAL_BATCH_SIZE, evaluate  # noqa: E402
from fedml_ssfl.models import build_model  # noqa: E402
from fedml_ssfl.models.layout import apply_layout  # noqa: E402
from fedml_ssfl.models.wrn import WideBlock  # noqa: E402


def models() -> dict[str, nn.Module]:
    """The model as the package builds it, and a copy with out-of-place block ReLUs."""
    torch.manual_seed(0)
    fast = apply_layout(build_model("wrn28_2", num_classes=10, in_channels=3, image_size=32, norm="bn"), "auto")
    slow = copy.deepcopy(fast)
    for block in slow.modules():
        if isinstance(block, WideBlock):
            block.relu = nn.ReLU(inplace=False)
    return {"in place": fast, "out of place": slow}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--batch", type=int, default=64, help="training batch (default 64)")
    parser.add_argument("--steps", type=int, default=20, help="timed training steps of each (after 3 warm-up steps)")
    parser.add_argument("--evals", type=int, default=5, help="timed evaluations of 1,000 images of each")
    parser.add_argument("--threads", type=int, default=1)
    parser.add_argument("--out", type=Path, default=ROOT / "benchmarks" / "results" / "inplace_relu.json")
    args = parser.parse_args()
    torch.set_num_threads(args.threads)
    machine = machine_info(torch.get_num_threads())
    gen = torch.Generator().manual_seed(0)
    x = torch.randn(args.batch, 3, 32, 32, generator=gen)
    y = torch.randint(0, 10, (args.batch,), generator=gen)
    nets = models()
    runs = {name: (m, torch.optim.SGD(m.parameters(), lr=0.01, momentum=0.9)) for name, m in nets.items()}
    step = alternate(runs, x, y, args.steps, warmup=3)
    images = torch.randint(0, 256, (1000, 3, 32, 32), dtype=torch.uint8, generator=gen)
    labels = torch.randint(0, 10, (1000,), generator=gen)
    info = DataInfo(10, 3, 32, (0.5,) * 3, (0.25,) * 3, flip=False)
    evals: dict[str, list[float]] = {name: [] for name in nets}
    for i in range(args.evals + 1):
        for name, m in nets.items():
            t0 = time.process_time()
            evaluate(m, images, labels, info, torch.device("cpu"), EVAL_BATCH_SIZE)
            if i:  # the first of each is a warm-up
                evals[name].append(time.process_time() - t0)
    rows = {
        name: {"train_step_cpu_s": step[name], "eval_cpu_s_per_1000": statistics.median(evals[name])} for name in nets
    }
    for name, r in rows.items():
        step_ms, eval_s = 1e3 * r["train_step_cpu_s"], r["eval_cpu_s_per_1000"]
        print(f"{name:>13}: training step {step_ms:.1f} ms, evaluation of 1,000 images {eval_s:.3f} s")
    machine["loadavg_end"] = list(os.getloadavg())
    payload = {
        "what": "WRN-28-2 (bn, channels_last, 3x32x32): block ReLUs in place vs out of place, CPU seconds",
        "command": " ".join(["python", "benchmarks/inplace_relu.py", *sys.argv[1:]]),
        "batch": args.batch,
        "steps": args.steps,
        "eval_batch": EVAL_BATCH_SIZE,
        "machine": machine,
        "rows": rows,
        "in_place_over_out_of_place": {
            "train_step": rows["in place"]["train_step_cpu_s"] / rows["out of place"]["train_step_cpu_s"],
            "evaluation": rows["in place"]["eval_cpu_s_per_1000"] / rows["out of place"]["eval_cpu_s_per_1000"],
        },
    }
    args.out.write_text(json.dumps(payload, indent=2) + "\n")
    print(f"wrote {args.out}")


if __name__ == "__main__":
    main()
