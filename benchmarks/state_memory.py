"""Peak memory of K clients' persistent state, with and without ``device_args.state_memory_mb``.

FedSiam (``target_sync: false``: a target net per client), FedSEAL (each client's running ensemble)
and FedMatch (each client's held sigma and psi) keep a state per client that grows with K. For
each of them this script takes the state one real ``client_update`` leaves (the shipped MNIST-5k
config: cnn28, 24k parameters, one local step), then, for K in 10 .. 10,000, measures in a fresh
process (``resource.getrusage`` ``ru_maxrss``: the peak resident set) what the runtime does with
K such states: every client updated once (its own copy of the template's tensors), 100 clients
updated again (spilled ones read back), and one checkpoint written, through the runtime's own
``open_client_states`` / ``client_state_payload`` / ``save_checkpoint``. Without a budget every
state stays in memory; with one the least recently used ones spill to disk.

``--server-records`` adds, for FedMatch, the server's own records per client (``views`` and
``client_psi``, as one real ``aggregate`` leaves them for client 0): K of each kept as the runtime
keeps them (a store each, the budget split evenly between the client states and the two maps,
checkpointed through ``server_records_payload``). Off by default, so the documented sweep (client
states alone) reproduces.

Writes ``benchmarks/results/state_memory.json`` and ``state_memory.png`` (peak RSS against K, log x).
Each row also has ``seconds_checkpoint``: that one checkpoint, in which every spilled state's file is
verified (hashed against its name) and hard-linked into the checkpoint's folder, then fsynced, and
``last.pt`` written: the cost of the check that keeps a damaged spill file out of a checkpoint (run
the script on a checkout without the check for the figure without it); ``seconds_verify_alone``
is that check's work measured by itself just before (every spill file hashed once, one thread).

Usage::

    python benchmarks/state_memory.py                       # budgets: none, 32 MiB
    python benchmarks/state_memory.py --budgets 0 16 256 --ks 10 100 1000
    python benchmarks/state_memory.py --algorithms fedmatch --ks 100 --server-records
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import resource
import shutil
import subprocess
import sys
import tempfile
import time
from datetime import UTC, datetime
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

ALGORITHMS = {
    "fedsiam": ("configs/mnist5k/fedsiam.yaml", ["ssfl_args.target_sync=false"]),
    "fedseal": ("configs/mnist5k/fedseal.yaml", ["ssfl_args.bootstrap_steps=1", "ssfl_args.server_steps=1"]),
    "fedmatch": ("configs/mnist5k/fedmatch.yaml", []),
}
SECOND_PASS = 100
"""Clients updated again after every client's first update (a round's worth; spilled ones come back)."""


def _mib(n: float) -> float:
    return round(n / 2**20, 2)


def _maxrss_bytes() -> int:
    """This process's peak resident set: ``VmHWM`` where /proc has it, else ``ru_maxrss``.

    ``ru_maxrss`` survives ``execve`` on Linux (a child starts at its parent's peak at fork time), so it
    is recorded too but read against a parent that stays small (the sweep's parent imports no torch).
    """
    try:
        for line in Path("/proc/self/status").read_text().splitlines():
            if line.startswith("VmHWM:"):
                return int(line.split()[1]) * 1024
    except OSError:
        pass
    return _ru_maxrss_bytes()


def _ru_maxrss_bytes() -> int:
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024  # KiB on Linux


# ---- the template: the state one real client_update leaves ----------------------------------------
def make_template(algorithm: str) -> dict:
    """What one real round of ``algorithm`` (shipped config) leaves for client 0.

    ``{"client": its persistent state, "records": {name: the server's record of it}}`` (records: the
    algorithm's ``client_records``, FedMatch's ``views`` and ``client_psi``; empty for the others).
    """
    import torch

    from fedml_ssfl.algorithms.base import ClientContext
    from fedml_ssfl.config import load_config
    from fedml_ssfl.experiment import build_experiment

    path, extra = ALGORITHMS[algorithm]
    cfg = load_config(
        ROOT / path,
        [*extra, "train_args.local_steps=1", "tracking_args.enable_tensorboard=false", "common_args.compare_with=[]"],
    )
    exp = build_experiment(cfg)
    algo = exp.algorithm
    algo.setup()
    algo.server_step(0)
    msg = algo.message_for(0, 0)
    state: dict = {}
    ctx = ClientContext(round_idx=0, device=torch.device("cpu"), seed=cfg.common_args.random_seed)
    reply = algo.client_update(msg, exp.client_data(0, 0), state, ctx)
    algo.aggregate({0: reply}, 0)
    return {"client": state, "records": {name: getattr(algo, name)[0] for name in algo.client_records}}


def _own_copy(template, k: int):
    """Client ``k``'s state: the template's shape with tensors of its own (distinct bytes per client)."""
    import torch

    if isinstance(template, torch.Tensor):
        if template.is_sparse:  # FedMatch's client_psi where psi is sparse: values of its own
            t = template.coalesce()
            return torch.sparse_coo_tensor(t.indices(), _own_copy(t.values(), k), t.shape).coalesce()
        t = template.clone()
        if t.numel() and t.is_floating_point():
            t.view(-1)[0] += k
        return t
    if isinstance(template, dict):
        return {key: _own_copy(v, k) for key, v in template.items()}
    if isinstance(template, (list, tuple)):
        return type(template)(_own_copy(v, k) for v in template)
    return template


# ---- one measurement, in its own process -------------------------------------------------------------
def measure(template_path: str, K: int, budget_mb: float, work: str, server_records: bool = False) -> dict:
    """Peak RSS of K clients' states (and with ``server_records`` the server's records of them) under
    ``budget_mb`` (0: none), as the runtime keeps them."""
    import torch

    from fedml_ssfl.checkpoint import save_checkpoint
    from fedml_ssfl.client_state import (
        STATES_DIR,
        ClientStateStore,
        client_state_payload,
        close_client_states,
        open_client_states,
        prune_state_files,
        state_size,
        verify_state_file,
    )
    from fedml_ssfl.runtime.common import server_records_payload

    torch.set_num_threads(1)
    loaded = torch.load(template_path, weights_only=True)
    template, record_templates = loaded["client"], loaded["records"] if server_records else {}
    base = _maxrss_bytes()
    t0 = time.perf_counter()
    work_dir = Path(work)
    # split as the runtime's state_budget does: client states and each record map an even share
    budget = int(budget_mb * 2**20) // (1 + len(record_templates)) if budget_mb > 0 else None
    states = open_client_states(range(K), budget, work_dir / "spill" if budget is not None else None)
    records = {
        name: open_client_states((), budget, work_dir / f"spill-{name}" if budget is not None else None)
        for name in record_templates
    }
    for k in range(K):  # every client's first update (and the server's records of it)
        states[k].update(_own_copy(template, k))
        for name, rec in record_templates.items():
            records[name][k] = _own_copy(rec, k)
    g = torch.Generator().manual_seed(0)
    for k in torch.randperm(K, generator=g)[: min(K, SECOND_PASS)].tolist():  # a round: read back, replaced
        state = states[k]
        state.update(_own_copy(state, 1))
        for store in records.values():
            store[k] = _own_copy(store[k], 1)
    t_update = time.perf_counter() - t0
    stores = [s for s in (states, *records.values()) if isinstance(s, ClientStateStore)]
    disk_spill = sum(p.stat().st_size for s in stores for p in s.spill_dir.glob("*.pt"))
    ckpt = work_dir / "checkpoints" / "last.pt"
    spill_files = [p for s in stores for p in s.spill_dir.glob("*.pt")]
    t_verify = time.perf_counter()
    for path in spill_files:  # what the checkpoint's check adds, alone and in one thread: one hash of each file
        verify_state_file(path)
    t_verify = time.perf_counter() - t_verify
    t_ckpt = time.perf_counter()
    payload = client_state_payload(states, ckpt.parent / STATES_DIR)
    algo_state = dict(records)  # bound stores go in as themselves, as FedMatch.state_dict hands them over
    bound = {name: r for name, r in records.items() if isinstance(r, ClientStateStore)}
    payload.update(server_records_payload(algo_state, bound, ckpt.parent / STATES_DIR))
    save_checkpoint(ckpt, {"round": 0, "algorithm": algo_state, **payload})
    prune_state_files(ckpt.parent / STATES_DIR, payload)
    t_checkpoint = time.perf_counter() - t_ckpt
    t_total = time.perf_counter() - t0
    disk_ckpt = sum(p.stat().st_size for p in ckpt.parent.rglob("*") if p.is_file())
    peak = _maxrss_bytes()
    row = {
        "K": K,
        "budget_mib": budget_mb,
        "state_bytes": state_size(template),
        "server_records": sorted(record_templates),
        "record_bytes": sum(state_size(r) for r in record_templates.values()),
        "all_states_mib": _mib(K * (state_size(template) + sum(state_size(r) for r in record_templates.values()))),
        "peak_rss_mib": _mib(peak),
        "ru_maxrss_mib": _mib(_ru_maxrss_bytes()),
        "baseline_rss_mib": _mib(base),
        "peak_over_baseline_mib": _mib(peak - base),
        "seconds_updates": round(t_update, 3),
        "seconds_total": round(t_total, 3),
        "seconds_checkpoint": round(t_checkpoint, 3),  # spilled files verified and linked, last.pt written
        "seconds_verify_alone": round(t_verify, 3),  # hashing every spill file once, in one thread
        "spill_disk_mib": _mib(disk_spill),
        "checkpoint_disk_mib": _mib(disk_ckpt),
    }
    if stores:
        row.update(
            spills=sum(s.spills for s in stores),
            loads=sum(s.loads for s in stores),
            peak_resident_mib=_mib(sum(s.peak_resident_bytes for s in stores)),  # summed peaks: an upper bound
            checkpoint_files=len(payload.get("client_state_files", {}))
            + sum(len(d) for d in payload.get("server_record_files", {}).values()),
        )
    for s in (states, *records.values()):
        close_client_states(s)
    return row


# ---- the sweep --------------------------------------------------------------------------------------
def plot(rows: list[dict], out: Path) -> None:
    """Two panels against K (log x): the peak RSS, and the peak above the process's baseline (log y)."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, (ax, ax2) = plt.subplots(1, 2, figsize=(12, 4.8))
    colors = {"fedsiam": "tab:blue", "fedseal": "tab:green", "fedmatch": "tab:red"}
    styles = [("-", "o"), ("--", "s"), (":", "^"), ("-.", "v")]
    budgets = sorted({r["budget_mib"] for r in rows})
    for algo in colors:
        for i, b in enumerate(budgets):
            sel = sorted((r for r in rows if r["algorithm"] == algo and r["budget_mib"] == b), key=lambda r: r["K"])
            if not sel:
                continue
            ks = [r["K"] for r in sel]
            line, marker = styles[i % len(styles)]
            label = f"{algo}, " + ("no budget" if b == 0 else f"state_memory_mb {b:g}")
            ax.plot(ks, [r["peak_rss_mib"] for r in sel], line, marker=marker, color=colors[algo], label=label)
            above = [max(r["peak_over_baseline_mib"], 0.1) for r in sel]
            ax2.plot(ks, above, line, marker=marker, color=colors[algo], label=label)
    for b in budgets:
        if b > 0:
            ax2.axhline(b, color="black", lw=0.8, ls=(0, (1, 3)))
            ax2.text(10, b, f" budget {b:g} MiB", va="bottom", fontsize=8)
    base = min(r["baseline_rss_mib"] for r in rows)
    ax.axhline(base, color="grey", lw=0.8)
    ax.text(10, base, " baseline: python + torch + template", va="top", fontsize=8, color="grey")
    for a in (ax, ax2):
        a.set_xscale("log")
        a.set_xlabel("K (clients with a persistent state)")
        a.grid(True, which="both", alpha=0.3)
    ax2.set_yscale("log")
    ax.set_ylabel("peak RSS (MiB)")
    ax2.set_ylabel("peak RSS above baseline (MiB)")
    ax.set_title("peak RSS of the process")
    ax2.set_title("what the states cost")
    ax.legend(fontsize=8, loc="upper left")
    fig.suptitle("Per-client state: MNIST-5k cnn28 states; every client updated, 100 again, one checkpoint")
    fig.tight_layout()
    fig.savefig(out, dpi=110)
    plt.close(fig)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--algorithms", nargs="+", default=list(ALGORITHMS), choices=list(ALGORITHMS))
    parser.add_argument("--ks", nargs="+", type=int, default=[10, 100, 1000, 10000])
    parser.add_argument("--budgets", nargs="+", type=float, default=[0, 32], help="MiB; 0: no budget")
    parser.add_argument("--work-dir", default=None, help="scratch folder (default: a temporary one)")
    parser.add_argument(
        "--server-records", action="store_true", help="FedMatch: keep the server's views and client_psi too"
    )
    parser.add_argument("--results", default=str(ROOT / "benchmarks" / "results" / "state_memory"))
    parser.add_argument(
        "--child", nargs=5, metavar=("TEMPLATE", "K", "BUDGET", "WORK", "RECORDS"), help=argparse.SUPPRESS
    )
    parser.add_argument("--template", nargs=2, metavar=("ALGORITHM", "PATH"), help=argparse.SUPPRESS)
    args = parser.parse_args(argv)
    if args.child:
        template, K, budget, work, recs = args.child
        print(json.dumps(measure(template, int(K), float(budget), work, recs == "1")))
        return 0
    if args.template:
        import torch

        torch.set_num_threads(1)
        torch.save(make_template(args.template[0]), args.template[1])
        print(json.dumps({"torch": torch.__version__}))
        return 0

    # this process stays small (no torch): each measurement and each template is a fresh process
    env = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONPATH": str(ROOT)}

    def child(*cmd: str) -> dict:
        out = subprocess.run([sys.executable, __file__, *cmd], capture_output=True, text=True, env=env, check=False)
        if out.returncode != 0:
            raise RuntimeError(f"{' '.join(cmd)}: {out.stderr.strip()[-2000:]}")
        return json.loads(out.stdout.strip().splitlines()[-1])

    scratch = Path(tempfile.mkdtemp(prefix="state_memory-", dir=args.work_dir))
    rows = []
    versions: dict = {}
    try:
        for algo in args.algorithms:
            template_path = scratch / f"{algo}.pt"
            versions = child("--template", algo, str(template_path))
            for budget in args.budgets:
                for K in args.ks:
                    work = scratch / f"{algo}-{K}-{budget:g}"
                    recs = "1" if args.server_records else "0"
                    row = {
                        "algorithm": algo,
                        **child("--child", str(template_path), str(K), str(budget), str(work), recs),
                    }
                    rows.append(row)
                    shutil.rmtree(work, ignore_errors=True)
                    print(
                        f"{algo:9s} K={K:6d} budget={budget:5g} MiB: peak RSS {row['peak_rss_mib']:9.1f} MiB "
                        f"(states {row['all_states_mib']:9.1f} MiB, {row['seconds_total']:.1f} s)",
                        flush=True,
                    )
    finally:
        shutil.rmtree(scratch, ignore_errors=True)
    results = Path(args.results)
    results.parent.mkdir(parents=True, exist_ok=True)
    meta = {
        "date": datetime.now(UTC).isoformat(timespec="seconds"),
        "machine": f"{platform.machine()} {platform.processor() or ''}".strip(),
        "cpus": os.cpu_count(),
        "python": platform.python_version(),
        "torch": versions.get("torch"),
        "threads": 1,
        "peak": "VmHWM of the measuring process (/proc/self/status); ru_maxrss alongside",
        "second_pass_clients": SECOND_PASS,
        "note": "peak RSS (VmHWM) of a fresh process that keeps K clients' states as the runtime does: "
        "every client updated once, then up to 100 again, then one checkpoint; state = what one real "
        "client_update leaves on the shipped MNIST-5k config (cnn28, 24,058 parameters)",
    }
    results.with_suffix(".json").write_text(json.dumps({"meta": meta, "rows": rows}, indent=1) + "\n")
    plot(rows, results.with_suffix(".png"))
    print(f"wrote {results.with_suffix('.json')} and {results.with_suffix('.png')}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
