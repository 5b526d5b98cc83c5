"""FedML's cost per round: the local runtime vs FedML cross-silo MPI on the same config.

For a small CNN (cnn28 on the shipped MNIST-5k) and ResNet-18 (GroupNorm, synthetic 3x32x32
data), the same config runs in the local runtime and under ``mpirun -np C_k+1`` with FedML.
Seconds per round come from each run's ``metrics.jsonl`` (the same span in both runtimes:
sampling, server step, messages, client updates, aggregation; start-up, evaluation and
checkpoints excluded), taking the median over rounds after the first (warm-up). Bytes per round:
the algorithm payload counted by ``message_nbytes`` (identical in both runtimes by construction)
and, for FedML, the serialized bytes MPI actually carried.

With C_k = 1 (default) both runtimes do the same compute one step after another, so the
difference is FedML's added time (serialization, transfer, FedML's message handling). ``--workers
2`` adds runs where FedML trains two clients in parallel processes.

Writes ``benchmarks/results/fedml_overhead.json`` and ``.md``. Usage::

    python benchmarks/fedml_overhead.py [--repeats 2] [--workers 1 2] [--models ...]
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from fedml_ssfl.config import load_config, validate  # noqa: E402
from fedml_ssfl.runtime.local import run_local  # noqa: E402

BIN = Path(sys.executable).parent

MODELS = {
    "cnn28 (MNIST-5k)": [
        "data_args.dataset=mnist5k",
        "model_args.model=cnn28",
        "train_args.local_steps=16",
        "train_args.batch_size=64",
    ],
    "resnet18 (synthetic 3x32x32)": [
        "data_args.dataset=synthetic",
        "data_args.synthetic_shape=[3,32,32]",
        "data_args.synthetic_num_samples=1200",
        "model_args.model=resnet18",
        "train_args.local_steps=2",
        "train_args.batch_size=32",
    ],
}


def base_overrides(out: Path, workers: int, rounds: int, threads: int) -> list[str]:
    return [
        f"common_args.output_dir={out}",
        "common_args.compare_with=[]",
        "model_args.norm=gn",
        "data_args.num_server_labels=50",
        f"train_args.client_num_in_total={max(4, workers)}",
        f"train_args.client_num_per_round={workers}",
        f"train_args.comm_round={rounds}",
        f"validation_args.frequency_of_the_test={rounds}",  # evaluate once, at the end
        "validation_args.eval_batch_size=200",
        f"device_args.num_threads={threads}",
        f"tracking_args.checkpoint_every={rounds}",
        "tracking_args.enable_tensorboard=false",
        "tracking_args.progress_bar=false",
        "ssfl_args.algorithm=fedavg_ssl",
    ]


def rows(run_dir: Path) -> list[dict]:
    return [json.loads(x) for x in (run_dir / "metrics.jsonl").read_text().splitlines()]


def per_round(rs: list[dict], key: str) -> float:
    values = [r[key] for r in rs[1:]] or [r[key] for r in rs]
    return statistics.median(values)


def run_pair(name: str, overrides: list[str], tmp: Path, workers: int, rounds: int, threads: int) -> dict:
    cfg = load_config(None, [*base_overrides(tmp, workers, rounds, threads), *overrides])
    t0 = time.perf_counter()
    local = run_local(cfg, run_dir=tmp / "local")
    local_wall = time.perf_counter() - t0
    raw = cfg.to_dict()
    raw["common_args"]["training_type"] = "cross_silo"
    raw["comm_args"]["backend"] = "MPI"
    raw["common_args"]["run_name"] = "fedml"
    fed_cfg = validate(raw)
    cfg_path = tmp / "fedml.yaml"
    cfg_path.write_text(fed_cfg.to_yaml())
    env = dict(
        os.environ,
        OMPI_ALLOW_RUN_AS_ROOT="1",
        OMPI_ALLOW_RUN_AS_ROOT_CONFIRM="1",
        PYTHONWARNINGS="ignore",
        OMP_NUM_THREADS=str(threads),
        PYTHONPATH=os.pathsep.join(x for x in (str(ROOT), os.environ.get("PYTHONPATH", "")) if x),
    )
    cmd = [
        str(BIN / "mpirun"),
        "--oversubscribe",
        "--bind-to",
        "none",
        "-np",
        str(workers + 1),
        str(BIN / "fedml-ssfl"),
        "run",
        "--cf",
        str(cfg_path),
    ]
    t0 = time.perf_counter()
    proc = subprocess.run(cmd, capture_output=True, text=True, env=env, timeout=3600)
    fed_wall = time.perf_counter() - t0
    if proc.returncode != 0:
        raise RuntimeError(f"FedML run failed:\n{proc.stdout[-3000:]}\n{proc.stderr[-5000:]}")
    lr, fr = rows(local.run_dir), rows(fed_cfg.run_dir())
    local_s, fed_s = per_round(lr, "seconds"), per_round(fr, "seconds")
    payload = per_round(fr, "bytes_up") + per_round(fr, "bytes_down")
    wire = per_round(fr, "wire_bytes_up") + per_round(fr, "wire_bytes_down")
    return {
        "model": name,
        "workers": workers,
        "rounds": rounds,
        "local_s_per_round": local_s,
        "fedml_s_per_round": fed_s,
        "added_s_per_round": fed_s - local_s,
        "added_fraction": (fed_s - local_s) / local_s,
        "payload_bytes_per_round": payload,
        "payload_bytes_per_round_local": per_round(lr, "bytes_up") + per_round(lr, "bytes_down"),
        "wire_bytes_per_round": wire,
        "wire_over_payload": wire / payload - 1.0,
        "local_round_seconds": [r["seconds"] for r in lr],
        "fedml_round_seconds": [r["seconds"] for r in fr],
        "local_wall_s": local_wall,
        "fedml_wall_s_incl_startup": fed_wall,
        "same_final_acc": local.final_acc == rows(fed_cfg.run_dir())[-1].get("test_acc"),
    }


def markdown(results: list[dict], meta: dict) -> str:
    lines = [
        "# FedML runtime overhead",
        "",
        f"Machine: {meta['machine']}; torch threads per process: {meta['threads']}; load average at start "
        f"{meta['load_start']}, at end {meta['load_end']}. Medians over rounds 2..T of each run, then over "
        f'{meta["repeats"]} repeat(s) ("fastest runs": the minimum of each runtime over the repeats). '
        "Start-up, evaluation and checkpoints excluded. Command: "
        f"`{meta['command']}`.",
        "",
        "| model | C_k | local s/round | FedML s/round | FedML added | added, fastest runs | payload B/round "
        "| wire B/round | wire vs payload |",
        "|---|---|---|---|---|---|---|---|---|",
    ]
    for r in results:
        lines.append(
            f"| {r['model']} | {r['workers']} | {r['local_s_per_round']:.3f} | {r['fedml_s_per_round']:.3f} | "
            f"{r['added_s_per_round']:+.3f} s ({100 * r['added_fraction']:+.1f}%) | "
            f"{r['best_fedml_s_per_round'] - r['best_local_s_per_round']:+.3f} s "
            f"({100 * r['best_added_fraction']:+.1f}%) | "
            f"{r['payload_bytes_per_round']:,.0f} | "
            f"{r['wire_bytes_per_round']:,.0f} | {100 * r['wire_over_payload']:+.2f}% |"
        )
    lines += [
        "",
        "Payload bytes are `message_nbytes` of every message both ways (the local runtime counts the same "
        "numbers); wire bytes are the FedML messages MPI carried, encoded by fedml_ssfl's codec "
        "(runtime/fedml/wire.py: tensors as raw bytes).",
        "",
    ]
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--workers", type=int, nargs="+", default=[1])
    parser.add_argument("--rounds", type=int, default=5)
    parser.add_argument(
        "--threads", type=int, default=1, help="torch threads per process (1: no OpenMP spinning on a shared box)"
    )
    parser.add_argument("--models", nargs="+", default=list(MODELS), choices=list(MODELS))
    parser.add_argument("--out", default=str(ROOT / "benchmarks" / "results" / "fedml_overhead"))
    args = parser.parse_args(argv)
    meta = {
        "machine": f"{platform.processor() or platform.machine()}, {os.cpu_count()} cores, {platform.platform()}",
        "threads": args.threads,
        "repeats": args.repeats,
        "load_start": " ".join(f"{x:.1f}" for x in os.getloadavg()),
        "command": "python benchmarks/fedml_overhead.py " + " ".join(argv if argv is not None else sys.argv[1:]),
    }
    results = []
    for name in args.models:
        for workers in args.workers:
            reps = []
            for rep in range(args.repeats):
                with tempfile.TemporaryDirectory() as tmp:
                    r = run_pair(name, MODELS[name], Path(tmp), workers, args.rounds, args.threads)
                reps.append(r)
                print(
                    f"{name} C_k={workers} repeat {rep + 1}: local {r['local_s_per_round']:.3f} s/round, "
                    f"FedML {r['fedml_s_per_round']:.3f} s/round ({100 * r['added_fraction']:+.1f}%), "
                    f"wire {100 * r['wire_over_payload']:+.2f}% over payload",
                    flush=True,
                )
            merged = dict(reps[-1])
            for key in ("local_s_per_round", "fedml_s_per_round", "payload_bytes_per_round", "wire_bytes_per_round"):
                merged[key] = statistics.median(r[key] for r in reps)
            merged["added_s_per_round"] = merged["fedml_s_per_round"] - merged["local_s_per_round"]
            merged["added_fraction"] = merged["added_s_per_round"] / merged["local_s_per_round"]
            merged["wire_over_payload"] = merged["wire_bytes_per_round"] / merged["payload_bytes_per_round"] - 1
            # the least-disturbed measurement of each runtime (the box is shared: load comes and goes)
            best_local = min(r["local_s_per_round"] for r in reps)
            best_fed = min(r["fedml_s_per_round"] for r in reps)
            merged["best_local_s_per_round"], merged["best_fedml_s_per_round"] = best_local, best_fed
            merged["best_added_fraction"] = (best_fed - best_local) / best_local
            merged["repeats"] = reps
            results.append(merged)
    meta["load_end"] = " ".join(f"{x:.1f}" for x in os.getloadavg())
    out = Path(args.out)
    out.parent.mkdir(parents=True, exist_ok=True)
    out.with_suffix(".json").write_text(json.dumps({"meta": meta, "results": results}, indent=2) + "\n")
    out.with_suffix(".md").write_text(markdown(results, meta))
    print(markdown(results, meta))
    return 0


if __name__ == "__main__":
    sys.exit(main())
