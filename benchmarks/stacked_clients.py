"""Round time with the chosen clients trained one after another vs stacked (``train_args.stack_clients``).

The papers' batch-10 client settings (FedSiam, SemiFL: B = 10; FedMatch's labeled batch B^S = 10)
make many small steps, where a GPU spends its time launching kernels; stacking the round's clients
into one ``torch.func.vmap`` step is meant for that. This script times the same rounds both ways in
one process on the device given (CPU here; the >= 3x target of issue 15 is for a GPU), for each
``train_args.stack_size`` given, records how far the two ways' global models end apart (max absolute
difference) beside how far the one-after-another path moves by itself when only torch's thread count
changes (the same kind of summation-order difference), and writes
``benchmarks/results/stacked_clients.json`` (machine, threads, load average, date).

Rows: ``fedavg_sl`` (supervised, B = 10) and ``fedprox_fixmatch`` (labels-at-client, B^S = 10,
B^U = 10 here) on MNIST-5k with cnn28 (GroupNorm), ``semifl`` (B = 10, cnn28 with BatchNorm) and
``fedsiam`` (FedSiam-MT in its MNIST setting: its CNN, B = 10, an EMA target per client) and
``fedseal`` (positive and negative batches of 10 from each client's filtered samples) and
``fedmatch`` (labels-at-client, B^S = 10, B^U = 100, helpers), for each client count; by default
the first two (``--algorithms`` picks others).

Usage::

    python benchmarks/stacked_clients.py                               # 10, 20, 50 clients, CPU
    python benchmarks/stacked_clients.py --clients 10 --rounds 1 --stack-sizes 0
    python benchmarks/stacked_clients.py --device cuda                 # where a GPU exists
    python benchmarks/stacked_clients.py --algorithms semifl --set device_args.memory_format=contiguous
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
    # SemiFL's clients (B = 10, its BatchNorm, T steps), pseudo-labelling from a model the server fine-tuned
    # for 50 steps: the threshold is low so that every client trains from the first round
    "semifl": [
        "ssfl_args.algorithm=semifl",
        "model_args.norm=bn",
        "ssfl_args.local_epochs=null",
        "ssfl_args.server_steps=50",
        "ssfl_args.threshold=0.3",
    ],
    # FedSiam's MNIST setting (Table 1's CNN, no normalisation; gamma = 0.1 labels a client, B = 10, SGD 0.01,
    # momentum 0.9, wd 1e-4, constant rate), FedSiam-MT so that every step updates each client's EMA target
    "fedsiam": [
        "ssfl_args.algorithm=fedsiam",
        "model_args.model=fedsiam_mnist_cnn",
        "model_args.norm=none",
        "data_args.label_scenario=client",
        "data_args.num_server_labels=0",
        "data_args.client_label_ratio=0.1",
        "ssfl_args.variant=mt",
        "train_args.learning_rate=0.01",
        "train_args.momentum=0.9",
        "train_args.weight_decay=0.0001",
        "train_args.lr_schedule=constant",
    ],
    # FedSEAL's clients (labels-at-server): each filters its samples by the self-ensemble and the server's
    # class-wise thresholds (200 validation samples, the paper's), then trains on its positive (strong view)
    # and negative (complementary label) batches of B = 10
    "fedseal": ["ssfl_args.algorithm=fedseal", "data_args.num_server_val=200"],
    # FedMatch labels-at-client (configs/mnist5k/fedmatch_client.yaml): B^S = 10 labeled, B^U = 100 unlabeled,
    # a sigma and a psi step each local step, helpers every round from round 1
    "fedmatch": [
        "ssfl_args.algorithm=fedmatch",
        "data_args.label_scenario=client",
        "data_args.labels_per_class_client=5",
        "data_args.num_server_labels=0",
        "ssfl_args.lambda_l2=0.1",
        "ssfl_args.helper_interval=1",
        "train_args.momentum=0.0",
    ],
}


class Run:
    """One experiment stepping round by round, each round timed."""

    def __init__(self, overrides: list[str], stack: bool, device: str) -> None:
        cfg = load_config(None, [*overrides, f"train_args.stack_clients={str(stack).lower()}"])
        self.exp = build_experiment(cfg)
        self.exp.algorithm.setup()
        self.states: dict[int, dict] = {k: {} for k in range(cfg.train_args.client_num_in_total)}
        self.device = device
        self.times: list[float] = []

    def round(self, r: int) -> float:
        if self.device == "cuda":
            torch.cuda.synchronize()
        t0 = time.perf_counter()
        run_round(self.exp, r, self.states)
        if self.device == "cuda":
            torch.cuda.synchronize()
        return time.perf_counter() - t0


def max_diff(a: dict, b: dict) -> float:
    return max(float((a[n] - b[n]).abs().max()) for n in a if a[n].is_floating_point())


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--clients", type=int, nargs="+", default=[10, 20, 50])
    parser.add_argument(
        "--algorithms",
        nargs="+",
        default=["fedavg_sl", "fedprox_fixmatch"],
        choices=list(SETTINGS),
        help="default: fedavg_sl fedprox_fixmatch (the rows of stacked_clients.json)",
    )
    parser.add_argument(
        "--rounds", type=int, default=3, help="timed rounds (after one warm-up round); the fastest counts"
    )
    parser.add_argument("--steps", type=int, default=20, help="local steps per round (T)")
    parser.add_argument("--batch", type=int, default=10)
    parser.add_argument("--threads", type=int, default=1)
    parser.add_argument("--device", default="cpu", choices=["cpu", "cuda"])
    parser.add_argument(
        "--stack-sizes", type=int, nargs="+", default=[0, 10], help="train_args.stack_size values (0: one stack)"
    )
    parser.add_argument(
        "--no-thread-reference",
        action="store_true",
        help="skip the reference run one after another with threads + 1 (how far the plain path moves by itself)",
    )
    parser.add_argument(
        "--set", action="append", default=[], metavar="SECTION.KEY=VALUE", help="a config override for every row"
    )
    parser.add_argument("--results", default=str(ROOT / "benchmarks" / "results" / "stacked_clients.json"))
    args = parser.parse_args(argv)
    rows = []
    for algo in args.algorithms:
        for k in args.clients:
            overrides = [
                "data_args.dataset=mnist5k",
                "model_args.model=cnn28",
                "model_args.norm=gn",
                f"train_args.client_num_in_total={k}",
                f"train_args.client_num_per_round={k}",
                f"train_args.comm_round={args.rounds + 1}",
                f"train_args.local_steps={args.steps}",
                f"train_args.batch_size={args.batch}",
                f"device_args.device={args.device}",
                "common_args.compare_with=[]",
                "tracking_args.progress_bar=false",
                "tracking_args.enable_tensorboard=false",
                *SETTINGS[algo],  # an algorithm's own settings win (SemiFL's BatchNorm)
                *args.set,
            ]
            torch.set_num_threads(args.threads)
            runs = {"sequential": Run(overrides, False, args.device)}
            for size in args.stack_sizes:
                runs[size] = Run([*overrides, f"train_args.stack_size={size}"], True, args.device)
            for r in range(args.rounds + 1):  # round 0 warms up; the ways take turns, so load spikes hit all
                for run in runs.values():
                    seconds = run.round(r)
                    if r > 0:
                        run.times.append(seconds)
            seq = runs["sequential"]
            reference = None
            if not args.no_thread_reference:
                torch.set_num_threads(args.threads + 1)
                other = Run(overrides, False, args.device)
                for r in range(args.rounds + 1):
                    other.round(r)
                torch.set_num_threads(args.threads)
                reference = max_diff(seq.exp.algorithm.global_state, other.exp.algorithm.global_state)
            for size in args.stack_sizes:
                stk = runs[size]
                row = {
                    "algorithm": algo,
                    "clients": k,
                    "local_steps": args.steps,
                    "batch_size": args.batch,
                    "stack_size": size,
                    "sequential_s_per_round": min(seq.times),
                    "stacked_s_per_round": min(stk.times),
                    "speedup": min(seq.times) / min(stk.times),
                    "sequential_s_all_rounds": seq.times,
                    "stacked_s_all_rounds": stk.times,
                    "max_abs_diff_global_model": max_diff(
                        seq.exp.algorithm.global_state, stk.exp.algorithm.global_state
                    ),
                    "max_abs_diff_sequential_threads_plus_1": reference,
                }
                rows.append(row)
                print(json.dumps(row), flush=True)
    meta = {
        "machine": f"{platform.machine()}, {os.cpu_count()} cores, {platform.platform()}",
        "device": torch.cuda.get_device_name() if args.device == "cuda" else "cpu",
        "torch": torch.__version__,
        "threads": args.threads,
        "load_average_1_5_15": list(os.getloadavg()),
        "date": datetime.date.today().isoformat(),
        "timed_rounds": args.rounds,
        "timing": "each way's fastest timed round (the ways take turns round by round); all rounds listed per row",
        "command": "python benchmarks/stacked_clients.py " + " ".join(argv if argv is not None else sys.argv[1:]),
    }
    path = Path(args.results)
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps({"meta": meta, "rows": rows}, indent=2) + "\n")
    print(f"wrote {path}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
