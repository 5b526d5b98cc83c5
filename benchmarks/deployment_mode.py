"""FedML's deployment mode: start-up, per-round cost against the local simulator, memory per process.

A MNIST-5k split (cnn28, K = 3 silos, all three train every round) is exported as deployment files
(``fedml-ssfl partition --export``) and run three ways:

* ``local``: the in-process simulator on the split (the reference for the per-round cost);
* ``deployment``: ``mpirun -np 4 fedml-ssfl run`` on the exported files;
* ``deployment, other silos x N``: the same, with silos 1 and 2's files inflated N times (their
  images repeated); silo 0's file and the server's files are unchanged.

Per process (MPI rank) a ``sitecustomize`` records the peak resident set size at exit
(``ru_maxrss``). A silo reads only its own file, so rank 1 (silo 0) should hold the same memory in
both deployment runs while ranks 2 and 3 grow with their files. Start-up is the ``mpirun`` wall
time minus the rounds' own seconds (``metrics.jsonl``: sampling, server step, messages, client
updates, aggregation), so it includes imports, data loading, FedML's handshake and the shutdown.
Seconds per round: the median over the rounds after the first.

Writes ``benchmarks/results/deployment_mode.json`` and ``.md``. Usage::

    python benchmarks/deployment_mode.py [--rounds 6] [--inflate 100]
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
import textwrap
import time
from pathlib import Path

import numpy as np

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from fedml_ssfl.config import load_config  # noqa: E402
from fedml_ssfl.data.local_files import read_npz, write_npz  # noqa: E402
from fedml_ssfl.experiment import export_deployment  # noqa: E402
from fedml_ssfl.runtime.local import run_local  # noqa: E402

BIN = Path(sys.executable).parent
OUT = ROOT / "benchmarks" / "results"

PEAK_RSS = textwrap.dedent(
    """
    import atexit, os, resource

    def _peak():
        rank = os.environ.get("OMPI_COMM_WORLD_RANK", "x")
        kb = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss  # KiB on Linux
        with open(os.path.join(os.environ["SSFL_BENCH_RSS"], "rank%s" % rank), "w") as fh:
            fh.write(str(kb))

    atexit.register(_peak)
    """
)


def settings(out: Path, rounds: int) -> list[str]:
    return [
        "data_args.dataset=mnist5k",
        "model_args.model=cnn28",
        "ssfl_args.algorithm=fedavg_ssl",
        "ssfl_args.bootstrap_steps=30",
        "train_args.client_num_in_total=3",
        "train_args.client_num_per_round=3",
        f"train_args.comm_round={rounds}",
        "train_args.local_steps=16",
        "train_args.batch_size=64",
        "device_args.num_threads=1",
        "tracking_args.progress_bar=false",
        "tracking_args.enable_tensorboard=false",
        f"tracking_args.checkpoint_every={rounds}",
        f"common_args.output_dir={out}",
    ]


def round_seconds(run_dir: Path) -> list[float]:
    return [json.loads(x)["seconds"] for x in (run_dir / "metrics.jsonl").read_text().splitlines()]


def deployment_run(config: Path, name: str, tmp: Path) -> dict:
    site, rss = tmp / f"site_{name}", tmp / f"rss_{name}"
    site.mkdir()
    rss.mkdir()
    (site / "sitecustomize.py").write_text(PEAK_RSS)
    env = dict(os.environ, PYTHONWARNINGS="ignore", SSFL_BENCH_RSS=str(rss), OMP_NUM_THREADS="1")
    env["PYTHONPATH"] = os.pathsep.join([str(site), str(ROOT), env.get("PYTHONPATH", "")])
    env.update(OMPI_ALLOW_RUN_AS_ROOT="1", OMPI_ALLOW_RUN_AS_ROOT_CONFIRM="1")
    cmd = [str(BIN / "mpirun"), "--oversubscribe", "-np", "4", str(BIN / "fedml-ssfl"), "run", "--cf", str(config)]
    cmd += ["--set", f"common_args.run_name={name}"]
    t0 = time.perf_counter()
    proc = subprocess.run(cmd, capture_output=True, text=True, env=env, timeout=1200)
    wall = time.perf_counter() - t0
    if proc.returncode != 0:
        raise SystemExit(f"{name} failed:\n{proc.stdout[-2000:]}\n{proc.stderr[-3000:]}")
    run_dir = load_config(config).run_dir().parent / name
    secs = round_seconds(run_dir)
    peak = {int(p.name[4:]): int(p.read_text()) / 1024 for p in rss.glob("rank*")}
    return {
        "name": name,
        "wall_seconds": wall,
        "round_seconds": secs,
        "startup_and_shutdown_seconds": wall - sum(secs),
        "peak_rss_mib": {str(k): round(v, 1) for k, v in sorted(peak.items())},
    }


def inflate(data: Path, silos: list[int], factor: int) -> dict[str, int]:
    sizes = {}
    for k in silos:
        d = read_npz(data / f"silo_{k}.npz")
        images = np.repeat(d.images.numpy(), factor, axis=0)
        write_npz(data / f"silo_{k}.npz", images, np.repeat(d.labels.numpy(), factor))
        sizes[f"silo_{k}"] = (data / f"silo_{k}.npz").stat().st_size
    return sizes


def markdown(res: dict) -> str:
    local = res["local"]
    lines = [
        "# Deployment mode: start-up, per-round cost, memory per process",
        "",
        f"Machine: {res['machine']}; {res['date']}. MNIST-5k split, cnn28, K = 3 silos all training every "
        f"round, T = 16 steps of batch 64, {res['rounds']} rounds, one torch thread per process. "
        "Written by `python benchmarks/deployment_mode.py`.",
        "",
        "| run | s/round (median, rounds 2..) | vs local | start-up + shutdown s | peak RSS MiB: server | silo 0 | "
        "silo 1 | silo 2 |",
        "|---|---|---|---|---|---|---|---|",
        f"| local simulator (one process) | {local['median_round_seconds']:.3f} | 1.00 | "
        f"{local['startup_seconds']:.1f} | {local['peak_rss_mib']:.0f} (all) | | | |",
    ]
    for run in res["deployment"]:
        med = statistics.median(run["round_seconds"][1:])
        r = run["peak_rss_mib"]
        lines.append(
            f"| {run['label']} | {med:.3f} | {med / local['median_round_seconds']:.2f} | "
            f"{run['startup_and_shutdown_seconds']:.1f} | {r.get('0', 0):.0f} | {r.get('1', 0):.0f} | "
            f"{r.get('2', 0):.0f} | {r.get('3', 0):.0f} |"
        )
    lines += [
        "",
        "File sizes (bytes): " + ", ".join(f"{k} {v}" for k, v in res["file_sizes"].items()) + ".",
        "",
    ]
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--rounds", type=int, default=6)
    parser.add_argument("--inflate", type=int, default=100, help="how many times silos 1 and 2 are repeated")
    args = parser.parse_args(argv)
    import resource

    with tempfile.TemporaryDirectory() as t:
        tmp = Path(t)
        cfg = load_config(None, [*settings(tmp / "runs", args.rounds), "common_args.run_name=bench"])
        t0 = time.perf_counter()
        local = run_local(cfg, run_dir=tmp / "local")
        local_wall = time.perf_counter() - t0
        local_secs = round_seconds(local.run_dir)
        res: dict = {
            "machine": f"{platform.processor() or platform.machine()}, {os.cpu_count()} cores",
            "date": time.strftime("%Y-%m-%d"),
            "rounds": args.rounds,
            "local": {
                "round_seconds": local_secs,
                "median_round_seconds": statistics.median(local_secs[1:]),
                "startup_seconds": local_wall - sum(local_secs),
                # this process also built the split and imported the benchmark: an upper bound
                "peak_rss_mib": resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024,
            },
            "deployment": [],
        }
        data = tmp / "data"
        config = export_deployment(cfg, data)
        res["file_sizes"] = {p.name: p.stat().st_size for p in sorted(data.glob("*.npz"))}
        run = deployment_run(config, "deployed", tmp)
        res["deployment"].append({**run, "label": "deployment (mpirun, 4 processes)"})
        big = inflate(data, [1, 2], args.inflate)
        res["file_sizes"].update({f"{k}.npz x{args.inflate}": v for k, v in big.items()})
        run = deployment_run(config, "deployed_big", tmp)
        res["deployment"].append({**run, "label": f"deployment, silos 1 and 2 x{args.inflate}"})
    OUT.mkdir(parents=True, exist_ok=True)
    (OUT / "deployment_mode.json").write_text(json.dumps(res, indent=2) + "\n")
    (OUT / "deployment_mode.md").write_text(markdown(res))
    print(markdown(res))
    return 0


if __name__ == "__main__":
    sys.exit(main())
