"""Accuracy, pseudo-label flow, traffic and speed of every algorithm on MNIST-5k, over seeds.

Each row is a shipped config under ``configs/mnist5k/`` (plus, for a few variant rows, overrides
named in the row), run with the local simulator for every seed (default 0, 1, 2; the seed also
draws the split, so the 50 server labels differ between seeds). Per row the page gives the mean
and standard deviation of the final and best test accuracy, and beside them the clients' mean
pseudo-label mask rate and pseudo-label accuracy over the run, so a reader sees whether the
semi-supervised part ran. Traffic is relative to dense FedAvg (every sampled client receiving and
sending one full model), as FedMatch's Table 1 reports it. It writes

* ``benchmarks/results/ssfl_results.json``: every run's figures, with machine and settings;
* ``docs/results.md``: the table (regenerated wholesale; the measured notes live in
  ``docs/results_notes.md`` and are appended as they are).

Usage::

    python benchmarks/ssfl_results.py                           # every row, seeds 0 1 2, 2 processes
    python benchmarks/ssfl_results.py --rows fedmatch --seeds 0 # rows whose name contains "fedmatch"
    python benchmarks/ssfl_results.py --render-only             # rewrite the page from the JSON
    python benchmarks/ssfl_results.py --missing-only            # resume a stopped sweep
    python benchmarks/ssfl_results.py --json /tmp/t.json --doc /tmp/t.md \
        --row "lr 0.1=fedmatch.yaml:train_args.learning_rate=0.1"  # an ad-hoc row (tuning)
"""

from __future__ import annotations

import argparse
import json
import math
import os
import platform
import statistics
import sys
import time
from concurrent.futures import ProcessPoolExecutor, as_completed
from dataclasses import dataclass, field
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

CONFIGS = ROOT / "configs" / "mnist5k"


@dataclass(frozen=True)
class Row:
    """One table row: a config, optional overrides, the label scenario and the row's group."""

    name: str
    config: str
    overrides: tuple[str, ...] = field(default_factory=tuple)


# The table's order: labels-at-server (bounds and controls, the papers' methods, the naive baselines),
# then labels-at-client.
ROWS = [
    Row("server_only", "server_only.yaml"),
    Row("fedavg_sl (upper bound: every client sample labeled)", "fedavg_sl.yaml"),
    Row("fedavg_ssl (CRL, GN, FedAvg; paper defaults, 30 rounds)", "fedavg_ssl.yaml"),
    Row(
        "fedavg_ssl (control: tau = 1, no client sample can pass; the dilution of Eq. 5 alone)",
        "fedavg_ssl.yaml",
        ("ssfl_args.threshold=1.0",),
    ),
    Row("fedavg_ssl (CRL, GN, grouping S=2; paper defaults, 30 rounds)", "fedavg_ssl_grouping.yaml"),
    Row("fedavg_ssl (CRL, GN, FedAvg; bootstrapped from server-only)", "fedavg_ssl_bootstrap.yaml"),
    Row("semifl (the main job)", "semifl.yaml"),
    Row("fedseal", "fedseal.yaml"),
    Row("fedmatch", "fedmatch.yaml"),
    Row(
        "fedmatch (control: Phi off, lambda_a = lambda_i = 0)",
        "fedmatch.yaml",
        ("ssfl_args.lambda_a=0", "ssfl_args.lambda_i=0"),
    ),
    Row("fedsiam", "fedsiam.yaml"),
    Row("fedavg_fixmatch", "fedavg_fixmatch.yaml"),
    Row(
        "fedavg_fixmatch (control: Zhang et al.'s parallel protocol)",
        "fedavg_fixmatch.yaml",
        ("ssfl_args.server_protocol=parallel",),
    ),
    Row("fedprox_fixmatch", "fedprox_fixmatch.yaml"),
    Row("fedavg_uda", "fedavg_uda.yaml"),
    Row("fedprox_uda", "fedprox_uda.yaml"),
    Row("fedavg_sl (labels-at-client; upper bound: every client sample labeled)", "fedavg_sl_client.yaml"),
    Row("fedmatch (labels-at-client)", "fedmatch_client.yaml"),
    Row("fedsiam (labels-at-client)", "fedsiam_client.yaml"),
    Row("fedavg_fixmatch (labels-at-client)", "fedavg_fixmatch_client.yaml"),
    Row("fedprox_fixmatch (labels-at-client)", "fedprox_fixmatch_client.yaml"),
    Row("fedavg_uda (labels-at-client)", "fedavg_uda_client.yaml"),
    Row("fedprox_uda (labels-at-client)", "fedprox_uda_client.yaml"),
    Row("local_sl (labels-at-client; every client sample labeled)", "local_sl_client.yaml"),
    Row("local_fixmatch (labels-at-client)", "local_fixmatch_client.yaml"),
    Row("local_uda (labels-at-client)", "local_uda_client.yaml"),
]


REFERENCE = {"server": "server_only", "client": "local_fixmatch (labels-at-client)"}
"""Per label scenario, the row every other row is compared with seed by seed (same split): the
lower bound of labels-at-server and the local semi-supervised baseline of labels-at-client."""


def parse_row(spec: str) -> Row:
    """``NAME=CONFIG[:OVERRIDE,OVERRIDE...]`` -> :class:`Row`."""
    name, _, rest = spec.partition("=")
    config, _, overrides = rest.partition(":")
    if not name or not config:
        raise SystemExit(f"ssfl_results: --row {spec!r} is not NAME=CONFIG[:OVERRIDE,...]")
    return Row(name, config, tuple(o for o in overrides.split(",") if o))


def machine() -> str:
    import torch

    return (
        f"{platform.processor() or platform.machine()}, {os.cpu_count()} cores, 1 torch thread per run, "
        f"torch {torch.__version__}"
    )


def _mean_of(rows: list[dict], key: str) -> float | None:
    values = [r[key] for r in rows if isinstance(r.get(key), (int, float)) and math.isfinite(r[key])]
    return sum(values) / len(values) if values else None


def run_one(row: Row, seed: int, out_dir: str) -> dict:
    """Run one (row, seed) in this process; return its figures."""
    import torch

    torch.set_num_threads(1)
    from fedml_ssfl.config import load_config
    from fedml_ssfl.runtime.local import run_local

    base = [
        "common_args.compare_with=[]",
        "tracking_args.progress_bar=false",
        "tracking_args.enable_tensorboard=false",
        f"common_args.output_dir={out_dir}",
        f"common_args.random_seed={seed}",
    ]
    cfg = load_config(CONFIGS / row.config, [*base, *row.overrides])
    slug = "".join(c if c.isalnum() else "_" for c in row.name)[:80]
    t0 = time.perf_counter()
    res = run_local(cfg, run_dir=Path(out_dir) / f"{slug}-s{seed}")
    metrics = [json.loads(x) for x in (res.run_dir / "metrics.jsonl").read_text().splitlines()]
    s = res.summary
    return {
        "row": row.name,
        "seed": seed,
        "config": f"configs/mnist5k/{row.config}",
        "overrides": list(row.overrides),
        "algorithm": cfg.algorithm,
        "labels": cfg.data_args.label_scenario,
        "final_acc": res.final_acc,
        "best_acc": res.best_acc,
        "mask_rate": _mean_of(metrics, "client_mask_rate"),
        "pseudo_acc": _mean_of(metrics, "client_pseudo_acc"),
        "last_mask_rate": metrics[-1].get("client_mask_rate") if metrics else None,
        "bytes_up_per_round": s["bytes_up_per_round"],
        "bytes_down_per_round": s["bytes_down_per_round"],
        "dense_round_bytes": dense_round_bytes(cfg),
        "seconds_per_round": s["seconds_per_round"],
        "rounds": s["rounds_completed"],
        "wall_seconds": time.perf_counter() - t0,
        "settings": (
            f"{cfg.model_args.model}-{cfg.model_args.norm}, K={cfg.train_args.client_num_in_total}, "
            f"C_k={cfg.train_args.client_num_per_round}, {cfg.train_args.comm_round} rounds of "
            f"T={cfg.train_args.local_steps}"
        ),
    }


def dense_round_bytes(cfg) -> int:
    """Bytes one way of a dense FedAvg round: C_k clients times one full model."""
    from fedml_ssfl.algorithms.base import Message, message_nbytes
    from fedml_ssfl.experiment import load_experiment_dataset, model_factory
    from fedml_ssfl.training import cpu_state

    model = model_factory(cfg, load_experiment_dataset(cfg))()
    return cfg.train_args.client_num_per_round * message_nbytes(Message(weights=cpu_state(model)))


def _pm(values: list[float], scale: float = 100.0, digits: int = 1, signed: bool = False) -> str:
    """``mean ± sample standard deviation`` of ``values`` times ``scale`` (just the mean for one value)."""
    if not values:
        return ""
    mean = scale * statistics.fmean(values)
    text = f"{mean:+.{digits}f}" if signed else f"{mean:.{digits}f}"
    if len(values) == 1:
        return text
    return f"{text} ± {scale * statistics.stdev(values):.{digits}f}"


def summarize(runs: list[dict]) -> list[dict]:
    """Group runs by row (in ROWS order, unknown rows last) into mean / std figures."""
    order = {r.name: i for i, r in enumerate(ROWS)}
    groups: dict[str, list[dict]] = {}
    for r in runs:
        groups.setdefault(r["row"], []).append(r)
    by_seed = {(r["row"], r["seed"]): r["final_acc"] for r in runs}
    out = []
    for name in sorted(groups, key=lambda n: order.get(n, len(order))):
        g = sorted(groups[name], key=lambda r: r["seed"])
        dense = g[0].get("dense_round_bytes") or 0

        def vals(key: str, g: list[dict] = g) -> list[float]:
            return [r[key] for r in g if isinstance(r.get(key), (int, float))]

        ref = REFERENCE.get(g[0]["labels"])
        delta = [
            r["final_acc"] - by_seed[(ref, r["seed"])] for r in g if ref and ref != name and (ref, r["seed"]) in by_seed
        ]
        out.append(
            {
                "row": name,
                "delta": delta,
                "reference": ref if delta else None,
                "config": g[0]["config"]
                + (" " + " ".join(f"--set {o}" for o in g[0]["overrides"]) if g[0]["overrides"] else ""),
                "labels": g[0]["labels"],
                "seeds": [r["seed"] for r in g],
                "final": vals("final_acc"),
                "best": vals("best_acc"),
                "mask_rate": vals("mask_rate"),
                "pseudo_acc": vals("pseudo_acc"),
                "c2s": statistics.fmean(vals("bytes_up_per_round")) / dense if dense else None,
                "s2c": statistics.fmean(vals("bytes_down_per_round")) / dense if dense else None,
                "seconds_per_round": statistics.fmean(vals("seconds_per_round")),
                "settings": g[0].get("settings", ""),
            }
        )
    return out


def render(meta: dict, runs: list[dict], notes: str) -> str:
    rows = summarize(runs)
    lines = [
        "# Results on the shipped data",
        "",
        "Produced by `python benchmarks/ssfl_results.py` (rerun it to regenerate this page; every run's",
        "figures are in `benchmarks/results/ssfl_results.json`, the notes below come from",
        "`docs/results_notes.md`).",
        "",
        f"Data: MNIST-5k (4,000 training / 1,000 test images). Machine: {meta['machine']}. Date: {meta['date']}.",
        "Each row is one shipped config, run once per seed (the seed also draws the split: which 50 images the",
        "server labels, which client holds what); accuracy is the mean ± standard deviation over the seeds.",
        "Labels-at-server: 50 labels on the server, clients unlabeled. Labels-at-client: 5 labels per class on",
        "each client (500 in all), none on the server. `mask rate`: the share of the clients' unlabeled samples",
        "that carried a pseudo-label into the loss (mean over rounds and clients); `PL acc`: the accuracy of",
        "those pseudo-labels against the hidden labels (diagnostics only). `vs reference`: the row's final",
        "accuracy minus the reference row's on the same seed (same split), mean ± std over the seeds; the reference",
        "is `server_only` for labels-at-server and `local_fixmatch` for labels-at-client. Traffic: bytes over C_k",
        "dense models per round each way (C2S = up, S2C = down), as in FedMatch's Table 1. Seconds per round are",
        "wall-clock with two runs sharing the two cores: compare within this table only.",
        "",
        "| method | config | labels at | seeds | final test acc (%) | vs reference, same seed (points) "
        "| best test acc (%) | mask rate (%) | PL acc (%) | C2S vs FedAvg | S2C vs FedAvg | s / round |",
        "|---|---|---|---|---:|---:|---:|---:|---:|---:|---:|---:|",
    ]
    for r in rows:
        rel = [f"{100 * r[k]:.0f}%" if r[k] is not None else "" for k in ("c2s", "s2c")]
        vs = (
            f"{_pm(r['delta'], signed=True)}" if r["delta"] else ("reference" if r["row"] in REFERENCE.values() else "")
        )
        lines.append(
            f"| {r['row']} | `{r['config']}` | {r['labels']} | {len(r['seeds'])} | {_pm(r['final'])} | {vs} | "
            f"{_pm(r['best'])} | {_pm(r['mask_rate'])} | {_pm(r['pseudo_acc'])} | {rel[0]} | {rel[1]} | "
            f"{r['seconds_per_round']:.2f} |"
        )
    settings = sorted({r["settings"] for r in rows if r["settings"]})
    lines += ["", "Settings per config (model, clients, rounds): " + "; ".join(settings) + "."]
    return "\n".join(lines) + "\n\n" + notes


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--rows", nargs="*", help="run only the rows whose name contains one of these strings")
    parser.add_argument(
        "--row",
        action="append",
        default=[],
        metavar="NAME=CONFIG[:OVERRIDE,...]",
        help="an ad-hoc row (a config under configs/mnist5k/ and overrides); runs only the ad-hoc rows",
    )
    parser.add_argument("--seeds", type=int, nargs="*", default=[0, 1, 2])
    parser.add_argument("--jobs", type=int, default=2, help="runs in parallel, one process each (default 2)")
    parser.add_argument("--out-dir", default="/tmp/fedml_ssfl_results", help="where the runs go")
    parser.add_argument("--render-only", action="store_true", help="rewrite the page from the JSON, run nothing")
    parser.add_argument(
        "--missing-only", action="store_true", help="resume a stopped sweep: skip (row, seed) runs the JSON already has"
    )
    parser.add_argument("--doc", default=str(ROOT / "docs" / "results.md"))
    parser.add_argument("--notes", default=str(ROOT / "docs" / "results_notes.md"))
    parser.add_argument("--json", default=str(ROOT / "benchmarks" / "results" / "ssfl_results.json"))
    args = parser.parse_args(argv)
    path = Path(args.json)
    data = json.loads(path.read_text()) if path.is_file() else {}
    runs = data.get("runs", [])
    notes = Path(args.notes).read_text() if Path(args.notes).is_file() else ""
    if args.render_only:
        Path(args.doc).write_text(render(data, runs, notes))
        return 0
    chosen = [r for r in ROWS if not args.rows or any(part in r.name for part in args.rows)]
    if args.row:
        chosen = [parse_row(spec) for spec in args.row]
    missing = [r.config for r in chosen if not (CONFIGS / r.config).is_file()]
    if missing:
        print(f"ssfl_results: no config {', '.join(missing)} under {CONFIGS}", file=sys.stderr)
        return 2
    # seed-major: a sweep stopped early still has every row for its first seeds
    jobs = [(row, seed) for seed in args.seeds for row in chosen]
    if args.missing_only:
        have = {(x["row"], x["seed"]) for x in runs}
        jobs = [(row, seed) for row, seed in jobs if (row.name, seed) not in have]
    os.environ.setdefault("OMP_NUM_THREADS", "1")
    done: list[dict] = []
    with ProcessPoolExecutor(max_workers=max(args.jobs, 1)) as pool:
        futures = {pool.submit(run_one, row, seed, args.out_dir): (row, seed) for row, seed in jobs}
        for fut in as_completed(futures):
            row, seed = futures[fut]
            r = fut.result()
            done.append(r)
            acc, secs = 100 * r["final_acc"], r["wall_seconds"]
            print(f"{row.name} seed {seed}: {acc:.1f}% (mask rate {r['mask_rate']}) in {secs:.0f} s", flush=True)
            # keep what finished so far: a stopped sweep loses nothing
            key = {(x["row"], x["seed"]) for x in done}
            merged = [x for x in runs if (x["row"], x["seed"]) not in key] + done
            meta = {"machine": machine(), "date": time.strftime("%Y-%m-%d")}
            path.parent.mkdir(parents=True, exist_ok=True)
            path.write_text(json.dumps({**meta, "runs": merged}, indent=2) + "\n")
    data = json.loads(path.read_text())
    Path(args.doc).write_text(render(data, data["runs"], notes))
    print(f"wrote {args.doc} and {args.json}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
