"""FedMatch's sparse traffic with the paper's model, learning rate and thresholds, per round.

On the shipped MNIST-5k CNN (24k parameters) every FedMatch delta stays above the paper's
thresholds (docs/results.md). This script checks the paper's own setting on the CPU: ResNet-9
without BatchNorm (6.57M parameters), SGD lr 1e-3 without momentum, labels-at-client with 5 labels
per class, the default thresholds (C2S 5e-5, psi 5e-6), helpers every 2 rounds. The data are the
package's synthetic 32x32 images (offline; the accuracy is not the point), so the figures are the
C2S / S2C bytes relative to dense FedAvg, as FedMatch's Table 1 and Figure 8 report them.

Writes ``benchmarks/results/fedmatch_communication.json`` and ``.md``.

Usage::

    python benchmarks/fedmatch_communication.py                 # 10 rounds, 4 clients
    python benchmarks/fedmatch_communication.py --rounds 4 --threads 2
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import sys
import time
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from fedml_ssfl.config import load_config  # noqa: E402
from fedml_ssfl.runtime.local import run_local  # noqa: E402


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--rounds", type=int, default=10)
    parser.add_argument("--clients", type=int, default=4)
    parser.add_argument("--steps", type=int, default=4, help="local steps per round")
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--out-dir", default="/tmp/fedml_ssfl_fedmatch_comm")
    parser.add_argument("--results", default=str(ROOT / "benchmarks" / "results" / "fedmatch_communication"))
    args = parser.parse_args(argv)
    torch.set_num_threads(args.threads)
    overrides = [
        "ssfl_args.algorithm=fedmatch",
        "ssfl_args.helper_interval=2",
        "data_args.dataset=synthetic",
        "data_args.synthetic_num_samples=1200",
        "data_args.label_scenario=client",
        "data_args.num_server_labels=0",
        "data_args.labels_per_class_client=5",
        "model_args.model=resnet9",
        "model_args.norm=none",
        f"train_args.client_num_in_total={args.clients}",
        f"train_args.client_num_per_round={args.clients}",
        f"train_args.comm_round={args.rounds}",
        f"train_args.local_steps={args.steps}",
        "train_args.batch_size=32",
        "train_args.learning_rate=0.001",
        "train_args.momentum=0.0",
        "train_args.lr_schedule=constant",
        "common_args.compare_with=[]",
        "tracking_args.progress_bar=false",
        "tracking_args.enable_tensorboard=false",
        f"common_args.output_dir={args.out_dir}",
    ]
    cfg = load_config(None, overrides)
    t0 = time.perf_counter()
    res = run_local(cfg)
    wall = time.perf_counter() - t0
    keys = ("round", "c2s_cost", "s2c_cost", "c2s_ratio", "s2c_ratio", "psi_density", "helpers_sent", "seconds")
    rows = [
        {k: r.get(k) for k in keys}
        for r in (json.loads(x) for x in (res.run_dir / "metrics.jsonl").read_text().splitlines())
    ]
    meta = {
        "machine": f"{platform.machine()}, {os.cpu_count()} cores ({args.threads} torch threads), "
        f"torch {torch.__version__}",
        "date": time.strftime("%Y-%m-%d"),
        "settings": f"resnet9-none, synthetic 3x32x32, K = C_k = {args.clients}, {args.rounds} rounds of "
        f"{args.steps} steps, batch 32, lr 1e-3, labels-at-client (5 per class), paper thresholds",
        "wall_seconds": wall,
    }
    out = Path(args.results)
    out.parent.mkdir(parents=True, exist_ok=True)
    out.with_suffix(".json").write_text(json.dumps({**meta, "rows": rows}, indent=2) + "\n")
    lines = [
        "# FedMatch traffic with ResNet-9 at the paper's thresholds",
        "",
        f"Produced by `python benchmarks/fedmatch_communication.py`. {meta['settings']}.",
        f"Machine: {meta['machine']}. Date: {meta['date']}. Wall: {wall:.0f} s.",
        "",
        "C2S / S2C bytes: bytes per client message over one dense model (dense FedAvg = 100%; sigma and",
        "psi together are 200% when dense; S2C includes the helpers' psi in helper rounds; a sparse value",
        "costs 4 bytes plus an 8-byte index). Values: values sent over the parameters, the authors' measure.",
        "",
        "| round | C2S bytes | S2C bytes | C2S values | S2C values | psi density | helpers sent | s |",
        "|---:|---:|---:|---:|---:|---:|---:|---:|",
    ]
    for r in rows:
        lines.append(
            f"| {r['round']} | {100 * r['c2s_cost']:.0f}% | {100 * r['s2c_cost']:.0f}% | {100 * r['c2s_ratio']:.0f}% | "
            f"{100 * r['s2c_ratio']:.0f}% | {r['psi_density']:.3f} | {r['helpers_sent']:.0f} | {r['seconds']:.1f} |"
        )
    means = [100 * sum(r[k] for r in rows) / len(rows) for k in ("c2s_cost", "s2c_cost", "c2s_ratio", "s2c_ratio")]
    lines.append("| mean | " + " | ".join(f"{m:.0f}%" for m in means) + " | | | |")
    out.with_suffix(".md").write_text("\n".join(lines) + "\n")
    print("\n".join(lines))
    return 0


if __name__ == "__main__":
    sys.exit(main())
