"""Round speed against a plain PyTorch loop of the same passes, for each SSFL algorithm (issue 15).

Each row runs ``fedml-ssfl bench`` (:func:`fedml_ssfl.bench.measure_round_speed`) in a fresh
process (so its peak RSS is its own): a config's rounds alternate with replays of their counted
forward/backward passes in a plain loop, and ``ratio = round seconds / reference seconds`` is the
federated overhead. Rows: fedavg_ssl (CRL), SemiFL, FedMatch, FedSiam and FedSEAL on cnn28 (the
``configs/mnist5k`` configs as they are: 10 clients, T = 16, batch 64, evaluation every round) and on
ResNet-18 at reduced size (synthetic data of CIFAR-10's 3x32x32 shape, 2 clients, batch 8, 4 steps;
no evaluation in the measured rounds), all with one torch thread unless ``--threads`` says otherwise.

Writes ``benchmarks/results/round_speed.json`` and ``round_speed.png``. Usage::

    python benchmarks/round_speed.py [--rows cnn28/semifl ...] [--rounds 3] [--threads 1]
        [--variants contiguous+inference,channels_last+inference] [--set section.key=value ...]
        [--out NAME] [--merge]
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
RESULTS = ROOT / "benchmarks" / "results"

ALGORITHMS = {
    "fedavg_ssl": "configs/mnist5k/fedavg_ssl.yaml",
    "semifl": "configs/mnist5k/semifl.yaml",
    "fedmatch": "configs/mnist5k/fedmatch.yaml",
    "fedsiam": "configs/mnist5k/fedsiam.yaml",
    "fedseal": "configs/mnist5k/fedseal.yaml",
}

RESNET18 = [
    "model_args.model=resnet18",
    "data_args.dataset=synthetic",
    "data_args.synthetic_shape=[3,32,32]",
    "data_args.synthetic_num_samples=96",
    "data_args.num_server_labels=16",
    "train_args.client_num_in_total=2",
    "train_args.client_num_per_round=2",
    "train_args.local_steps=4",
    "train_args.batch_size=8",
    "validation_args.frequency_of_the_test=1000",
]
"""ResNet-18 at reduced size: the rows' own keys come on top (:data:`RESNET18_EXTRA`)."""

RESNET18_EXTRA = {
    "semifl": ["ssfl_args.server_steps=2", "ssfl_args.threshold=0.0"],  # an untrained model is never 0.9-sure:
    "fedseal": ["ssfl_args.server_steps=2", "data_args.num_server_val=16"],  # threshold 0 makes SemiFL's
}  # clients train every round; FedSEAL's config holds out 100 validation images, more than this data has

ROWS = {
    **{f"cnn28/{name}": (path, []) for name, path in ALGORITHMS.items()},
    **{f"resnet18/{name}": (path, RESNET18 + RESNET18_EXTRA.get(name, [])) for name, path in ALGORITHMS.items()},
}


def run_row(name: str, args: argparse.Namespace) -> dict | None:
    """One row in a fresh ``fedml-ssfl bench`` process; its JSON result (None: it failed, as printed)."""
    config, overrides = ROWS[name]
    with tempfile.TemporaryDirectory() as tmp:
        out = Path(tmp) / "row.json"
        cmd = [sys.executable, "-m", "fedml_ssfl.cli", "bench", str(ROOT / config)]
        for o in [*overrides, "tracking_args.progress_bar=false", *args.set]:
            cmd += ["--set", o]
        cmd += ["--rounds", str(args.rounds), "--warmup", str(args.warmup), "--threads", str(args.threads)]
        cmd += ["--variants", args.variants, "--repeats", str(args.repeats), "--json", str(out)]
        env = {**os.environ, "PYTHONPATH": str(ROOT) + os.pathsep + os.environ.get("PYTHONPATH", "")}
        t0 = time.perf_counter()
        res = subprocess.run(cmd, cwd=tmp, capture_output=True, text=True, env=env)
        if res.returncode != 0:
            print(f"row {name} failed:\n{res.stdout}\n{res.stderr}", file=sys.stderr, flush=True)
            return None
        print(res.stdout, flush=True)
        row = json.loads(out.read_text(encoding="utf-8"))
        row["row"] = name
        row["overrides"] = overrides + list(args.set)
        row["row_wall_seconds"] = time.perf_counter() - t0
        return row


def plot(rows: list[dict], path: Path, target: float = 1.10) -> None:
    """Overhead ratio per row (CPU and wall), and CPU seconds per round of round and reference.

    Both axes from 0, each panel's legend below it (off the bars), the machine and dates in the title.
    """
    from matplotlib.figure import Figure

    names = [r["row"] for r in rows]
    fig = Figure(figsize=(13, 5.6), layout="constrained")
    ax1, ax2 = fig.subplots(1, 2)
    xs = range(len(rows))
    width = 0.38
    ax1.bar([x - width / 2 for x in xs], [r["ratio_best_cpu"] for r in rows], width, label="CPU seconds")
    ax1.bar([x + width / 2 for x in xs], [r["ratio_best"] for r in rows], width, label="wall seconds")
    ax1.axhline(target, color="red", linestyle="--", linewidth=1, label=f"target {target:.2f}x")
    ax1.axhline(1.0, color="black", linewidth=0.6)
    top = max([target, *(r["ratio_best_cpu"] for r in rows), *(r["ratio_best"] for r in rows)])
    ax1.set_ylim(0, 1.08 * top)
    ax1.set_ylabel("round / fastest reference")
    ax1.set_title("federated overhead (median of the measured rounds)", fontsize=10)
    ax2.bar([x - width / 2 for x in xs], [r["cpu_seconds_per_round"] for r in rows], width, label="round")
    ax2.bar(
        [x + width / 2 for x in xs],
        [r["reference_best_cpu_seconds"] for r in rows],
        width,
        label="reference (same passes, plain loop)",
    )
    ax2.set_ylabel("CPU seconds per round")
    ax2.set_title("seconds per round", fontsize=10)
    pad = max(0.0, (4 - len(rows)) / 2)  # a few rows: bars of the width they have with four
    for ax in (ax1, ax2):
        ax.set_xlim(-0.6 - pad, len(rows) - 0.4 + pad)
        ax.set_xticks(list(xs), names, rotation=45, ha="right")
        ax.grid(axis="y", alpha=0.3)
    handles1, labels1 = ax1.get_legend_handles_labels()
    handles2, labels2 = ax2.get_legend_handles_labels()
    fig.legend(handles1, labels1, loc="outside lower left", ncols=3, fontsize=8, frameon=False)
    fig.legend(handles2, labels2, loc="outside lower right", ncols=2, fontsize=8, frameon=False)
    m = rows[0]["machine"]
    dates = sorted(r["machine"]["date"] for r in rows)
    when = dates[0] if dates[0] == dates[-1] else f"rows measured {dates[0]} to {dates[-1]}"
    fig.suptitle(f"{m['cpu']}, {m['torch_threads']} torch thread(s), torch {m['torch']}, {when}", fontsize=9)
    fig.savefig(path, dpi=110)


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--rows", nargs="*", default=list(ROWS), choices=list(ROWS), metavar="ROW", help="default: all")
    p.add_argument("--rounds", type=int, default=3)
    p.add_argument("--warmup", type=int, default=1)
    p.add_argument("--threads", type=int, default=1)
    p.add_argument("--repeats", type=int, default=1)
    p.add_argument("--variants", default="contiguous+inference,channels_last+inference")
    p.add_argument("--set", action="append", default=[], metavar="SECTION.KEY=VALUE", help="for every row")
    p.add_argument("--out", default="round_speed", help="results/<out>.json and .png (default round_speed)")
    p.add_argument("--merge", action="store_true", help="replace only these rows in an existing results/<out>.json")
    p.add_argument("--replot", action="store_true", help="only draw results/<out>.png again from results/<out>.json")
    args = p.parse_args(argv)
    if args.replot:
        rows = json.loads((RESULTS / f"{args.out}.json").read_text(encoding="utf-8"))["rows"]
        plot(rows, RESULTS / f"{args.out}.png")
        return 0
    results = {name: run_row(name, args) for name in args.rows}
    failed = [name for name, r in results.items() if r is None]
    RESULTS.mkdir(parents=True, exist_ok=True)
    out = RESULTS / f"{args.out}.json"
    if args.merge and out.is_file():
        kept = {r["row"]: r for r in json.loads(out.read_text(encoding="utf-8"))["rows"]}
        results = {**kept, **{k: v for k, v in results.items() if v is not None}}
    rows = [results[name] for name in ROWS if results.get(name) is not None]
    if not rows:
        return 1
    out.write_text(json.dumps({"rows": rows}, indent=1, default=str) + "\n", encoding="utf-8")
    plot(rows, RESULTS / f"{args.out}.png")
    print(f"{'row':<22}{'s/round':>9}{'CPU s':>8}{'ref CPU s':>10}{'CPU ratio':>10}{'wall ratio':>11}{'RSS MiB':>9}")
    for r in rows:
        print(
            f"{r['row']:<22}{r['seconds_per_round']:>9.2f}{r['cpu_seconds_per_round']:>8.2f}"
            f"{r['reference_best_cpu_seconds']:>10.2f}{r['ratio_best_cpu']:>9.2f}x{r['ratio_best']:>10.2f}x"
            f"{r['peak_rss_mb']:>9.0f}"
        )
    print(f"results: {out}")
    if failed:
        print(f"failed rows (see above): {', '.join(failed)}", file=sys.stderr)
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
