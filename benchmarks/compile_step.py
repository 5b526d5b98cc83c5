"""Does ``torch.compile`` pay for itself within the main job's 20 rounds? (issue 15)

cnn28 as ``fedml-ssfl run`` builds it (``device_args.memory_format: auto``), a fixed random batch
of 28x28 images, SGD with momentum: forward, cross-entropy, ``zero_grad``, backward, step. One copy
runs eagerly, the other through :func:`torch.compile` (default backend, inductor). The compiled
copy's first step compiles (forward and backward graphs); its wall seconds beyond the eager copy's
first step (inductor compiles partly in worker processes) are reported apart, with
inductor's on-disk cache in a fresh folder (what a first run pays) unless ``--warm-cache``. Then
the two alternate step by step and the figure is each one's median step time (CPU seconds of this
process on a CPU, wall seconds with a CUDA synchronisation on a GPU).

Break-even: those compilation seconds divided by the saving per step;
compared with the main job's training steps (``configs/mnist5k/semifl.yaml``: 420 forwards with
gradient a round, 20 rounds, as ``fedml-ssfl bench`` counts them). Usage::

    python benchmarks/compile_step.py [--device cpu|cuda] [--batch 64] [--steps 100] [--norms bn gn]
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

import torch  # noqa: E402
from step_timing import alternate, train_step  # noqa: E402  (benchmarks/step_timing.py)

from fedml_ssfl.bench import machine_info  # noqa: E402
from fedml_ssfl.models import build_model  # noqa: E402
from fedml_ssfl.models.layout import apply_layout  # noqa: E402

MAIN_JOB_STEPS = 20 * 420  # the main job's forwards with gradient: 20 rounds x 420 (fedml-ssfl bench's count)


def measure(device: torch.device, norm: str, batch: int, steps: int, warmup: int = 5) -> dict[str, float]:
    """Compile seconds and median step seconds, eager and compiled."""
    gen = torch.Generator().manual_seed(0)
    x = torch.randn(batch, 1, 28, 28, generator=gen).to(device)
    y = torch.randint(0, 10, (batch,), generator=gen).to(device)
    runs = {}
    for name in ("eager", "compiled"):
        torch.manual_seed(0)
        model = build_model("cnn28", num_classes=10, in_channels=1, image_size=28, norm=norm)
        model = apply_layout(model, "auto", device.type).to(device)
        runner = torch.compile(model) if name == "compiled" else model
        runs[name] = (runner, torch.optim.SGD(model.parameters(), lr=0.01, momentum=0.9))
    # The compiled copy compiles in its first step, partly in inductor's worker processes: wall seconds.
    first = {}
    for name, run in runs.items():
        t0 = time.perf_counter()
        train_step(run, x, y)
        first[name] = time.perf_counter() - t0
    eager, compiled = (alternate(runs, x, y, steps, warmup)[n] for n in ("eager", "compiled"))
    return {"compile_s": first["compiled"] - first["eager"], "eager_ms": 1e3 * eager, "compiled_ms": 1e3 * compiled}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--device", default="cpu", choices=("cpu", "cuda"))
    parser.add_argument("--batch", type=int, default=64)
    parser.add_argument("--steps", type=int, default=100, help="timed steps per way (after 5 warm-up steps)")
    parser.add_argument("--norms", nargs="+", default=["bn", "gn"], choices=("bn", "gn", "none"))
    parser.add_argument("--threads", type=int, default=1, help="torch CPU threads (0: torch's default)")
    parser.add_argument("--warm-cache", action="store_true", help="keep inductor's usual on-disk cache")
    parser.add_argument("--json", default="", help="also write the figures to this file")
    args = parser.parse_args()
    if args.device == "cuda" and not torch.cuda.is_available():
        sys.exit("--device cuda: no CUDA device is visible")
    if args.threads:
        torch.set_num_threads(args.threads)
    cache = None if args.warm_cache else tempfile.TemporaryDirectory(prefix="inductor-cache-")
    if cache is not None:
        os.environ["TORCHINDUCTOR_CACHE_DIR"] = cache.name
    device = torch.device(args.device)
    rows = []
    for norm in args.norms:
        r = measure(device, norm, args.batch, args.steps)
        saving = r["eager_ms"] - r["compiled_ms"]
        r |= {"norm": norm, "break_even_steps": (1e3 * r["compile_s"] / saving) if saving > 0 else None}
        rows.append(r)
        pays = r["break_even_steps"] is not None and r["break_even_steps"] <= MAIN_JOB_STEPS
        even = "never" if r["break_even_steps"] is None else f"after {r['break_even_steps']:.0f} steps"
        print(
            f"cnn28-{norm}, batch {args.batch}, {device.type}: compile {r['compile_s']:.1f} s; eager "
            f"{r['eager_ms']:.2f} ms, compiled {r['compiled_ms']:.2f} ms per step; break-even {even} "
            f"(the main job: {MAIN_JOB_STEPS}): {'pays' if pays else 'does not pay'}"
        )
    if cache is not None:
        cache.cleanup()
    if args.json:
        info = machine_info(torch.get_num_threads())
        out = {"machine": info, "batch": args.batch, "warm_cache": args.warm_cache, "main_job_steps": MAIN_JOB_STEPS}
        Path(args.json).write_text(json.dumps(out | {"rows": rows}, indent=2) + "\n")


if __name__ == "__main__":
    main()
