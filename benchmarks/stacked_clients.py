"""Round time with the chosen clients trained one after another vs stacked (``train_args.stack_clients``).

The papers' batch-10 client settings (FedSiam, SemiFL: B = 10; FedMatch's labeled batch B^S = 10)
make many small steps, where a GPU spends its time launching kernels; stacking the round's clients
into one ``torch.func.vmap`` step is meant for that. This script times the same rounds both ways in
one process on the device given (CPU here; the >= 3x target of issue 15 is for a GPU), checks that
the two ways end with the same global model (max absolute difference), and writes
``benchmarks/results/stacked_clients.json`` (machine, threads, load average, date).

Rows: ``fedavg_sl`` (supervised, B = 10) and ``fedprox_fixmatch`` (labels-at-client, B^S = 10,
B^U = 10 here) on MNIST-5k with cnn28 (GroupNorm), for each client count.

Usage::

    python benchmarks/stacked_clients.py                               # 10, 20, 50 clients, CPU
    python benchmarks/stacked_clients.py --clients 10 --rounds 2 --threads 2
    python benchmarks/stacked_clients.py --device cuda                 # where a GPU exists
"""

from __future__ import annotations

import argparse
import datetime
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
from fedml_ssfl.experiment import build_experiment  # noqa: E402
from fedml_ssfl.runtime.local import run_round  # noqa: E402

SETTINGS = {
    "fedavg_sl": ["ssfl_args.algorithm=fedavg_sl", "data_args.label_scenario=server"],
    "fedprox_fixmatch": [
        "ssfl_args.algorithm=fedprox_fixmatch",
        "data_args.label_scenario=client",
        "data_args.num_server_labels=0",
        "ssfl_args.unlabeled_batch_size=10",
    ],
}


def timed_rounds(overrides: list[str], stack: bool, rounds: int, device: str) -> tuple[list[float], dict]:
    """Seconds of rounds 1..rounds (round 0 warms up) and the final global state."""
    cfg = load_config(None, [*overrides, f"train_args.stack_clients={str(stack).lower()}"])
    exp = build_experiment(cfg)
    exp.algorithm.setup()
    states: dict[int, dict] = {k: {} for k in range(cfg.train_args.client_num_in_total)}
    times = []
    for r in range(rounds + 1):
        if device == "cuda":
            torch.cuda.synchronize()
        t0 = time.perf_counter()
        run_round(exp, r, states)
        if device == "cuda":
            torch.cuda.synchronize()
        if r > 0:
            times.append(time.perf_counter() - t0)
    return times, exp.algorithm.global_state


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--clients", type=int, nargs="+", default=[10, 20, 50])
    parser.add_argument("--algorithms", nargs="+", default=list(SETTINGS), choices=list(SETTINGS))
    parser.add_argument("--rounds", type=int, default=2, help="timed rounds (after one warm-up round)")
    parser.add_argument("--steps", type=int, default=20, help="local steps per round (T)")
    parser.add_argument("--batch", type=int, default=10)
    parser.add_argument("--threads", type=int, default=1)
    parser.add_argument("--device", default="cpu", choices=["cpu", "cuda"])
    parser.add_argument("--results", default=str(ROOT / "benchmarks" / "results" / "stacked_clients.json"))
    args = parser.parse_args(argv)
    torch.set_num_threads(args.threads)
    rows = []
    for algo in args.algorithms:
        for k in args.clients:
            overrides = [
                *SETTINGS[algo],
                "data_args.dataset=mnist5k",
                "model_args.model=cnn28",
                "model_args.norm=gn",
                f"train_args.client_num_in_total={k}",
                f"train_args.client_num_per_round={k}",
                f"train_args.comm_round={args.rounds + 1}",
                f"train_args.local_steps={args.steps}",
                f"train_args.batch_size={args.batch}",
                f"device_args.device={args.device}",
                f"device_args.num_threads={args.threads}",
                "common_args.compare_with=[]",
                "tracking_args.progress_bar=false",
                "tracking_args.enable_tensorboard=false",
            ]
            seq, seq_state = timed_rounds(overrides, False, args.rounds, args.device)
            stk, stk_state = timed_rounds(overrides, True, args.rounds, args.device)
            diff = max(float((seq_state[n] - stk_state[n]).abs().max()) for n in seq_state)
            row = {
                "algorithm": algo,
                "clients": k,
                "local_steps": args.steps,
                "batch_size": args.batch,
                "sequential_s_per_round": sum(seq) / len(seq),
                "stacked_s_per_round": sum(stk) / len(stk),
                "speedup": sum(seq) / sum(stk),
                "max_abs_diff_global_model": diff,
            }
            rows.append(row)
            print(json.dumps(row))
    meta = {
        "machine": f"{platform.machine()}, {os.cpu_count()} cores, {platform.platform()}",
        "device": torch.cuda.get_device_name() if args.device == "cuda" else "cpu",
        "torch": torch.__version__,
        "threads": args.threads,
        "load_average_1_5_15": list(os.getloadavg()),
        "date": datetime.date.today().isoformat(),
        "timed_rounds": args.rounds,
        "command": "python benchmarks/stacked_clients.py " + " ".join(argv if argv is not None else sys.argv[1:]),
    }
    path = Path(args.results)
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps({"meta": meta, "rows": rows}, indent=2) + "\n")
    print(f"wrote {path}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
