"""The reproduction harness: the seed papers' table rows the shipped configs target, run and compared.

``fedml-ssfl reproduce --list`` prints, for each row of :data:`ROWS`, the paper's number, the config
and the exact command. ``fedml-ssfl reproduce --data-dir DIR --device cpu|cuda`` runs the selected
rows through the same entry point as ``fedml-ssfl run`` (:func:`fedml_ssfl.runtime.local.run_local`)
on the datasets in ``DIR`` in their published formats (docs/inputs.md), writes one result file per
row and the paper-vs-ours page (docs/reproduction.md by default).

Resumable: a row whose result file (``OUT/results/<key>.json``) exists is skipped; a row with a run
folder (``OUT/runs/<key>``) holding a checkpoint but no result resumes from it (``run --resume``).
``--budget smoke`` cuts every row to :data:`SMOKE_SETTINGS` (2 rounds, 1 step, 4 clients, 20
server labels): a check that the row runs end to end on the data, in seconds to minutes, never a
reproduction; its results are marked ``smoke`` on the page and never count as paper scale.

The paper numbers below are the seed papers' (cited by paper, table and row); each config's header
names the row it reproduces. Deviations: FedMatch's Table 2 reports the averaged local-model
accuracy; this harness compares the global model's test accuracy, the only measure a run reports
(the row's ``measure`` says so on the page).
"""

from __future__ import annotations

import json
import os
import platform
import socket
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from .atomic import atomic_write
from .config import ConfigError, load_config

PAGE = "docs/reproduction.md"
"""Where the page goes by default, relative to the working directory."""

GLOBAL = "global-model test accuracy"
LOCAL_AVG = "averaged local-model accuracy (ours: global-model test accuracy)"


@dataclass(frozen=True)
class PaperRow:
    """One table row of a seed paper that a shipped config targets."""

    key: str
    """Short unique name (``--rows`` takes these)."""
    paper: str
    table: str
    row: str
    number: float
    """The paper's accuracy in percent."""
    config: str
    """The config, relative to the repository root."""
    dataset: str
    """The config's ``data_args.dataset`` (which folder of ``--data-dir`` it reads)."""
    measure: str = GLOBAL


ZHANG = "Zhang et al. 2020 (SSFL benchmark)"
FEDMATCH = "Jeong et al. 2021 (FedMatch)"
FEDSEAL = "Bian et al. 2021 (FedSEAL)"
SEMIFL = "Diao et al. 2022 (SemiFL)"

ROWS: tuple[PaperRow, ...] = (
    PaperRow("zhang-cifar10-fedavg", ZHANG, "Table 2", "CIFAR-10, GN + CRL, FedAvg averaging, K = C_k = 10",
             92.83, "configs/cifar10/crl_gn.yaml", "cifar10"),
    PaperRow("zhang-cifar10-grouping", ZHANG, "Table 2", "CIFAR-10, grouping-based averaging (S = 2), K = C_k = 10",
             93.38, "configs/cifar10/crl_gn_grouping.yaml", "cifar10"),
    PaperRow("zhang-svhn-fedavg", ZHANG, "Table 1", "SVHN, GN + CRL, K = C_k = 10",
             94.36, "configs/svhn/crl_gn.yaml", "svhn"),
    PaperRow("zhang-svhn-grouping", ZHANG, "Table 2", "SVHN, grouping-based averaging (S = 2), K = C_k = 20",
             94.99, "configs/svhn/crl_gn_grouping.yaml", "svhn"),
    PaperRow("zhang-emnist-fedavg", ZHANG, "Table 2", "EMNIST, FedAvg averaging, K = C_k = 47",
             70.84, "configs/emnist/crl.yaml", "emnist_balanced"),
    PaperRow("zhang-emnist-grouping", ZHANG, "Table 2", "EMNIST, grouping-based averaging (S = 5), K = C_k = 47",
             81.63, "configs/emnist/crl_grouping.yaml", "emnist_balanced"),
    PaperRow("fedmatch-cifar10-iid-client", FEDMATCH, "Table 1", "CIFAR-10 Batch-IID, labels-at-client, FedMatch",
             52.13, "configs/cifar10/fedmatch_batch_iid_client.yaml", "cifar10"),
    PaperRow("fedmatch-cifar10-noniid-client", FEDMATCH, "Table 1",
             "CIFAR-10 Batch-NonIID, labels-at-client, FedMatch",
             52.25, "configs/cifar10/fedmatch_batch_noniid_client.yaml", "cifar10"),
    PaperRow("fedmatch-cifar10-iid-server", FEDMATCH, "Table 1", "CIFAR-10 Batch-IID, labels-at-server, FedMatch",
             44.95, "configs/cifar10/fedmatch_batch_iid_server.yaml", "cifar10"),
    PaperRow("fedmatch-cifar10-noniid-server", FEDMATCH, "Table 1",
             "CIFAR-10 Batch-NonIID, labels-at-server, FedMatch",
             44.17, "configs/cifar10/fedmatch_batch_noniid_server.yaml", "cifar10"),
    PaperRow("fedmatch-fmnist-client", FEDMATCH, "Table 2",
             "Fashion-MNIST Streaming-NonIID, labels-at-client, FedMatch",
             77.95, "configs/fashion_mnist/fedmatch_streaming_client.yaml", "fashion_mnist", LOCAL_AVG),
    PaperRow("fedmatch-fmnist-server", FEDMATCH, "Table 2",
             "Fashion-MNIST Streaming-NonIID, labels-at-server, FedMatch",
             84.15, "configs/fashion_mnist/fedmatch_streaming_server.yaml", "fashion_mnist", LOCAL_AVG),
    PaperRow("fedmatch-fmnist-fedprox-uda-client", FEDMATCH, "Table 2",
             "Fashion-MNIST Streaming-NonIID, labels-at-client, FedProx-UDA",
             73.71, "configs/fashion_mnist/fedprox_uda_streaming_client.yaml", "fashion_mnist", LOCAL_AVG),
    PaperRow("fedmatch-fmnist-fedprox-uda-server", FEDMATCH, "Table 2",
             "Fashion-MNIST Streaming-NonIID, labels-at-server, FedProx-UDA",
             83.34, "configs/fashion_mnist/fedprox_uda_streaming_server.yaml", "fashion_mnist", LOCAL_AVG),
    PaperRow("fedmatch-fmnist-local-uda-client", FEDMATCH, "Table 2",
             "Fashion-MNIST Streaming-NonIID, labels-at-client, Local-UDA",
             70.70, "configs/fashion_mnist/local_uda_streaming_client.yaml", "fashion_mnist", LOCAL_AVG),
    PaperRow("fedseal-cifar10-iid", FEDSEAL, "Table 2", "CIFAR-10, IID, FedSEAL",
             81.16, "configs/cifar10/fedseal.yaml", "cifar10"),
    PaperRow("fedseal-fmnist-iid", FEDSEAL, "Table 1", "Fashion-MNIST, IID, FedSEAL",
             84.28, "configs/fashion_mnist/fedseal.yaml", "fashion_mnist"),
    PaperRow("semifl-cifar10-4000", SEMIFL, "Table 1", "CIFAR-10, N_S = 4000, IID, SemiFL",
             93.1, "configs/cifar10/semifl.yaml", "cifar10"),
    PaperRow("semifl-cifar10-250", SEMIFL, "Table 1", "CIFAR-10, N_S = 250, IID, SemiFL",
             88.2, "configs/cifar10/semifl_250.yaml", "cifar10"),
    PaperRow("semifl-svhn-1000", SEMIFL, "Table 1", "SVHN, N_S = 1000, IID, SemiFL",
             96.9, "configs/svhn/semifl.yaml", "svhn"),
    PaperRow("semifl-cifar100-10000", SEMIFL, "Table 1", "CIFAR-100, N_S = 10000, IID, SemiFL",
             72.1, "configs/cifar100/semifl.yaml", "cifar100"),
)  # fmt: skip
"""Every row the harness knows, in the page's order."""

DATA_LAYOUT: dict[str, tuple[str, str]] = {
    "cifar10": ("cifar-10-batches-py", "CIFAR-10's python batches (data_batch_1..5, test_batch, batches.meta)"),
    "cifar100": ("cifar-100-python", "CIFAR-100's python files (train, test, meta)"),
    "svhn": ("train_32x32.mat", "SVHN's train_32x32.mat and test_32x32.mat"),
    "fashion_mnist": ("FashionMNIST/raw", "Fashion-MNIST's IDX files (torchvision's layout)"),
    "emnist_balanced": ("EMNIST/raw", "EMNIST's balanced IDX files (torchvision's layout)"),
}
"""What in ``--data-dir`` each dataset needs (a folder, or SVHN's file; the readers in ``data/datasets.py``
check the rest) and what goes there."""

SMOKE_SETTINGS: tuple[str, ...] = (
    "train_args.comm_round=2",
    "train_args.local_steps=1",
    "train_args.client_num_in_total=4",
    "train_args.client_num_per_round=2",
    "data_args.num_server_labels=20",
    "validation_args.frequency_of_the_test=1",
)
"""``--budget smoke``: a few rounds and steps (plus a small split, so tiny files suffice)."""

SMOKE_DATA: dict[str, str] = {"num_server_val": "10"}
"""``data_args`` keys ``--budget smoke`` cuts where the row's config sets them (FedSEAL's validation set)."""

SMOKE_SSFL: dict[str, str] = {"local_epochs": "1", "server_epochs": "1", "server_steps": "1"}
"""``ssfl_args`` keys ``--budget smoke`` cuts where the row's algorithm has them."""


CHECKOUT = Path(__file__).resolve().parent.parent
"""The checkout this module is in (its ``configs/`` is used when the working folder has none)."""


def config_path(row: PaperRow) -> Path:
    """``row.config`` in the working folder, else in the checkout; a ConfigError naming it when neither has it."""
    for base in (Path.cwd(), CHECKOUT):
        if (base / row.config).is_file():
            return base / row.config
    raise ConfigError(
        f"{row.key}: config {row.config} not found here or in {CHECKOUT}; run from the checkout that holds configs/"
    )


def row_command(row: PaperRow, data_dir: str = "DATA", device: str = "cuda") -> str:
    """The exact command that runs ``row`` (one row of ``fedml-ssfl reproduce``)."""
    return f"fedml-ssfl reproduce --data-dir {data_dir} --device {device} --rows {row.key}"


def run_command(row: PaperRow, data_dir: str = "DATA", device: str = "cuda") -> str:
    """The equivalent ``fedml-ssfl run`` command of ``row``."""
    return (
        f"fedml-ssfl run {row.config} --set data_args.data_cache_dir={data_dir} "
        f"--set device_args.device={device} --no-compare"
    )


def select_rows(keys: list[str] | None) -> list[PaperRow]:
    """The rows named by ``keys`` (all when empty); an unknown key is a ConfigError naming it."""
    if not keys:
        return list(ROWS)
    known = {r.key: r for r in ROWS}
    unknown = [k for k in keys if k not in known]
    if unknown:
        raise ConfigError(f"--rows {' '.join(unknown)}: no such row; `fedml-ssfl reproduce --list` names them")
    return [known[k] for k in keys]


def format_list() -> str:
    """``--list``: each row's paper number, config and command."""
    lines = []
    for r in ROWS:
        lines += [
            f"{r.key}: {r.number:.2f}%  {r.paper}, {r.table}, {r.row}",
            f"  config:  {r.config}",
            f"  command: {row_command(r)}",
            f"           ({run_command(r)})",
        ]
    return "\n".join(lines)


def check_data(row: PaperRow, data_dir: Path) -> None:
    """A ConfigError (one line: the folder and the fix) unless ``row``'s dataset folder is in ``data_dir``."""
    sub, what = DATA_LAYOUT[row.dataset]
    need = data_dir / sub
    if not need.exists():
        kind = "file" if need.suffix == ".mat" else "folder"
        where = need.parent if kind == "file" else need
        raise ConfigError(
            f"{row.key}: dataset {kind} {need} not found; put {what} in {where} (docs/inputs.md), "
            "or pass --data-dir the folder that holds it"
        )


def gap(ours_percent: float | None, paper_percent: float) -> float | None:
    """Ours minus the paper's, in percentage points (None when the row has no result)."""
    if ours_percent is None:
        return None
    return round(ours_percent - paper_percent, 2)


def result_path(out: Path, row: PaperRow) -> Path:
    return out / "results" / f"{row.key}.json"


def machine() -> str:
    """This machine in a few words: host, CPU architecture and count, and the GPU when torch sees one."""
    import torch

    text = f"{socket.gethostname()} ({platform.machine()}, {os.cpu_count()} CPUs)"
    if torch.cuda.is_available():
        text += f", {torch.cuda.get_device_name(0)}"
    return text


def row_overrides(row: PaperRow, data_dir: Path, device: str, out: Path, budget: str) -> list[str]:
    """The ``--set`` items a row runs with: the data folder, the device, the run folder; smoke cuts."""
    sets = [
        f"data_args.data_cache_dir={data_dir}",
        "data_args.download=false",
        f"device_args.device={device}",
        f"common_args.output_dir={out / 'runs'}",
        f"common_args.run_name={row.key}",
    ]
    if budget == "smoke":
        sets += list(SMOKE_SETTINGS)
        from .config import load_raw

        raw = load_raw(config_path(row))
        ssfl, data = raw.get("ssfl_args") or {}, raw.get("data_args") or {}
        sets += [f"data_args.{k}={v}" for k, v in SMOKE_DATA.items() if data.get(k)]
        sets += [f"ssfl_args.{k}={v}" for k, v in SMOKE_SSFL.items() if ssfl.get(k) is not None]
    return sets


def result_record(
    row: PaperRow, result: Any, budget: str, device: str, seconds: float, resumed: bool
) -> dict[str, Any]:
    """A row's result file: ours (the final accuracy, as the papers report), the gap, where and how long."""
    return {
        "key": row.key,
        "paper": row.number,
        "ours": round(100 * result.final_acc, 2),
        "best": round(100 * result.best_acc, 2),
        "gap": gap(100 * result.final_acc, row.number),
        "rounds": result.rounds_completed,
        "paper_rounds": load_config(config_path(row)).train_args.comm_round,
        "budget": budget,
        "device": device,
        "machine": machine(),
        "seconds": round(seconds, 1),
        "resumed": resumed,
        "finished_utc": time.strftime("%Y-%m-%d %H:%M", time.gmtime()),
        "run_dir": str(result.run_dir),
    }


def run_row(row: PaperRow, data_dir: Path, device: str, out: Path, budget: str) -> dict[str, Any] | None:
    """Run one row (skipped when its result file exists; resumed when its run folder has a checkpoint).

    Returns the result record written, or None when the row was skipped.
    """
    from .runtime.local import run_local

    done = result_path(out, row)
    if done.exists():
        return None
    check_data(row, data_dir)
    cfg = load_config(config_path(row), row_overrides(row, data_dir, device, out, budget), check_names=True)
    run_dir = out / "runs" / row.key
    resume = (run_dir / "checkpoints" / "last.pt").exists()
    started = time.time()
    result = run_local(cfg, run_dir=run_dir, resume=resume)
    record = result_record(row, result, budget, device, time.time() - started, resume)
    done.parent.mkdir(parents=True, exist_ok=True)
    atomic_write(done, lambda fh: fh.write((json.dumps(record, indent=1) + "\n").encode("utf-8")))
    return record


def load_results(out: Path) -> dict[str, dict[str, Any]]:
    """The result records under ``out/results``, by row key."""
    found = {}
    for path in sorted((out / "results").glob("*.json")) if (out / "results").is_dir() else []:
        record = json.loads(path.read_text(encoding="utf-8"))
        found[record["key"]] = record
    return found


def format_page(results: dict[str, dict[str, Any]]) -> str:
    """docs/reproduction.md: per row paper vs ours, run or not, where, how long, the gap, paper scale or not."""
    lines = [
        "# Reproduction: paper vs ours",
        "",
        "Written by `fedml-ssfl reproduce` (`fedml_ssfl/reproduction.py`; docs/running.md says how to run it).",
        "One row per seed-paper table row a shipped config targets. *ours* is the final global-model",
        "test accuracy of the row's config run through `fedml-ssfl run`'s entry point; *gap* is ours minus",
        "the paper's, in points. A `smoke` budget cuts a row to 2 rounds on a tiny split: it checks that the",
        "row runs, it is not a result.",
        "",
        "| row | paper | table, row | config | paper % | ours % | gap | run | budget (rounds) | device, machine "
        "| time |",
        "|---|---|---|---|---:|---:|---:|---|---|---|---:|",
    ]
    never = []
    for r in ROWS:
        rec = results.get(r.key)
        measure = "" if r.measure == GLOBAL else f" (paper: {r.measure})"
        if rec is None:
            lines.append(
                f"| {r.key} | {r.paper} | {r.table}, {r.row}{measure} | `{r.config}` | {r.number:.2f} | - | - | "
                "not run | - | - | - |"
            )
        else:
            g = rec["gap"]
            lines.append(
                f"| {r.key} | {r.paper} | {r.table}, {r.row}{measure} | `{r.config}` | {r.number:.2f} | "
                f"{rec['ours']:.2f} | "
                f"{g:+.2f} | {rec['finished_utc']} UTC | {rec['budget']} ({rec['rounds']}/{rec['paper_rounds']}) | "
                f"{rec['device']}, {rec['machine']} | {rec['seconds']:.0f} s |"
            )
        if rec is None or rec["budget"] != "paper":
            never.append(r.key)
    lines += [
        "",
        "## Never run at paper scale",
        "",
        f"{len(never)} of {len(ROWS)} rows have never run at paper scale (the paper's rounds, split and data):",
        "",
        *[f"- `{k}`" for k in never],
        "",
        "## Commands",
        "",
        "Every row: `fedml-ssfl reproduce --data-dir DATA --device cuda` (DATA holds the datasets in their",
        "published formats, docs/inputs.md). One row: add `--rows KEY`; the same run by hand:",
        "`fedml-ssfl run CONFIG --set data_args.data_cache_dir=DATA --set device_args.device=cuda --no-compare`.",
        "A row with a result under `runs/reproduce/results/` is skipped; a stopped one resumes in its run folder.",
        "",
    ]
    return "\n".join(lines)


def write_page(out_page: Path, results: dict[str, dict[str, Any]]) -> Path:
    out_page.parent.mkdir(parents=True, exist_ok=True)
    text = format_page(results).encode("utf-8")
    return atomic_write(out_page, lambda fh: fh.write(text))


def reproduce(
    rows: list[PaperRow], data_dir: Path, device: str, out: Path, budget: str, page: Path
) -> tuple[list[str], list[str]]:
    """Run ``rows`` (skipping done ones), then write the page from every result under ``out``.

    Returns the keys run and the keys skipped.
    """
    for row in rows:  # every folder is checked before the first row starts: a typo costs nothing
        if not result_path(out, row).exists():
            check_data(row, data_dir)
    ran, skipped = [], []
    for row in rows:
        (ran if run_row(row, data_dir, device, out, budget) is not None else skipped).append(row.key)
    write_page(page, load_results(out))
    return ran, skipped
