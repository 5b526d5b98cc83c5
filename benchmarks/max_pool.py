"""2x2 max-pooling on CPU: ``F.max_pool2d`` against :func:`fedml_ssfl.models.pooling.max_pool_2x2`.

The shapes of cnn28's two pooling layers at a batch of 121 (fedavg_ssl's weak + strong batch on
MNIST-5k), in NCHW and channels_last, without gradient (forward) and with (forward and backward, where
:class:`~fedml_ssfl.models.pooling.MaxPool2x2` uses ``F.max_pool2d``). Median CPU milliseconds of
this process over ``--repeats`` calls, the two ways alternating. Usage::

    python benchmarks/max_pool.py [--repeats 30] [--out benchmarks/results/max_pool.json]
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
import torch.nn.functional as F  # noqa: E402

from fedml_ssfl.bench import machine_info  # noqa: E402
from fedml_ssfl.models.pooling import max_pool_2x2  # noqa: E402

SHAPES = ((121, 16, 28, 28), (121, 32, 14, 14))


def cpu_ms(fn, repeats: int) -> list[float]:
    out = []
    for _ in range(repeats):
        start = time.process_time()
        fn()
        out.append((time.process_time() - start) * 1e3)
    return out


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--repeats", type=int, default=30)
    parser.add_argument("--out", type=Path, default=ROOT / "benchmarks" / "results" / "max_pool.json")
    args = parser.parse_args()
    torch.set_num_threads(1)
    rows = []
    for shape in SHAPES:
        for layout in ("contiguous", "channels_last"):
            fmt = torch.channels_last if layout == "channels_last" else torch.contiguous_format
            x = torch.relu(torch.randn(shape, generator=torch.Generator().manual_seed(0))).to(memory_format=fmt)
            with torch.no_grad():
                assert torch.equal(F.max_pool2d(x, 2), max_pool_2x2(x))
                plain, fast = [], []
                for _ in range(args.repeats):  # alternate, so drifting load hits both alike
                    plain += cpu_ms(lambda x=x: F.max_pool2d(x, 2), 1)
                    fast += cpu_ms(lambda x=x: max_pool_2x2(x), 1)
            xg = x.clone().requires_grad_()
            grad = torch.ones(shape[0], shape[1], shape[2] // 2, shape[3] // 2)
            with_grad = cpu_ms(lambda xg=xg, grad=grad: F.max_pool2d(xg, 2).backward(grad), args.repeats)
            row = {
                "shape": list(shape),
                "layout": layout,
                "no_grad_max_pool2d_ms": statistics.median(plain),
                "no_grad_strided_maximum_ms": statistics.median(fast),
                "speedup": statistics.median(plain) / statistics.median(fast),
                "with_grad_max_pool2d_fwd_bwd_ms": statistics.median(with_grad),
            }
            rows.append(row)
            print(json.dumps(row))
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps({"machine": machine_info(1), "rows": rows}, indent=2) + "\n")
    print(f"wrote {args.out}")


if __name__ == "__main__":
    main()
