"""Connect-out GRPC (``comm_args.connect_out: true``, runtime/fedml/connect_out.py): the clients dial the
server and fetch their tasks; the server's ipconfig row is the only one. A real 3-process job over mutual
TLS with the job key ends with exactly the simulator's model; a stranger without the CA's certificate,
or with it but without the job key, gets nothing.
"""

from __future__ import annotations

import json
import subprocess
from pathlib import Path

import pytest

from fedml_ssfl.checkpoint import load_checkpoint
from fedml_ssfl.config import ConfigError, validate
from fedml_ssfl.runtime.local import run_local
from tests.test_fedml_grpc import CLI, env, finish, free_ports, grpc_config, start

pytest.importorskip("fedml")
grpc = pytest.importorskip("grpc")

TIMEOUT = 240


def server_only_ipconfig(tmp: Path) -> int:
    """Rewrite the job's ipconfig CSV to the server's row alone (clients have no address); its port."""
    port = free_ports(1)[0]
    (tmp / "ipconfig.csv").write_text(f"eid,rank,grpc_server_ip,grpc_server_port\n0,0,127.0.0.1,{port}\n")
    return port


def connect_out_config(tmp: Path, *overrides: str):
    cfg = grpc_config(
        tmp,
        3,
        "train_args.client_num_in_total=4",
        "train_args.comm_round=2",
        "comm_args.connect_out=true",
        "common_args.run_name=out",
        *overrides,
        tls=True,
    )
    return cfg, server_only_ipconfig(tmp)


def fetch_as(port: int, creds, ticket: bytes) -> str:
    """One fetch call to the server as a stranger; the status code it got."""
    from fedml_ssfl.runtime.fedml.connect_out import FETCH

    opts = [("grpc.enable_http_proxy", 0)]
    with grpc.secure_channel(f"127.0.0.1:{port}", creds, options=opts) as channel:
        try:
            channel.unary_unary(FETCH)(ticket, timeout=20)
        except grpc.RpcError as exc:
            return f"{exc.code().name}: {exc.details()}"
    return "OK"


def test_connect_out_job_of_three_processes_ends_with_the_simulators_model_and_strangers_get_nothing(tmp_path):
    """The server alone first: a stranger without a certificate of the job's CA fails TLS; one with rank
    1's certificate but another job key has its ticket refused. Then the two clients connect out."""
    from fedml_ssfl.runtime.fedml.security import HELLO, JobSecurity, Sealer
    from tests.test_fedml_grpc import wait_for_port

    cfg, port = connect_out_config(tmp_path)
    environ = env(FEDML_SSFL_HEARTBEAT_INTERVAL="1")
    procs = start([str(CLI)], tmp_path / "c.yaml", 1, environ)
    wait_for_port(port, procs[0])
    certs = tmp_path / "certs"
    ticket = Sealer(JobSecurity(cfg.common_args.run_id, b"x" * 32, None), 1).seal(0, b'{"ack":0,"code":"OK"}', HELLO)
    no_cert = grpc.ssl_channel_credentials((certs / "ca.pem").read_bytes())
    assert fetch_as(port, no_cert, ticket).startswith("UNAVAILABLE")
    with_cert = grpc.ssl_channel_credentials(
        (certs / "ca.pem").read_bytes(), (certs / "rank1.key").read_bytes(), (certs / "rank1.pem").read_bytes()
    )
    refused = fetch_as(port, with_cert, ticket)
    assert refused.startswith("PERMISSION_DENIED") and "job key" in refused, refused
    assert procs[0].poll() is None
    procs += [
        subprocess.Popen(
            [str(CLI), "run", "--cf", str(tmp_path / "c.yaml"), "--rank", str(r), "--role", "client"],
            stdout=subprocess.PIPE,
            stderr=subprocess.PIPE,
            text=True,
            env=environ,
        )
        for r in (1, 2)
    ]
    results = finish(procs, TIMEOUT)
    for rank, (code, stdout, stderr) in enumerate(results):
        assert code == 0, f"rank {rank}: {stdout[-2000:]}\n{stderr[-4000:]}"
    assert "refused a fetch" in results[0][2]
    summary = json.loads((cfg.run_dir() / "summary.json").read_text())
    assert summary["status"] == "completed" and summary["runtime"] == "fedml-GRPC"
    raw = cfg.to_dict()
    raw["comm_args"] = {"backend": "local"}
    raw["common_args"]["training_type"] = "simulation"
    local = run_local(validate(raw), run_dir=tmp_path / "local")
    a = load_checkpoint(local.run_dir / "checkpoints" / "last.pt")["algorithm"]["global_state"]
    b = load_checkpoint(cfg.run_dir() / "checkpoints" / "last.pt")["algorithm"]["global_state"]
    assert max(float((a[k] - b[k]).abs().max()) for k in a) < 1e-5


def test_connect_out_is_a_grpc_key_and_needs_only_the_servers_row(tmp_path):
    with pytest.raises(ConfigError, match="comm_args.connect_out"):
        validate({"comm_args": {"backend": "MPI", "connect_out": True}, "common_args": {"training_type": "cross_silo"}})
    from fedml_ssfl.runtime.fedml.launch import grpc_rank

    cfg, port = connect_out_config(tmp_path)
    assert grpc_rank(cfg, 2, "client")[1] == {0: ("127.0.0.1", port), 1: ("", 0), 2: ("", 0)}
    raw = cfg.to_dict()
    raw["comm_args"]["connect_out"] = False
    with pytest.raises(ConfigError, match="lists ranks"):
        grpc_rank(validate(raw), 2, "client")
