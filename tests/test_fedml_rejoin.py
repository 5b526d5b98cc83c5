"""GRPC jobs that lose a process and go on: a server restarted alone with ``--resume`` is rejoined by the
live workers, a restarted silo rejoins the live server; each ends with the simulator's model. Real
processes on 127.0.0.1 (the network lab, tests/test_network_faults.py, runs the same across links)."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from fedml_ssfl.checkpoint import load_checkpoint
from fedml_ssfl.config import load_config, validate
from fedml_ssfl.experiment import export_deployment
from fedml_ssfl.runtime.local import run_local
from tests.conftest import SMALL
from tests.test_fedml_grpc import CLI, env, finish, free_ports

pytest.importorskip("fedml")
pytest.importorskip("grpc")

TIMEOUT = 300
FAST = {"FEDML_SSFL_HEARTBEAT_INTERVAL": "1", "FEDML_SSFL_OUTAGE_BUDGET": "90", "FEDML_SSFL_FINISH_GRACE": "10"}


def deployment(tmp: Path, rounds: int = 4) -> tuple[Path, Path]:
    """A 3-silo deployment over GRPC on 127.0.0.1 (plaintext with a job key), checkpoints every round; its
    config, and the simulator's run of the same split."""
    settings = [
        *SMALL,
        "train_args.client_num_in_total=3",
        "train_args.client_num_per_round=2",
        f"train_args.comm_round={rounds}",
        "ssfl_args.algorithm=fedavg_ssl",
        "ssfl_args.threshold=0.5",
        "ssfl_args.bootstrap_steps=30",  # the silos' momentum state matters from round 0
        "device_args.num_threads=1",
        f"common_args.output_dir={tmp / 'runs'}",
    ]
    sim = load_config(None, [*settings, "common_args.run_name=sim"])
    path = export_deployment(sim, tmp / "data")
    raw = load_config(path).to_dict()
    ip = tmp / "ipconfig.csv"
    ip.write_text(
        "eid,rank,grpc_server_ip,grpc_server_port\n"
        + "".join(f"{r},{r},127.0.0.1,{p}\n" for r, p in enumerate(free_ports(4)))
    )
    (tmp / "job.key").write_text("k" * 64)
    raw["comm_args"].update(
        backend="GRPC", grpc_ipconfig_path=str(ip), insecure=True, job_key_file=str(tmp / "job.key")
    )
    raw["common_args"]["run_name"] = "dep"
    config = tmp / "dep.yaml"
    config.write_text(validate(raw).to_yaml())
    local = run_local(sim, run_dir=tmp / "local")
    return config, local.run_dir


def launch(config: Path, rank: int, *extra: str, **environ: str) -> subprocess.Popen:
    role = "server" if rank == 0 else "client"
    cmd = [str(CLI), "run", "--cf", str(config), "--rank", str(rank), "--role", role, *extra]
    return subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, env=env(**FAST, **environ))


def rounds_done(run_dir: Path) -> int:
    path = run_dir / "metrics.jsonl"
    return len(path.read_text().splitlines()) if path.exists() else 0


def wait_rounds(run_dir: Path, n: int, procs: list[subprocess.Popen], timeout: float = TIMEOUT) -> None:
    deadline = time.monotonic() + timeout
    while rounds_done(run_dir) < n:
        for p in procs:
            if p.poll() is not None:
                out, err = p.communicate()
                raise AssertionError(f"a process exited ({p.returncode}) before round {n}: {err[-3000:]}")
        assert time.monotonic() < deadline, f"round {n} not done in {timeout} s"
        time.sleep(0.2)


def same_model(run_dir: Path, local_dir: Path) -> None:
    a = load_checkpoint(local_dir / "checkpoints" / "last.pt")["algorithm"]["global_state"]
    b = load_checkpoint(run_dir / "checkpoints" / "last.pt")["algorithm"]["global_state"]
    assert max(float((a[k] - b[k]).abs().max()) for k in a) < 1e-5
    sim = [json.loads(x)["test_acc"] for x in (local_dir / "metrics.jsonl").read_text().splitlines()]
    dep = [json.loads(x)["test_acc"] for x in (run_dir / "metrics.jsonl").read_text().splitlines()]
    assert dep == sim


def kill(proc: subprocess.Popen) -> str:
    os.kill(proc.pid, signal.SIGKILL)
    _, err = proc.communicate()
    return err


def test_a_server_restarted_alone_with_resume_is_rejoined_by_the_live_silos(tmp_path):
    config, local_dir = deployment(tmp_path)
    run_dir = load_config(config).run_dir()
    procs = [launch(config, r) for r in range(4)]
    wait_rounds(run_dir, 2, procs)
    kill(procs[0])
    t0 = time.monotonic()
    procs[0] = launch(config, 0, "--resume", str(run_dir))
    results = finish(procs, TIMEOUT)
    for rank, (code, stdout, stderr) in enumerate(results):
        assert code == 0, f"rank {rank}: {stdout[-2000:]}\n{stderr[-4000:]}"
    assert time.monotonic() - t0 < TIMEOUT
    assert json.loads((run_dir / "summary.json").read_text())["status"] == "completed"
    same_model(run_dir, local_dir)
    for rank in (1, 2, 3):
        assert "a new server process admitted it" in results[rank][2], results[rank][2][-3000:]


def test_a_restarted_silo_rejoins_the_live_server(tmp_path):
    config, local_dir = deployment(tmp_path)
    run_dir = load_config(config).run_dir()
    procs = [launch(config, r) for r in range(4)]
    wait_rounds(run_dir, 2, procs)
    kill(procs[2])
    time.sleep(2)
    procs[2] = launch(config, 2)
    results = finish(procs, TIMEOUT)
    for rank, (code, stdout, stderr) in enumerate(results):
        assert code == 0, f"rank {rank}: {stdout[-2000:]}\n{stderr[-4000:]}"
    assert json.loads((run_dir / "summary.json").read_text())["status"] == "completed"
    same_model(run_dir, local_dir)
    assert "rank 2 (silo 1) rejoined as a new process" in results[0][2], results[0][2][-3000:]


if __name__ == "__main__":  # pragma: no cover
    sys.exit(pytest.main([__file__, "-q"]))
