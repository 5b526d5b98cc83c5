"""The FedML runtime over GRPC: one server and two clients as separate processes on 127.0.0.1
(``--rank N --role server|client`` + an ipconfig CSV), and a client process that dies.
"""

from __future__ import annotations

import json
import os
import pickle
import re
import socket
import struct
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


def make_certs(tmp: Path, world: int) -> list[str]:
    """A test CA, a certificate per rank and a job key (deploy/make_test_certs.sh), as config overrides."""
    certs = tmp / "certs"
    subprocess.run(["bash", str(ROOT / "deploy/make_test_certs.sh"), str(certs), str(world)], check=True, timeout=60)
    return [
        f"comm_args.tls_ca={certs / 'ca.pem'}",
        f"comm_args.tls_cert={certs / 'rank{rank}.pem'}",
        f"comm_args.tls_key={certs / 'rank{rank}.key'}",
        f"comm_args.job_key_file={certs / 'job.key'}",
    ]


def grpc_config(tmp: Path, world: int, *overrides: str, tls: bool = False) -> ExperimentConfig:
    """A GRPC job on 127.0.0.1: mutual TLS and a job key with ``tls``, else plaintext with a job key."""
    ip = tmp / "ipconfig.csv"
    rows = [f"{r},{r},127.0.0.1,{p}" for r, p in enumerate(free_ports(world))]
    ip.write_text("eid,rank,grpc_server_ip,grpc_server_port\n" + "\n".join(rows) + "\n")
    if tls:
        security = make_certs(tmp, world)
    else:
        (tmp / "job.key").write_text("k" * 64)
        security = ["comm_args.insecure=true", f"comm_args.job_key_file={tmp / 'job.key'}"]
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
            *security,
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
        tls=True,
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
    raw["comm_args"] = {"backend": "local"}
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
        start(
            [sys.executable, str(launcher)],
            tmp_path / "c.yaml",
            2,
            env(FEDML_SSFL_OUTAGE_BUDGET="10", FEDML_SSFL_HEARTBEAT_INTERVAL="1"),
        ),
        TIMEOUT,
    )
    (server_code, _, server_err), (client_code, _, _) = results
    assert client_code == 3
    assert server_code == 1, server_err[-4000:]
    summary = json.loads((cfg.run_dir() / "summary.json").read_text())
    error = summary["error"]
    # the watchdog (not heard from within the outage budget) or the outbox (the round's task undelivered
    # within it) says so first: both name the rank and the cause
    assert summary["status"] == "failed" and "rank 1 (silo" in error, error
    assert "was not heard from for" in error or "could not deliver a task" in error, error
    assert "FEDML_SSFL_OUTAGE_BUDGET 10 s" in error and "connection refused at 127.0.0.1:" in error, error
    assert "rank 1 (silo" in server_err and "error:" in server_err
    assert load_checkpoint(cfg.run_dir() / "checkpoints" / "last.pt")["round"] == 0
    assert time.monotonic() - t0 < TIMEOUT
    state = load_checkpoint(cfg.run_dir() / "checkpoints" / "last.pt")["algorithm"]["global_state"]
    assert all(torch.isfinite(v).all() for v in state.values() if v.is_floating_point())


STALLING_CLIENT = DYING_CLIENT.replace("os._exit(3)", "os.kill(os.getpid(), signal.SIGSTOP)").replace(
    "import os, sys", "import os, signal, sys"
)


def test_a_stalled_grpc_client_ends_the_run_in_bounded_time(tmp_path):
    """A client stopped with SIGSTOP in round 1 (alive, never answering): the server fails the run
    naming it within the round timeout and exits 1, the checkpoint of round 0 kept."""
    cfg = grpc_config(tmp_path, 2, "train_args.client_num_in_total=2", "train_args.comm_round=4")
    launcher = tmp_path / "launch.py"
    launcher.write_text(STALLING_CLIENT)
    server, client = start(
        [sys.executable, str(launcher)],
        tmp_path / "c.yaml",
        2,
        env(FEDML_SSFL_ROUND_TIMEOUT="15", FEDML_SSFL_HEARTBEAT_INTERVAL="1", FEDML_SSFL_FINISH_GRACE="5"),
    )
    try:
        ((server_code, _, server_err),) = finish([server], 150)
    finally:
        client.kill()
        client.communicate()
    assert server_code == 1, server_err[-4000:]
    summary = json.loads((cfg.run_dir() / "summary.json").read_text())
    assert summary["status"] == "failed" and "round 2" in summary["error"] and "rank 1 (silo" in summary["error"]
    assert "error:" in server_err and "rank 1 (silo" in server_err
    assert load_checkpoint(cfg.run_dir() / "checkpoints" / "last.pt")["round"] == 0


def _free_run_id(world: int) -> str:
    """A run id whose derived port block is free on 127.0.0.1 right now."""
    from fedml_ssfl.runtime.fedml.launch import run_port

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


def wait_for_port(port: int, proc: subprocess.Popen, timeout: float = 120) -> None:
    """Wait for ``proc`` to listen on ``port`` (gRPC's reconnect backoff grows to minutes); fail with its
    output if it exits first."""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        with socket.socket() as s:
            if s.connect_ex(("127.0.0.1", port)) == 0:
                return
        if proc.poll() is not None:
            out, err = proc.communicate()
            raise AssertionError(f"the process for port {port} exited ({proc.returncode}): {out[-2000:]}{err[-3000:]}")
        time.sleep(0.2)
    raise AssertionError(f"nothing listens on port {port}")


def send_raw(port: int, payload: bytes) -> str:
    """Send ``payload`` as a CommRequest over plaintext; the status code the receiver answered."""
    import grpc
    from fedml.core.distributed.communication.grpc import grpc_comm_manager_pb2, grpc_comm_manager_pb2_grpc

    opts = [("grpc.enable_http_proxy", 0), ("grpc.max_send_message_length", 64 * 2**20)]
    with grpc.insecure_channel(f"127.0.0.1:{port}", options=opts) as channel:
        stub = grpc_comm_manager_pb2_grpc.gRPCCommManagerStub(channel)
        try:
            stub.sendMessage(grpc_comm_manager_pb2.CommRequest(client_id=0, message=payload), timeout=60)
        except grpc.RpcError as exc:
            return exc.code().name
    return "OK"


# A client that replays, straight to the server's port, its first sealed message after its third.
REPLAYING_CLIENT = textwrap.dedent(
    """
    import sys
    import grpc
    from fedml.core.distributed.communication.grpc import grpc_comm_manager_pb2, grpc_comm_manager_pb2_grpc
    from fedml_ssfl.runtime.fedml import security
    from fedml_ssfl.cli import main

    original, sent = security.Sealer.seal, []

    def seal(self, receiver, payload, kind=security.MESSAGE):
        envelope = original(self, receiver, payload, kind)
        if kind == security.MESSAGE:  # replies: round 1's was received before round 2 began
            sent.append(envelope)
        if len(sent) == 3 and kind == security.MESSAGE:
            with grpc.insecure_channel(sys.argv[-1]) as channel:
                stub = grpc_comm_manager_pb2_grpc.gRPCCommManagerStub(channel)
                try:
                    stub.sendMessage(grpc_comm_manager_pb2.CommRequest(client_id=1, message=sent[0]), timeout=30)
                except grpc.RpcError as exc:
                    print("replay answered", exc.code().name, file=sys.stderr)
        return envelope

    security.Sealer.seal = seal

    # a long update (round 2): only the heartbeats show the server this rank is alive meanwhile
    import time
    from fedml_ssfl.algorithms.fedavg_ssl import FedAvgSSL

    update = FedAvgSSL.client_update

    def slow(self, msg, data, state, ctx):
        if ctx.round_idx == 1:
            time.sleep(10)
        return update(self, msg, data, state, ctx)

    FedAvgSSL.client_update = slow
    sys.exit(main(sys.argv[1:-1]))
    """
)


def stalled_request(port: int, declared: int = 2**20, sent: int = 16) -> socket.socket:
    """A gRPC call to ``sendMessage`` over plaintext HTTP/2 whose message never completes: the request's
    headers and the first ``sent`` of ``declared`` bytes, then nothing (the socket is kept open)."""

    def frame(kind: int, flags: int, stream: int, payload: bytes) -> bytes:
        return struct.pack(">I", len(payload))[1:] + bytes([kind, flags]) + struct.pack(">I", stream) + payload

    def header(name: str, value: str) -> bytes:  # HPACK: literal, not indexed, no Huffman
        return b"\x00" + bytes([len(name)]) + name.encode() + bytes([len(value)]) + value.encode()

    s = socket.create_connection(("127.0.0.1", port), timeout=10)
    block = b"".join(
        header(k, v)
        for k, v in (
            (":method", "POST"),
            (":scheme", "http"),
            (":path", "/gRPCCommManager/sendMessage"),
            (":authority", f"127.0.0.1:{port}"),
            ("content-type", "application/grpc"),
            ("te", "trailers"),
        )
    )
    s.sendall(b"PRI * HTTP/2.0\r\n\r\nSM\r\n\r\n" + frame(4, 0, 0, b"") + frame(4, 1, 0, b""))
    s.sendall(frame(1, 4, 1, block) + frame(0, 0, 1, b"\x00" + struct.pack(">I", declared) + b"\x00" * sent))
    return s


def rss_mib(pid: int, field: str = "VmRSS") -> float:
    """A process's resident memory (``VmRSS``) or its peak (``VmHWM``), in MiB."""
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        if line.startswith(field + ":"):
            return int(line.split()[1]) / 1024
    raise AssertionError(f"no {field} for {pid}")


def test_hostile_messages_on_the_grpc_ports_are_dropped_naming_the_peer_and_the_run_completes(tmp_path):
    """A pickle that would write a file, bytes that are no message, a forged, a tampered, an unknown-rank,
    an oversized and a replayed message, sent to the server's and a client's port while a run is in
    progress, and two requests on each port that never finish: nothing executes, each is dropped
    (logged naming the peer, the oversized ones refused by gRPC before they are read: the server's
    memory stays flat under a 256 MiB message), the stalled ones hold no thread, the run completes.
    Rank 1's update of round 2 takes 10 s, over the 6 s outage budget: its heartbeats keep it in."""
    from fedml_ssfl.runtime.fedml.launch import read_ipconfig
    from fedml_ssfl.runtime.fedml.security import JobSecurity, Sealer, job_identity

    cfg = grpc_config(tmp_path, 3, "train_args.comm_round=6", "common_args.run_name=attacked")
    table = read_ipconfig(tmp_path / "ipconfig.csv")
    ports = [p for _, p in table.values()]
    environ = env(
        FEDML_SSFL_MAX_MESSAGE_BYTES=str(2 * 2**20), FEDML_SSFL_OUTAGE_BUDGET="6", FEDML_SSFL_HEARTBEAT_INTERVAL="1"
    )
    launcher = tmp_path / "replay.py"
    launcher.write_text(REPLAYING_CLIENT)

    def launch(rank: int) -> subprocess.Popen:
        prefix = [sys.executable, str(launcher)] if rank == 1 else [str(CLI)]
        role = "server" if rank == 0 else "client"
        tail = [f"127.0.0.1:{ports[0]}"] if rank == 1 else []
        cmd = [*prefix, "run", "--cf", str(tmp_path / "c.yaml"), "--rank", str(rank), "--role", role, *tail]
        return subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, env=environ)

    procs = [launch(0), launch(1)]  # rank 2 starts after the attacks: the job waits for it meanwhile
    marker = tmp_path / "pwned"
    key = (tmp_path / "job.key").read_text().encode()
    job = job_identity(cfg, key)  # what anyone on the plaintext network reads in a header
    stranger = Sealer(JobSecurity(job=job, key=b"x" * 64, tls=None), 1)
    member = Sealer(JobSecurity(job=job, key=key, tls=None), 7)
    tampered = bytearray(Sealer(JobSecurity(job=job, key=key, tls=None), 1).seal(0, b"\x00" * 64))
    tampered[-40] ^= 1
    attacks = {
        "pickle": pickle.dumps(_Pwned(marker)),
        "not a message": b"not a pickle",
        "forged": stranger.seal(0, b"\x00" * 64),
        "tampered": bytes(tampered),
        "unknown rank": member.seal(0, b"\x00" * 64),
    }
    answers, stalled = {}, []
    for port, proc in zip(ports, procs):
        wait_for_port(port, proc)
        stalled += [stalled_request(port), stalled_request(port)]  # as many as the old thread pool had
        for name, payload in attacks.items():
            answers[port, name] = send_raw(port, payload)
    time.sleep(1)
    before = rss_mib(procs[0].pid)
    over = send_raw(ports[0], b"\x00" * (3 * 2**20))  # the limit is 2 MiB: gRPC refuses it unread
    huge = send_raw(ports[0], b"\x00" * (256 * 2**20))
    peak = rss_mib(procs[0].pid, "VmHWM")
    procs.append(launch(2))
    try:
        results = finish(procs, TIMEOUT)
    finally:
        for s in stalled:
            s.close()
    for rank, (code, stdout, stderr) in enumerate(results):
        assert code == 0, f"rank {rank}: {stdout[-2000:]}\n{stderr[-4000:]}"
    assert not marker.exists()
    assert json.loads((cfg.run_dir() / "summary.json").read_text())["status"] == "completed"
    assert set(answers.values()) == {"PERMISSION_DENIED"}, {
        k: v for k, v in answers.items() if v != "PERMISSION_DENIED"
    }
    assert over == huge == "RESOURCE_EXHAUSTED"
    assert peak - before < 64, (before, peak)  # the 256 MiB were never buffered
    server_log, client_log = results[0][2], results[1][2]
    for log_text, rank in ((server_log, 0), (client_log, 1)):
        dropped = [x for x in log_text.splitlines() if f"rank {rank} dropped a message from ipv4:127.0.0.1:" in x]
        assert sum("bad tag" in x for x in dropped) >= 2, dropped
        assert sum("not a sealed message" in x for x in dropped) == 2, dropped  # the pickle and the junk
    assert any("unknown rank 7" in x for x in server_log.splitlines()), server_log[-3000:]
    assert re.search(r"replayed: rank 1's message \d+ was already received", server_log), server_log[-3000:]
    assert "replay answered ALREADY_EXISTS" in client_log


def test_the_byte_cap_is_the_configured_limit_and_at_most_what_grpc_carries():
    from fedml_ssfl.runtime.fedml.transports import ENVELOPE_BYTES, grpc_byte_cap
    from fedml_ssfl.runtime.fedml.wire import DEFAULT_MAX_MESSAGE_BYTES

    assert grpc_byte_cap(2 * 2**20) == 2 * 2**20 + ENVELOPE_BYTES < 3 * 2**20
    assert grpc_byte_cap(DEFAULT_MAX_MESSAGE_BYTES) == 2**31 - 1


def test_tls_refuses_a_peer_without_a_certificate_of_the_jobs_ca(tmp_path):
    """Under mutual TLS a plaintext peer, and a peer with a certificate from another CA, cannot even
    deliver bytes; the run completes."""
    import grpc
    from fedml.core.distributed.communication.grpc import grpc_comm_manager_pb2, grpc_comm_manager_pb2_grpc

    from fedml_ssfl.runtime.fedml.launch import read_ipconfig

    cfg = grpc_config(tmp_path, 2, "train_args.client_num_in_total=2", "train_args.comm_round=2", tls=True)
    port = read_ipconfig(tmp_path / "ipconfig.csv")[0][1]

    def launch(rank: int) -> subprocess.Popen:
        role = "server" if rank == 0 else "client"
        cmd = [str(CLI), "run", "--cf", str(tmp_path / "c.yaml"), "--rank", str(rank), "--role", role]
        return subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, env=env())

    procs = [launch(0)]  # the client starts after the attempts: the server waits for it meanwhile
    wait_for_port(port, procs[0])
    assert send_raw(port, b"hello") == "UNAVAILABLE"
    other = tmp_path / "other"
    subprocess.run(["bash", str(ROOT / "deploy/make_test_certs.sh"), str(other), "1"], check=True, timeout=60)
    creds = grpc.ssl_channel_credentials(
        (other / "ca.pem").read_bytes(), (other / "rank0.key").read_bytes(), (other / "rank0.pem").read_bytes()
    )
    with grpc.secure_channel(f"127.0.0.1:{port}", creds, options=[("grpc.enable_http_proxy", 0)]) as channel:
        stub = grpc_comm_manager_pb2_grpc.gRPCCommManagerStub(channel)
        with pytest.raises(grpc.RpcError) as refused:
            stub.sendMessage(grpc_comm_manager_pb2.CommRequest(client_id=0, message=b"hello"), timeout=20)
    assert refused.value.code() == grpc.StatusCode.UNAVAILABLE
    assert procs[0].poll() is None  # the server was up all along: the refusals were TLS's
    procs.append(launch(1))
    for rank, (code, stdout, stderr) in enumerate(finish(procs, TIMEOUT)):
        assert code == 0, f"rank {rank}: {stdout[-2000:]}\n{stderr[-4000:]}"
    assert json.loads((cfg.run_dir() / "summary.json").read_text())["status"] == "completed"


def test_strangers_are_refused_naming_what_differs(tmp_path):
    """Rank 1 holds another job key (its messages are dropped; it stops naming why); rank 2 runs with
    another seed and partition (the handshake refuses it, naming both keys). The server stops at the
    connect timeout, naming them."""
    cfg = grpc_config(tmp_path, 3, "train_args.comm_round=2")
    (tmp_path / "other.key").write_text("o" * 64)
    environ = env(FEDML_SSFL_CONNECT_TIMEOUT="45")  # above any start-up time on a loaded 2-core machine
    base = [str(CLI), "run", "--cf", str(tmp_path / "c.yaml")]
    extra = {
        1: ["--set", f"comm_args.job_key_file={tmp_path / 'other.key'}"],
        2: ["--set", "common_args.random_seed=1", "--set", "data_args.partition_method=dirichlet"],
    }
    procs = [
        subprocess.Popen(
            [*base, "--rank", str(r), "--role", "server" if r == 0 else "client", *extra.get(r, [])],
            stdout=subprocess.PIPE,
            stderr=subprocess.PIPE,
            text=True,
            env=environ if r != 1 else {**environ, "FEDML_SSFL_CONNECT_TIMEOUT": "240"},  # it waits for the server
        )
        for r in range(3)
    ]
    (server, _, server_err), (code1, _, err1), (code2, _, err2) = finish(procs, TIMEOUT)
    assert code1 != 0 and "bad tag" in err1 and "Traceback" not in err1, err1[-3000:]
    line1 = next(x for x in err1.splitlines() if "error:" in x)
    assert "could not deliver a status to the server (rank 0)" in line1 and "PERMISSION_DENIED" in line1, line1
    assert code2 == 2 and "Traceback" not in err2, err2[-3000:] + "\n--- server:\n" + server_err[-4000:]
    line2 = next(x for x in err2.splitlines() if "error:" in x)
    assert "refused" in line2 and "common_args.random_seed (server 0, rank 2 1)" in line2, line2
    assert "data_args.partition_method (server 'iid', rank 2 'dirichlet')" in line2, line2
    assert server == 1
    error = json.loads((cfg.run_dir() / "summary.json").read_text())["error"]
    assert "rank 2 was refused" in error and "common_args.random_seed" in error, error
    assert "rank 1 was refused: could not deliver" in error and "bad tag" in error, error  # not a verdict at once
    assert "dropped a message from ipv4:127.0.0.1:" in server_err and "bad tag" in server_err


def test_a_second_server_or_a_duplicate_rank_cannot_join_and_exits(tmp_path):
    """No port sharing: while the job waits for rank 2, a second server and a second rank 1 exit at once
    naming the port; then rank 2 starts and the job completes with its own processes."""
    from fedml_ssfl.runtime.fedml.launch import read_ipconfig

    cfg = grpc_config(tmp_path, 3, "train_args.comm_round=2", "common_args.run_name=dup")
    ports = [p for _, p in read_ipconfig(tmp_path / "ipconfig.csv").values()]

    def launch(rank: int) -> subprocess.Popen:
        role = "server" if rank == 0 else "client"
        cmd = [str(CLI), "run", "--cf", str(tmp_path / "c.yaml"), "--rank", str(rank), "--role", role]
        return subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, env=env())

    procs = [launch(0), launch(1)]
    try:
        for port, proc in zip(ports, procs):
            wait_for_port(port, proc)
        for rank in (0, 1):
            ((code, _, err),) = finish([launch(rank)], 120)
            assert code == 2, err[-3000:]
            assert f"cannot listen on 127.0.0.1:{ports[rank]}" in err and "Traceback" not in err, err[-3000:]
        assert sorted(p.name for p in (tmp_path / "runs").iterdir()) == ["dup"]  # the second server claimed nothing
        procs.append(launch(2))
    finally:
        results = finish(procs, TIMEOUT)
    for rank, (code, stdout, stderr) in enumerate(results):
        assert code == 0, f"rank {rank}: {stdout[-2000:]}\n{stderr[-4000:]}"
    assert json.loads((cfg.run_dir() / "summary.json").read_text())["status"] == "completed"


def test_the_transport_binds_without_port_sharing(tmp_path):
    """The server socket has SO_REUSEPORT off: no other socket can share its port, even one that asks to."""
    from types import SimpleNamespace

    from fedml_ssfl.config import ConfigError
    from fedml_ssfl.runtime.fedml.launch import timeouts
    from fedml_ssfl.runtime.fedml.security import JobSecurity
    from fedml_ssfl.runtime.fedml.transports import QuietGrpcComm
    from fedml_ssfl.runtime.fedml.wire import WireMeter

    (port,) = free_ports(1)
    args = SimpleNamespace(ssfl_grpc_table={0: ("127.0.0.1", port)}, ssfl_security=JobSecurity("j", None, None))

    def comm():
        return QuietGrpcComm(
            grpc_ipconfig_path="", client_rank=0, client_num=1, args=args, meter=WireMeter(), limits=timeouts()
        )

    first = comm()
    try:
        with socket.socket() as s:
            s.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEPORT, 1)
            with pytest.raises(OSError):
                s.bind(("127.0.0.1", port))
        with pytest.raises(ConfigError, match=f"cannot listen on 127.0.0.1:{port}"):
            comm()
    finally:
        first.stop_receive_message()


def test_a_server_resumed_on_a_finished_run_tells_a_live_worker_the_end_and_lets_the_exited_one_go(tmp_path):
    """The server is restarted with --resume after its run ended (killed after its last commit, say):
    a worker still running comes back and is told the end; one that had exited is let go after the
    outage budget; the server exits 0, naming the rank it let go, with the run's results unchanged."""
    cfg = grpc_config(tmp_path, 3, "train_args.client_num_in_total=2", "train_args.comm_round=1")
    environ = env(FEDML_SSFL_OUTAGE_BUDGET="4", FEDML_SSFL_HEARTBEAT_INTERVAL="1")
    for rank, (code, stdout, stderr) in enumerate(finish(start([str(CLI)], tmp_path / "c.yaml", 3, environ), TIMEOUT)):
        assert code == 0, f"rank {rank}: {stdout[-2000:]}\n{stderr[-4000:]}"
    last = (cfg.run_dir() / "checkpoints" / "last.pt").read_bytes()
    server, live = (
        subprocess.Popen(
            [str(CLI), "run", "--cf", str(tmp_path / "c.yaml"), "--rank", str(rank), "--role", role, "--resume"],
            stdout=subprocess.PIPE,
            stderr=subprocess.PIPE,
            text=True,
            env=environ,
        )
        for rank, role in ((0, "server"), (1, "client"))
    )
    (code, stdout, stderr), (live_code, _, live_err) = finish([server, live], 90)
    assert code == 0, f"{stdout[-2000:]}\n{stderr[-4000:]}"
    assert live_code == 0, live_err[-4000:]
    assert "nothing to run" in stderr
    assert re.search(r"ranks \[2\] did not acknowledge its end", stderr), stderr[-4000:]
    assert (cfg.run_dir() / "checkpoints" / "last.pt").read_bytes() == last
