"""What a GRPC deployment round costs in round trips: rounds timed at several one-way delays on a lab network.

A deployment-mode job (the server and ``--silos`` silos, all training every round, cnn28 on the
shipped digits, mutual TLS and a job key) runs on the network lab of the tests (``tests/netlab.py``:
each process in a network namespace of its own, a user-space hub between them) with the same
one-way delay on every silo's link, for each delay given. A round's ``seconds`` (``metrics.jsonl``: from the
server step through the tasks, the silos' updates and the replies to the aggregation) grows by one
round trip (2 x the delay) for each exchange a round waits for; so

    round trips per round = (median seconds at delay d - median seconds at delay 0) / (2 d)

over the rounds after the first. ``--code DIR`` runs another checkout's fedml_ssfl (e.g. an older
commit's, extracted with ``git archive``) for a comparison. Needs root (network namespaces).

Writes ``benchmarks/results/grpc_round_trips_<silos>silos[_<label>].json`` and ``.md``. Usage::

    python benchmarks/grpc_round_trips.py [--delays 0 0.3 1.0] [--rounds 5] [--silos 2] [--code DIR --label before]
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import statistics
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from fedml_ssfl.config import load_config  # noqa: E402
from fedml_ssfl.experiment import export_deployment  # noqa: E402
from tests.conftest import SMALL  # noqa: E402
from tests.lab_job import lab_job_config  # noqa: E402
from tests.netlab import Lab  # noqa: E402

SUBNET = "10.203.0"
HOSTS: list[str] = []


def job_config(tmp: Path, rounds: int, silos: int) -> Path:
    HOSTS[:] = ["server", *(f"silo{k}" for k in range(silos))]
    sim = load_config(
        None,
        [
            *SMALL,
            f"train_args.client_num_in_total={silos}",
            f"train_args.client_num_per_round={silos}",
            f"train_args.comm_round={rounds}",
            "ssfl_args.algorithm=fedavg_ssl",
            "device_args.num_threads=1",
            f"common_args.output_dir={tmp / 'runs'}",
        ],
    )
    exported = export_deployment(sim, tmp / "data", backend="GRPC")
    return lab_job_config(tmp, exported, len(HOSTS), SUBNET, 8890)


def one_run(tmp: Path, config: Path, delay: float, code: Path, timeout: float) -> dict:
    name = f"delay_{delay:g}"
    env = {k: v for k, v in os.environ.items() if not k.startswith("FEDML_SSFL_")}
    env.update(PYTHONWARNINGS="ignore", OMP_NUM_THREADS="1", PYTHONPATH=str(code))
    cli = [str(Path(sys.executable).parent / "fedml-ssfl")]  # not -m: the working folder would shadow PYTHONPATH
    with Lab(HOSTS, tmp / f"lab_{name}", subnet=SUBNET) as lab:
        for silo in HOSTS[1:]:
            lab.link(silo).set(delay=delay)
        t0 = time.monotonic()
        procs = []
        for rank, host in enumerate(HOSTS):
            role = "server" if rank == 0 else "client"
            argv = [*cli, "run", "--cf", str(config), "--rank", str(rank), "--role", role]
            argv += ["--set", f"common_args.run_name={name}"]
            procs.append(lab.spawn(host, argv, env=env, name=f"rank{rank}"))
        for p in procs:
            p.wait(timeout=max(1.0, timeout - (time.monotonic() - t0)))
        wall = time.monotonic() - t0
        codes = [p.returncode for p in procs]
        if any(c != 0 for c in codes):
            return {"delay_s": delay, "failed": codes, "server_log": procs[0].tail(2000), "wall_s": round(wall, 1)}
    rows = [json.loads(x) for x in (tmp / "runs" / name / "metrics.jsonl").read_text().splitlines()]
    seconds = [r["seconds"] for r in rows]
    return {"delay_s": delay, "wall_s": round(wall, 1), "round_s": [round(s, 3) for s in seconds]}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--delays", type=float, nargs="+", default=[0.0, 0.3, 1.0])
    ap.add_argument("--rounds", type=int, default=5)
    ap.add_argument("--silos", type=int, default=2)
    ap.add_argument("--code", type=Path, default=ROOT, help="the checkout whose fedml_ssfl the processes run")
    ap.add_argument("--label", default="")
    ap.add_argument("--timeout", type=float, default=600)
    args = ap.parse_args()
    results = []
    with tempfile.TemporaryDirectory(prefix="a1rt-") as tmp:
        tmp = Path(tmp)
        config = job_config(tmp, args.rounds, args.silos)
        for delay in sorted(set(args.delays) | {0.0}):
            results.append(one_run(tmp, config, delay, args.code.resolve(), args.timeout))
            print(json.dumps(results[-1]), flush=True)
    base = next(r for r in results if r["delay_s"] == 0.0 and "round_s" in r)
    base_median = statistics.median(base["round_s"][1:])
    for r in results:
        if "round_s" in r:
            r["median_round_s"] = round(statistics.median(r["round_s"][1:]), 3)
            if r["delay_s"] > 0:
                r["round_trips_per_round"] = round((r["median_round_s"] - base_median) / (2 * r["delay_s"]), 2)
    load = os.getloadavg()
    out = {
        "what": f"GRPC deployment rounds (server + {args.silos} silos, all training) at one-way delays on "
        "the silos' links",
        "code": str(args.code.resolve()),
        "rounds": args.rounds,
        "machine": f"{platform.machine()}, {os.cpu_count()} cores, {platform.python_version()}",
        "load_average_at_end": [round(x, 2) for x in load],
        "runs": results,
    }
    suffix = f"_{args.silos}silos" + (f"_{args.label}" if args.label else "")
    dest = ROOT / "benchmarks" / "results" / f"grpc_round_trips{suffix}"
    dest.with_suffix(".json").write_text(json.dumps(out, indent=2) + "\n")
    lines = [
        f"# GRPC round trips per round{' (' + args.label + ')' if args.label else ''}",
        "",
        f"{out['what']}; {args.rounds} rounds, median over rounds 2..{args.rounds}; {out['machine']}; "
        f"load average at the end {out['load_average_at_end']}.",
        "",
        "| one-way delay | median s/round | round trips per round | wall s (start to exit) |",
        "|---|---|---|---|",
    ]
    for r in results:
        if "round_s" in r:
            rt = r.get("round_trips_per_round", "-")
            lines.append(f"| {r['delay_s']:g} s | {r['median_round_s']} | {rt} | {r['wall_s']} |")
        else:
            lines.append(f"| {r['delay_s']:g} s | failed: exit codes {r['failed']} | - | {r['wall_s']} |")
    dest.with_suffix(".md").write_text("\n".join(lines) + "\n")
    print("\n".join(lines))


if __name__ == "__main__":
    main()
