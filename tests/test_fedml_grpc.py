"""The FedML runtime over GRPC: one server and two clients as separate processes on 127.0.0.1
(``--rank N --role server|client`` + an ipconfig CSV), and a client process that dies.
"""

from __future__ import annotations

import json
import os
import pickle
import socket
import subprocess
import sys
import textwrap
import time
from pathlib import Path

import pytest
import torch

from fedml_ssfl.checkpoint import load_checkpoint
from fedml_ssfl.config import ExperimentConfig, load_config, validate
from fedml_ssfl.runtime.local import run_local
from tests.conftest import SMALL

pytest.importorskip("fedml")
pytest.importorskip("grpc")

BIN = Path(sys.executable).parent
CLI = BIN / "fedml-ssfl"
TIMEOUT = 240


def free_ports(n: int) -> list[int]:
    socks = [socket.socket() for _ in range(n)]
    try:
        for s in socks:
            s.bind(("127.0.0.1", 0))
        return [s.getsockname()[1] for s in socks]
    finally:
        for s in socks:
            s.close()


def grpc_config(tmp: Path, world: int, *overrides: str) -> ExperimentConfig:
    ip = tmp / "ipconfig.csv"
    rows = [f"{r},{r},127.0.0.1,{p}" for r, p in enumerate(free_ports(world))]
    ip.write_text("eid,rank,grpc_server_ip,grpc_server_port\n" + "\n".join(rows) + "\n")
    cfg = load_config(
        None,
        [
            *SMALL,
            f"common_args.output_dir={tmp / 'runs'}",
            "common_args.training_type=cross_silo",
            "comm_args.backend=GRPC",
            f"comm_args.grpc_ipconfig_path={ip}",
            f"train_args.client_num_per_round={world - 1}",
            "device_args.num_threads=1",
            *overrides,
        ],
    )
    (tmp / "c.yaml").write_text(cfg.to_yaml())
    return cfg


ROOT = Path(__file__).resolve().parents[1]


def env(**extra: str) -> dict[str, str]:
    out = dict(os.environ, PYTHONWARNINGS="ignore", FEDML_SSFL_ROUND_TIMEOUT="120", FEDML_SSFL_CONNECT_TIMEOUT="120")
    # the checkout's code, also where an older editable install does not map every package
    out["PYTHONPATH"] = os.pathsep.join(x for x in (str(ROOT), os.environ.get("PYTHONPATH", "")) if x)
    out.update(extra)
    return out


def start(cmd_prefix: list[str], cfg_path: Path, world: int, environ: dict[str, str]) -> list[subprocess.Popen]:
    procs = []
    for rank in range(world):
        role = "server" if rank == 0 else "client"
        procs.append(
            subprocess.Popen(
                [*cmd_prefix, "run", "--cf", str(cfg_path), "--rank", str(rank), "--role", role],
                stdout=subprocess.PIPE,
                stderr=subprocess.PIPE,
                text=True,
                env=environ,
            )
        )
    return procs


def finish(procs: list[subprocess.Popen], timeout: float) -> list[tuple[int, str, str]]:
    deadline = time.monotonic() + timeout
    out = []
    try:
        for p in procs:
            stdout, stderr = p.communicate(timeout=max(1.0, deadline - time.monotonic()))
            out.append((p.returncode, stdout, stderr))
    finally:
        for p in procs:
            if p.poll() is None:
                p.kill()
                p.communicate()
    return out


def test_grpc_server_and_two_clients_on_localhost_finish_a_run(tmp_path):
    cfg = grpc_config(
        tmp_path,
        3,
        "train_args.client_num_in_total=4",
        "train_args.comm_round=2",
        "ssfl_args.averaging=grouping",
        "common_args.run_name=grpc",
    )
    record = tmp_path / "net.log"
    results = finish(start([str(CLI)], tmp_path / "c.yaml", 3, env(FEDML_SSFL_NET_RECORD=str(record))), TIMEOUT)
    for rank, (code, stdout, stderr) in enumerate(results):
        assert code == 0, f"rank {rank}: {stdout[-2000:]}\n{stderr[-4000:]}"
    assert f"outputs: {cfg.run_dir()}" in results[0][1]
    assert not record.exists(), record.read_text()
    summary = json.loads((cfg.run_dir() / "summary.json").read_text())
    assert summary["status"] == "completed" and summary["runtime"] == "fedml-GRPC"
    # the same model as the local runtime
    raw = cfg.to_dict()
    raw["comm_args"] = {"backend": "local", "grpc_ipconfig_path": ""}
    raw["common_args"]["training_type"] = "simulation"
    local = run_local(validate(raw), run_dir=tmp_path / "local")
    a = load_checkpoint(local.run_dir / "checkpoints" / "last.pt")["algorithm"]["global_state"]
    b = load_checkpoint(cfg.run_dir() / "checkpoints" / "last.pt")["algorithm"]["global_state"]
    assert max(float((a[k] - b[k]).abs().max()) for k in a) < 1e-5
    rows = [json.loads(x) for x in (cfg.run_dir() / "metrics.jsonl").read_text().splitlines()]
    assert [r["test_acc"] for r in rows] == [
        json.loads(x)["test_acc"] for x in (local.run_dir / "metrics.jsonl").read_text().splitlines()
    ]


DYING_CLIENT = textwrap.dedent(
    """
    import os, sys
    from fedml_ssfl.algorithms.fedavg_ssl import FedAvgSSL
    from fedml_ssfl.cli import main

    original = FedAvgSSL.client_update

    def dying(self, msg, data, state, ctx):
        if ctx.round_idx == 1:
            os._exit(3)
        return original(self, msg, data, state, ctx)

    FedAvgSSL.client_update = dying
    sys.exit(main(sys.argv[1:]))
    """
)


def test_grpc_client_process_that_dies_is_detected(tmp_path):
    # one server, one client (K = 2 silos); the client dies in round 1
    cfg = grpc_config(tmp_path, 2, "train_args.client_num_in_total=2", "train_args.comm_round=4")
    launcher = tmp_path / "launch.py"
    launcher.write_text(DYING_CLIENT)
    t0 = time.monotonic()
    results = finish(
        start([sys.executable, str(launcher)], tmp_path / "c.yaml", 2, env(FEDML_SSFL_PROBE_INTERVAL="1")), TIMEOUT
    )
    (server_code, _, server_err), (client_code, _, _) = results
    assert client_code == 3
    assert server_code == 1, server_err[-4000:]
    summary = json.loads((cfg.run_dir() / "summary.json").read_text())
    assert summary["status"] == "failed" and "rank 1 (silo" in summary["error"] and "unreachable" in summary["error"]
    assert "rank 1 (silo" in server_err and "error:" in server_err
    assert load_checkpoint(cfg.run_dir() / "checkpoints" / "last.pt")["round"] == 0
    assert time.monotonic() - t0 < TIMEOUT
    state = load_checkpoint(cfg.run_dir() / "checkpoints" / "last.pt")["algorithm"]["global_state"]
    assert all(torch.isfinite(v).all() for v in state.values() if v.is_floating_point())


def _free_run_id(world: int) -> str:
    """A run id whose derived port block is free on 127.0.0.1 right now."""
    from fedml_ssfl.runtime.fedml_backend import run_port

    for n in range(100):
        run_id = f"launch-{os.getpid()}-{n}"
        try:
            socks = []
            for rank in range(world):
                s = socket.socket()
                socks.append(s)
                s.bind(("127.0.0.1", run_port(run_id, rank, world)))
            return run_id
        except OSError:
            continue
        finally:
            for s in socks:
                s.close()
    raise RuntimeError("no free port block")


def test_ranks_and_ports_come_from_what_fedml_launch_provides(tmp_path):
    """As under ``fedml launch``: no --rank on the clients (FEDML_CLIENT_RANK), no ports in the ipconfig
    (derived from FEDML_CURRENT_RUN_ID), the server started with --role server only."""
    world = 3
    cfg = grpc_config(tmp_path, world, "train_args.comm_round=1", "common_args.run_name=launch")
    (tmp_path / "ipconfig.csv").write_text(
        "eid,rank,grpc_server_ip\n" + "".join(f"{r},{r},127.0.0.1\n" for r in range(world))
    )
    run_id = _free_run_id(world)
    procs = []
    for rank in range(world):
        role = ["--role", "server"] if rank == 0 else []
        extra = {"FEDML_CURRENT_RUN_ID": run_id} | ({"FEDML_CLIENT_RANK": str(rank)} if rank else {})
        procs.append(
            subprocess.Popen(
                [str(CLI), "run", "--cf", str(tmp_path / "c.yaml"), *role],
                stdout=subprocess.PIPE,
                stderr=subprocess.PIPE,
                text=True,
                env=env(**extra),
            )
        )
    results = finish(procs, TIMEOUT)
    for rank, (code, stdout, stderr) in enumerate(results):
        assert code == 0, f"rank {rank}: {stdout[-2000:]}\n{stderr[-4000:]}"
    summary = json.loads((cfg.run_dir() / "summary.json").read_text())
    assert summary["status"] == "completed" and summary["runtime"] == "fedml-GRPC"
    import yaml

    assert yaml.safe_load((cfg.run_dir() / "config.yaml").read_text())["common_args"]["run_id"] == run_id


class _Pwned:
    def __init__(self, path):
        self.path = str(path)

    def __reduce__(self):
        return (open, (self.path, "w"))


def test_hostile_bytes_on_the_grpc_ports_run_nothing_and_the_run_completes(tmp_path):
    """A pickle that would write a file, and bytes that are no message at all, sent to the server's and a
    client's port while a run is in progress: nothing executes, the run completes, the drops are logged."""
    import grpc
    from fedml.core.distributed.communication.grpc import grpc_comm_manager_pb2, grpc_comm_manager_pb2_grpc

    from fedml_ssfl.runtime.fedml_backend import read_ipconfig

    cfg = grpc_config(tmp_path, 3, "train_args.comm_round=3", "common_args.run_name=attacked")
    ports = [p for _, p in read_ipconfig(tmp_path / "ipconfig.csv").values()]
    procs = start([str(CLI)], tmp_path / "c.yaml", 3, env())
    marker = tmp_path / "pwned"
    for port in (ports[0], ports[1]):
        deadline = time.monotonic() + 120  # wait for the port itself: gRPC's reconnect backoff grows to minutes
        while time.monotonic() < deadline:
            with socket.socket() as s:
                if s.connect_ex(("127.0.0.1", port)) == 0:
                    break
            time.sleep(0.2)
        with grpc.insecure_channel(f"127.0.0.1:{port}", options=[("grpc.enable_http_proxy", 0)]) as channel:
            stub = grpc_comm_manager_pb2_grpc.gRPCCommManagerStub(channel)
            for payload in (pickle.dumps(_Pwned(marker)), b"not a pickle"):
                request = grpc_comm_manager_pb2.CommRequest(client_id=0, message=payload)
                stub.sendMessage(request, timeout=60, wait_for_ready=True)
    results = finish(procs, TIMEOUT)
    for rank, (code, stdout, stderr) in enumerate(results):
        assert code == 0, f"rank {rank}: {stdout[-2000:]}\n{stderr[-4000:]}"
    assert not marker.exists()
    assert json.loads((cfg.run_dir() / "summary.json").read_text())["status"] == "completed"
    for rank in (0, 1):
        assert results[rank][2].count(f"rank {rank} dropped a message it could not decode") == 2, results[rank][2][
            -3000:
        ]
