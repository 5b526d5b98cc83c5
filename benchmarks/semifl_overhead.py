"""Where SemiFL's round spends the CPU time its reference does not (issue 15): SemiFL's own work.

Runs ``fedml-ssfl bench``'s measurement (``fedml_ssfl.bench.measure_round_speed``) on a SemiFL config
with counters around SemiFL's functions. Each counter adds up, per call, this process's CPU seconds
minus those the bench already times inside the call (forward and backward passes, optimiser steps,
augmentation, plain inputs): what the function costs beyond the passes. Figures are for the last
measured round. Counters are inclusive (``SemiFL._step`` includes the mixup functions it calls) and
each adds a few microseconds per call.

It also times two small costs in a warm loop (clipping cnn28's gradients, the mixup
lambda draws of a client's 16 steps), to compare with what they cost inside the round. Usage::

    python benchmarks/semifl_overhead.py [CONFIG] [--rounds 1] [--out benchmarks/results/semifl_overhead.json]
"""

from __future__ import annotations

import argparse
import functools
import json
import sys
import time
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

import torch  # noqa: E402

from fedml_ssfl import bench, training  # noqa: E402
from fedml_ssfl.algorithms import semifl  # noqa: E402
from fedml_ssfl.config import load_config  # noqa: E402
from fedml_ssfl.models import build_model  # noqa: E402
from fedml_ssfl.runtime import common  # noqa: E402

sys.path.insert(0, str(ROOT / "benchmarks"))
from augment_speed import median_ms  # noqa: E402  (CPU ms per call, median)

TARGETS: list[tuple[Any, str]] = [
    (semifl.SemiFL, "client_update"),
    (semifl.SemiFL, "_views"),
    (semifl.SemiFL, "_loss"),
    (semifl.SemiFL, "_fine_tune"),
    (semifl.SemiFL, "aggregate"),
    (semifl, "sample_mix_lambdas"),
    (semifl, "mixup_loss"),
    (semifl, "mix_inputs"),
    (semifl, "bn_sums"),
    (semifl, "predict_probs"),
    (semifl, "fix_mix_sets"),
    (training, "optimizer_step"),
    (training, "clip_grad_norm"),
    (training, "clear_grads"),
    (common, "evaluate"),
]
"""(owner, name): the functions counted. Module-level names are patched where SemiFL's code looks
them up (``semifl``'s own imports, ``training``'s globals)."""


class Counters:
    """Per-function calls, CPU seconds, and CPU seconds beyond the bench's own timers."""

    def __init__(self) -> None:
        self.recorder: bench.PassRecorder | None = None
        self.stats: dict[str, list[float]] = {}

    def timed(self) -> float:
        rec = self.recorder
        return sum(rec.timers.values()) if rec is not None else 0.0

    def wrap(self, owner: Any, name: str) -> None:
        fn = getattr(owner, name)
        label = f"{getattr(owner, '__name__', str(owner)).split('.')[-1]}.{name}"

        @functools.wraps(fn)
        def counted(*args: Any, **kwargs: Any) -> Any:
            c0, t0 = time.process_time(), self.timed()
            try:
                return fn(*args, **kwargs)
            finally:
                cpu, passes = time.process_time() - c0, self.timed() - t0
                s = self.stats.setdefault(label, [0, 0.0, 0.0])
                s[0] += 1
                s[1] += cpu
                s[2] += cpu - passes

        setattr(owner, name, counted)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("config", nargs="?", default=str(ROOT / "configs" / "mnist5k" / "semifl.yaml"))
    parser.add_argument("--rounds", type=int, default=1)
    parser.add_argument("--out", type=Path, default=ROOT / "benchmarks" / "results" / "semifl_overhead.json")
    args = parser.parse_args()
    cfg = load_config(args.config)  # and FEDML_SSFL_SET, as every command
    if cfg.algorithm != "semifl":
        raise SystemExit(f"semifl_overhead.py: {args.config} runs {cfg.algorithm!r}, not semifl")

    counters = Counters()
    enter = bench.PassRecorder.__enter__

    def recorder_enter(rec: bench.PassRecorder) -> bench.PassRecorder:
        counters.recorder = rec  # a new recorder per round: keep the last round's counts only
        counters.stats.clear()
        return enter(rec)

    bench.PassRecorder.__enter__ = recorder_enter  # type: ignore[method-assign]
    for owner, name in TARGETS:
        counters.wrap(owner, name)
    result = bench.measure_round_speed(cfg, rounds=args.rounds, warmup=1)

    model = build_model("cnn28", num_classes=10, in_channels=1, image_size=28, norm="bn")
    params = list(model.parameters())
    for p in params:
        p.grad = torch.randn_like(p)
    gen = torch.Generator().manual_seed(0)
    out = {
        "config": str(Path(args.config).resolve().relative_to(ROOT))
        if Path(args.config).resolve().is_relative_to(ROOT)
        else args.config,
        "machine": result["machine"],
        "round_cpu_seconds": result["cpu_seconds_per_round"],
        "reference_best_cpu_seconds": result["reference_best_cpu_seconds"],
        "ratio_best_cpu": result["ratio_best_cpu"],
        "breakdown": result["breakdown"],
        "functions": {
            k: {"calls": int(n), "cpu_seconds": cpu, "beyond_passes_seconds": other}
            for k, (n, cpu, other) in sorted(counters.stats.items(), key=lambda kv: -kv[1][2])
        },
        "warm_loop_ms": {
            "clip_grad_norm (cnn28, 11 tensors)": median_ms(lambda: training.clip_grad_norm(params, 1.0), 2000),
            "sample_mix_lambdas (16 draws)": median_ms(lambda: semifl.sample_mix_lambdas(0.75, 16, gen), 2000),
        },
    }
    print(f"round {out['round_cpu_seconds']:.3f} CPU s, reference {out['reference_best_cpu_seconds']:.3f}")
    print(f"{'function':28s} {'calls':>6s} {'CPU s':>8s} {'beyond passes':>14s}")
    for k, f in out["functions"].items():
        print(f"{k:28s} {f['calls']:6d} {f['cpu_seconds']:8.3f} {f['beyond_passes_seconds']:14.3f}")
    for k, ms in out["warm_loop_ms"].items():
        print(f"warm loop: {k}: {ms:.3f} ms")
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps(out, indent=2) + "\n")
    print(f"wrote {args.out}")


if __name__ == "__main__":
    main()
