"""Accuracy, client gain, pseudo-label flow, traffic and speed of every algorithm on MNIST-5k, over seeds.

Each row is a shipped config (plus, for a few variant rows, overrides named in the row), run with
the local simulator for every seed (default 0, 1, 2; the seed also draws the split, so the 50 server
labels differ between seeds). Two splits: ``configs/mnist5k/`` (IID, all ten clients every round:
every row) and ``configs/mnist5k_dirichlet/`` (Dirichlet(0.3) non-IID, five of ten clients a round:
the labels-at-server rows). Every labels-at-server row whose algorithm has a server side also runs
as its *idle control* (``train_args.idle_clients: true``: every sampled client sends back the model
it received) on the same seeds, and the page's ``client gain`` is the row's final accuracy minus its
idle control's, seed by seed. Per row the page gives the mean and standard deviation of the final
and best test accuracy, the difference to the row's reference (for labels-at-server, server_only
under the row's own config: the ``compare_with`` run ``fedml-ssfl run`` makes, one run per distinct
compare config, named ``server_only, compare run of CONFIG`` unless it is the split's server_only
row; local_fixmatch for labels-at-client), the client gain, the clients' mean pseudo-label mask rate and pseudo-label
accuracy over the run, traffic relative to dense FedAvg (FedMatch's Table 1) and seconds per round.
It writes

* ``benchmarks/results/ssfl_results.json``: every run's figures, with machine and settings;
* ``docs/results.md``: the tables (regenerated wholesale; the measured notes live in
  ``docs/results_notes.md`` and are appended as they are).

Usage::

    python benchmarks/ssfl_results.py                           # every row, seeds 0 1 2, 2 processes
    python benchmarks/ssfl_results.py --rows fedmatch --seeds 0 # rows whose name contains "fedmatch"
    python benchmarks/ssfl_results.py --render-only             # rewrite the page from the JSON
    python benchmarks/ssfl_results.py --missing-only            # resume a stopped sweep
    python benchmarks/ssfl_results.py --plan                    # list the runs it would make, run nothing
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

CONFIG_ROOT = ROOT / "configs"
SPLITS = {
    "mnist5k": "IID, K = 10, all 10 clients every round",
    "mnist5k_dirichlet": "Dirichlet(0.3) non-IID, K = 10, 5 clients a round",
}
"""The splits (config folders under ``configs/``) and how the page names them."""
IDLE = "train_args.idle_clients=true"
IDLE_SUFFIX = " [idle control]"


@dataclass(frozen=True)
class Row:
    """One table row: a config (in the ``split`` folder), optional overrides; ``idle``: the row's idle control."""

    name: str
    config: str
    overrides: tuple[str, ...] = field(default_factory=tuple)
    split: str = "mnist5k"
    idle: bool = False
    control_of: str = ""  # the idle control's row (its name without the suffix)
    reference: bool = False  # run server_only under this config (its compare run), not the config's algorithm

    @property
    def path(self) -> Path:
        return CONFIG_ROOT / self.split / self.config

    def idle_control(self) -> Row:
        return Row(self.name + IDLE_SUFFIX, self.config, (*self.overrides, IDLE), self.split, True, self.name)


# The table's order: labels-at-server (bounds and controls, the papers' methods, the naive baselines),
# then labels-at-client. ``with_idle``: rows that also run as their idle control (``idle_rows``).
SERVER_ROWS = [
    Row("server_only", "server_only.yaml"),
    Row("fedavg_sl (upper bound: every client sample labeled)", "fedavg_sl.yaml"),
    Row("fedavg_ssl (CRL, GN, FedAvg; paper defaults, 30 rounds)", "fedavg_ssl.yaml"),
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
]
CLIENT_ROWS = [
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
SECOND_SPLIT = "mnist5k_dirichlet"
SECOND_ROWS = [
    Row(r.name, r.config, r.overrides, SECOND_SPLIT)
    for r in SERVER_ROWS
    if (CONFIG_ROOT / SECOND_SPLIT / r.config).is_file() and not r.overrides
]
"""The labels-at-server rows on the second split (each method's own config, no variant rows)."""

NO_IDLE = {"server_only"}
"""Rows without an idle control (the switch means nothing: no clients)."""
CLIENT_ONLY_OVERRIDES = ("ssfl_args.lambda_a", "ssfl_args.lambda_i")
"""Overrides that only change what clients do: such a variant's idle control is its base row's, not run twice."""


def with_idle(rows: list[Row]) -> list[Row]:
    """``rows``, each labels-at-server row followed by its idle control where it has one."""
    out = []
    for r in rows:
        out.append(r)
        client_only = r.overrides and all(o.startswith(CLIENT_ONLY_OVERRIDES) for o in r.overrides)
        if r.name not in NO_IDLE and not client_only and not r.idle:
            out.append(r.idle_control())
    return out


ROWS = [*with_idle(SERVER_ROWS), *CLIENT_ROWS, *with_idle(SECOND_ROWS)]
REF_PREFIX = "server_only, compare run of "


def compare_config(row: Row, base: list[str] = ()):
    """The config of ``row``'s server_only compare run: what ``fedml-ssfl run`` runs for ``compare_with``.

    The row's config with its overrides, then ``ExperimentConfig.with_algorithm("server_only")``:
    same data, split, model and ``train_args``; only ``ssfl_args`` is reset.
    """
    from fedml_ssfl.config import load_config

    return load_config(row.path, [*base, *row.overrides]).with_algorithm("server_only", run_name="server_only")


def _compare_key(row: Row) -> str:
    d = compare_config(row).to_dict()
    d["common_args"].pop("run_name", None)
    return json.dumps(d, sort_keys=True)


def same_config_references(rows: list[Row]) -> tuple[list[Row], dict[tuple[str, str], str], dict[str, list[str]]]:
    """Each labels-at-server row's same-config server_only reference.

    Rows whose compare configs are equal (after ``with_algorithm``; the run name aside) share one
    reference run; where a plain ``server_only`` row of the split has that config, it is the
    reference (its runs are reused). Returns the reference rows to run, ``(split, row) -> reference
    row name``, and per reference row the configs it stands for.
    """
    groups: dict[str, list[Row]] = {}
    for r in rows:
        if r.idle or r.reference or r.split not in SPLITS:
            continue
        if not r.path.is_file() or load_labels(r) != "server":
            continue
        groups.setdefault(_compare_key(r), []).append(r)
    extra, ref_of, covers = [], {}, {}
    for members in groups.values():
        plain = next((m for m in members if m.name == "server_only" and not m.overrides), None)
        if plain is not None:
            name = plain.name
        else:
            first = members[0]
            name = REF_PREFIX + f"configs/{first.split}/{first.config}"
            extra.append(Row(name, first.config, (), first.split, reference=True))
        for m in members:
            ref_of[(m.split, m.name)] = name
        covers[f"{members[0].split}/{name}"] = sorted({f"configs/{m.split}/{m.config}" for m in members})
    return extra, ref_of, covers


def load_labels(row: Row) -> str:
    from fedml_ssfl.config import load_config

    return load_config(row.path, list(row.overrides)).data_args.label_scenario


REF_ROWS, REF_OF, REF_COVERS = same_config_references(ROWS)
"""The same-config server_only references (rows to run), each row's reference, what each stands for."""
ROWS = [*ROWS, *REF_ROWS]

IDLE_OF = {
    (r.split, r.name): next(
        (b.name + IDLE_SUFFIX for b in ROWS if (b.split, b.config) == (r.split, r.config) and not b.overrides),
        r.name + IDLE_SUFFIX,
    )
    if r.overrides and all(o.startswith(CLIENT_ONLY_OVERRIDES) for o in r.overrides)
    else r.name + IDLE_SUFFIX
    for r in ROWS
    if not r.idle
}
"""(split, row) -> the row's idle control: its own, or for a variant that only changes the clients its base row's."""


DEFAULT_SEEDS = (0, 1, 2)
"""The sweep's seeds (``--seeds`` default)."""

REFERENCE = {"server": "server_only", "client": "local_fixmatch (labels-at-client)"}
"""Per label scenario, the row every other row is compared with seed by seed (same split): the
lower bound of labels-at-server and the local semi-supervised baseline of labels-at-client."""


def parse_row(spec: str) -> Row:
    """``NAME=[SPLIT/]CONFIG[:OVERRIDE,OVERRIDE...]`` -> :class:`Row` (SPLIT: a folder under configs/)."""
    name, _, rest = spec.partition("=")
    config, _, overrides = rest.partition(":")
    if not name or not config:
        raise SystemExit(f"ssfl_results: --row {spec!r} is not NAME=[SPLIT/]CONFIG[:OVERRIDE,...]")
    split, _, config = config.rpartition("/")
    items = tuple(o for o in overrides.split(",") if o)
    return Row(name, config, items, split or "mnist5k", IDLE in items)


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
    cfg = compare_config(row, base) if row.reference else load_config(row.path, [*base, *row.overrides])
    slug = "".join(c if c.isalnum() else "_" for c in f"{row.split}-{row.name}")[:100]
    t0 = time.perf_counter()
    res = run_local(cfg, run_dir=Path(out_dir) / f"{slug}-s{seed}")
    metrics = [json.loads(x) for x in (res.run_dir / "metrics.jsonl").read_text().splitlines()]
    s = res.summary
    return {
        "row": row.name,
        "split": row.split,
        "idle": row.idle,
        "reference": row.reference,
        "control_of": row.control_of,
        "seed": seed,
        "config": f"configs/{row.split}/{row.config}",
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


def split_of(run: dict) -> str:
    """A run's split (runs written before the second split have none: the first)."""
    return run.get("split", "mnist5k")


def summarize(runs: list[dict]) -> list[dict]:
    """Group runs by (split, row), in ROWS order (unknown rows last), into mean / std figures.

    Each summary holds the paired differences with the split's reference row (``delta``) and with the
    row's own idle control (``gain``), seed by seed, over the seeds both have.
    """
    order = {(r.split, r.name): i for i, r in enumerate(ROWS)}
    groups: dict[tuple[str, str], list[dict]] = {}
    for r in runs:
        groups.setdefault((split_of(r), r["row"]), []).append(r)
    by_seed = {(split_of(r), r["row"], r["seed"]): r["final_acc"] for r in runs}
    out = []
    for key in sorted(groups, key=lambda k: (order.get(k, len(order)), k)):
        split, name = key
        g = sorted(groups[key], key=lambda r: r["seed"])
        dense = g[0].get("dense_round_bytes") or 0

        def vals(field_name: str, g: list[dict] = g) -> list[float]:
            return [r[field_name] for r in g if isinstance(r.get(field_name), (int, float))]

        def paired(other: str | None, g: list[dict] = g, split: str = split) -> list[float]:
            if not other:
                return []
            pairs = [(r, (split, other, r["seed"])) for r in g]
            return [r["final_acc"] - by_seed[key] for r, key in pairs if key in by_seed]

        ref = REFERENCE.get(g[0]["labels"])
        if g[0]["labels"] == "server":
            ref = REF_OF.get(key, ref)
        idle_name = IDLE_OF.get(key, name + IDLE_SUFFIX)
        out.append(
            {
                "row": name,
                "split": split,
                "idle": bool(g[0].get("idle")),
                "reference": bool(g[0].get("reference")),
                "ref_row": ref,
                "delta": paired(ref) if ref != name else [],
                "gain": paired(idle_name),
                "has_idle": any((split, idle_name, r["seed"]) in by_seed for r in g),
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


def _paired_cell(values: list[float], seeds: list[int]) -> str:
    """A paired difference, with its seed count where it covers fewer seeds than the row has."""
    if not values:
        return ""
    text = _pm(values, signed=True)
    return text if len(values) == len(seeds) else f"{text} ({len(values)} seeds)"


TABLE_HEAD = [
    "| method | config | seeds | final test acc (%) | reference's final acc (%) | vs reference, same seed (points) | "
    "client gain: vs own idle control, same seed (points) | idle control's final acc (%) | best test acc (%) | "
    "mask rate (%) | PL acc (%) | C2S vs FedAvg | S2C vs FedAvg | s / round |",
    "|---|---|---|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|",
]


def _table(rows: list[dict], idle: dict[tuple[str, str], dict], most: int, every: dict | None = None) -> list[str]:
    lines = list(TABLE_HEAD)
    every = every or {}
    for r in rows:
        ref_row = every.get((r["split"], r.get("ref_row") or ""))
        ref_final = _pm(ref_row["final"]) if ref_row and ref_row["row"] != r["row"] else ""
        rel = [f"{100 * r[k]:.0f}%" if r[k] is not None else "" for k in ("c2s", "s2c")]
        if r["delta"]:
            vs = _paired_cell(r["delta"], r["seeds"])
        else:
            vs = "reference" if r["row"] in REFERENCE.values() else ""
        control = idle.get((r["split"], IDLE_OF.get((r["split"], r["row"]), r["row"] + IDLE_SUFFIX)))
        gain = _paired_cell(r["gain"], r["seeds"])
        if not gain and r["labels"] == "client":
            gain = "" if r["row"] in REFERENCE.values() else "see vs reference (local)"
        elif not gain and r["row"] in NO_IDLE:
            gain = "no clients to idle"
        seeds = str(len(r["seeds"])) if len(r["seeds"]) == most else f"{len(r['seeds'])} of {most}"
        lines.append(
            f"| {r['row']} | `{r['config']}` | {seeds} | {_pm(r['final'])} | {ref_final} | {vs} | {gain} | "
            f"{_pm(control['final']) if control else ''} | {_pm(r['best'])} | {_pm(r['mask_rate'])} | "
            f"{_pm(r['pseudo_acc'])} | {rel[0]} | {rel[1]} | {r['seconds_per_round']:.2f} |"
        )
    return lines


def _orderings(rows: list[dict]) -> list[str]:
    """The labels-at-server methods side by side on both splits: final accuracy and client gain."""
    first = {r["row"]: r for r in rows if r["split"] == "mnist5k" and r["labels"] == "server" and not r["idle"]}
    second = {r["row"]: r for r in rows if r["split"] == SECOND_SPLIT and not r["idle"]}
    names = [n for n in first if n in second]
    if not names:
        return []
    lines = [
        "| method | IID, all clients: final (%) | client gain | Dirichlet(0.3), 5 of 10: final (%) | client gain |",
        "|---|---:|---:|---:|---:|",
    ]
    for n in names:
        a, b = first[n], second[n]
        lines.append(
            f"| {n} | {_pm(a['final'])} | {_paired_cell(a['gain'], a['seeds'])} | {_pm(b['final'])} | "
            f"{_paired_cell(b['gain'], b['seeds'])} |"
        )
    return lines


def render(meta: dict, runs: list[dict], notes: str) -> str:
    rows = summarize(runs)
    idle = {(r["split"], r["row"]): r for r in rows if r["idle"]}
    shown = [r for r in rows if not r["idle"] and not r["reference"]]
    every = {(r["split"], r["row"]): r for r in rows}
    most = max([len(DEFAULT_SEEDS), *(len(r["seeds"]) for r in rows)])
    lines = [
        "# Results on the shipped data",
        "",
        "Produced by `python benchmarks/ssfl_results.py` (rerun it to regenerate this page; every run's",
        "figures are in `benchmarks/results/ssfl_results.json`, the notes below come from",
        "`docs/results_notes.md`).",
        "",
        f"Data: MNIST-5k (4,000 training / 1,000 test images). Machine: {meta['machine']}. Date: {meta['date']}.",
        "Each row is one shipped config, run once per seed (the seed also draws the split: which 50 images the",
        "server labels, which client holds what, and which clients a round samples); accuracy is the mean ±",
        f"standard deviation over the seeds. Every row has {most} seeds unless its `seeds` cell says `n of {most}`.",
        "Labels-at-server: 50 labels on the server, clients unlabeled. Labels-at-client: 5 labels per class on",
        "each client (500 in all), none on the server. `vs reference`: the row's final accuracy minus its",
        "reference's on the same seed (same split), mean ± std over the seeds. For labels-at-server the reference",
        "is server_only *under the row's own config*: the compare run `fedml-ssfl run CONFIG` makes",
        "(`ExperimentConfig.with_algorithm('server_only')`: the config's data, split, model, rounds, optimiser and",
        "schedule; only `ssfl_args` reset), listed below the tables; for labels-at-client (no server labels) it is",
        "`local_fixmatch`. `client gain`: the row's final accuracy",
        "minus that of its own *idle control* on the same seed: the same config with `train_args.idle_clients:",
        "true`, where every sampled client sends back the model it received (same server path, rounds, seeds",
        "and traffic accounting; docs/algorithms.md). It is what the unlabeled clients add; `vs reference` also",
        "counts what a method's server path does differently from server_only. Labels-at-client rows keep their",
        "local reference (local_fixmatch) instead. `mask rate`: the share of the clients' unlabeled samples that",
        "carried a pseudo-label into the loss (mean over rounds and clients); `PL acc`: the accuracy of those",
        "pseudo-labels against the hidden labels (diagnostics only). Traffic: bytes over C_k dense models per",
        "round each way (C2S = up, S2C = down), as in FedMatch's Table 1. Seconds per round are wall-clock with",
        "two runs sharing the two cores with other work: compare within this table only.",
    ]
    have = {(split_of(r), r["row"]) for r in runs}
    missing_rows = [r for r in ROWS if (r.split, r.name) not in have]
    planned = len(ROWS) * len(DEFAULT_SEEDS)
    if len(runs) < planned:
        lines += [
            "",
            f"**This sweep is not complete: the page shows {len(runs)} of its {planned} runs** ({len(ROWS)} rows x "
            f"seeds {', '.join(map(str, DEFAULT_SEEDS))}); {len(missing_rows)} rows have no run yet and are not in "
            "the tables, and a row's `seeds` cell says how many of its seeds have run. "
            "`python benchmarks/ssfl_results.py --missing-only` completes it.",
        ]
    sections = [
        ("mnist5k", "server", f"Labels-at-server, split 1: {SPLITS['mnist5k']}"),
        ("mnist5k", "client", f"Labels-at-client, split 1: {SPLITS['mnist5k']}"),
        (SECOND_SPLIT, "server", f"Labels-at-server, split 2: {SPLITS[SECOND_SPLIT]}"),
    ]
    for split, labels, title in sections:
        part = [r for r in shown if r["split"] == split and r["labels"] == labels]
        if part:
            lines += ["", f"## {title}", "", *_table(part, idle, most, every)]
    order = _orderings(rows)
    if order:
        lines += [
            "",
            "## Which orderings hold on both splits",
            "",
            "The labels-at-server methods on the two splits (final accuracy and client gain, mean ± std over the",
            "seeds; from the tables above).",
            "",
            *order,
        ]
    refs = [r for r in rows if r["reference"] or (r["row"] == "server_only" and r["labels"] == "server")]
    if refs:
        lines += [
            "",
            "## The same-config server_only references",
            "",
            "Configs whose compare runs are the same config (the run name aside) share one run; where that config",
            "is a split's `server_only.yaml`, its row is the reference.",
            "",
            "| reference | seeds | final test acc (%) | best test acc (%) | settings | stands for |",
            "|---|---|---:|---:|---|---|",
        ]
        for r in refs:
            covers = ", ".join(f"`{c}`" for c in REF_COVERS.get(f"{r['split']}/{r['row']}", []))
            lines.append(
                f"| {r['row']} ({r['split']}) | {len(r['seeds'])} of {most} | {_pm(r['final'])} | {_pm(r['best'])} | "
                f"{r['settings']} | {covers} |"
            )
    settings = sorted({r["settings"] for r in rows if r["settings"]})
    lines += ["", "Settings per config (model, clients, rounds): " + "; ".join(settings) + "."]
    return "\n".join(lines) + "\n\n" + notes


def before_after(before: list[dict], after: list[dict]) -> str:
    """A markdown table of each (split, row, seed) in both sweeps: final accuracy then and now."""
    then = {(split_of(r), r["row"], r["seed"]): r["final_acc"] for r in before}
    lines = ["| split | row | seed | before (%) | after (%) | moved (points) |", "|---|---|---:|---:|---:|---:|"]
    for r in sorted(after, key=lambda r: (split_of(r), r["row"], r["seed"])):
        key = (split_of(r), r["row"], r["seed"])
        if key in then:
            old, new = 100 * then[key], 100 * r["final_acc"]
            lines.append(f"| {key[0]} | {key[1]} | {key[2]} | {old:.1f} | {new:.1f} | {new - old:+.1f} |")
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--rows", nargs="*", help="run only the rows whose name contains one of these strings")
    parser.add_argument(
        "--row",
        action="append",
        default=[],
        metavar="NAME=[SPLIT/]CONFIG[:OVERRIDE,...]",
        help="an ad-hoc row (a config under configs/mnist5k/, or SPLIT/CONFIG, and overrides); runs only those rows",
    )
    parser.add_argument("--seeds", type=int, nargs="*", default=list(DEFAULT_SEEDS))
    parser.add_argument("--jobs", type=int, default=2, help="runs in parallel, one process each (default 2)")
    parser.add_argument("--out-dir", default="/tmp/fedml_ssfl_results", help="where the runs go")
    parser.add_argument("--render-only", action="store_true", help="rewrite the page from the JSON, run nothing")
    parser.add_argument("--plan", action="store_true", help="list the (row, seed) runs it would make, run nothing")
    parser.add_argument(
        "--before",
        metavar="JSON",
        help="print a table of the rows whose final accuracy moved against an earlier sweep's JSON (same row, "
        "split and seed), run nothing",
    )
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
    if args.before:
        print(before_after(json.loads(Path(args.before).read_text()).get("runs", []), runs))
        return 0
    if args.render_only:
        Path(args.doc).write_text(render(data, runs, notes))
        return 0
    chosen = [r for r in ROWS if not args.rows or any(part in r.name for part in args.rows)]
    if args.row:
        chosen = [parse_row(spec) for spec in args.row]
    missing = [str(r.path) for r in chosen if not r.path.is_file()]
    if missing:
        print(f"ssfl_results: no config {', '.join(missing)}", file=sys.stderr)
        return 2
    # seed-major: a sweep stopped early still has every row for its first seeds
    jobs = [(row, seed) for seed in args.seeds for row in chosen]
    if args.missing_only:
        have = {(split_of(x), x["row"], x["seed"]) for x in runs}
        jobs = [(row, seed) for row, seed in jobs if (row.split, row.name, seed) not in have]
    if args.plan:
        for row, seed in jobs:
            print(f"{row.split}: {row.name} seed {seed}")
        print(f"{len(jobs)} runs")
        return 0
    os.environ.setdefault("OMP_NUM_THREADS", "1")
    done: list[dict] = []
    with ProcessPoolExecutor(max_workers=max(args.jobs, 1)) as pool:
        futures = {pool.submit(run_one, row, seed, args.out_dir): (row, seed) for row, seed in jobs}
        for fut in as_completed(futures):
            row, seed = futures[fut]
            r = fut.result()
            done.append(r)
            acc, secs = 100 * r["final_acc"], r["wall_seconds"]
            print(
                f"[{len(done)}/{len(jobs)}] {row.split}: {row.name} seed {seed}: {acc:.1f}% "
                f"(mask rate {r['mask_rate']}) in {secs:.0f} s",
                flush=True,
            )
            # keep what finished so far: a stopped sweep loses nothing
            key = {(split_of(x), x["row"], x["seed"]) for x in done}
            merged = [x for x in runs if (split_of(x), x["row"], x["seed"]) not in key] + done
            meta = {"machine": machine(), "date": time.strftime("%Y-%m-%d")}
            path.parent.mkdir(parents=True, exist_ok=True)
            path.write_text(json.dumps({**meta, "runs": merged}, indent=2) + "\n")
    data = json.loads(path.read_text())
    Path(args.doc).write_text(render(data, data["runs"], notes))
    print(f"wrote {args.doc} and {args.json}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
