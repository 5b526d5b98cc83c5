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


class _Box:
    """The server's side of the mailbox without a job: a running event loop and the send function."""

    def __init__(self):
        import asyncio
        import threading

        from fedml_ssfl.runtime.fedml.connect_out import ConnectOutComm

        self.loop = asyncio.new_event_loop()
        threading.Thread(target=self.loop.run_forever, daemon=True).start()
        comm = ConnectOutComm.__new__(ConnectOutComm)
        comm.client_rank, comm._lock, comm.mailboxes, comm._loop = 0, threading.Lock(), {}, self.loop
        self.comm, self.send = comm, comm._send_to(1)

    def fetch(self, wait=2.0):
        import asyncio

        return asyncio.run_coroutine_threadsafe(self.comm.mailbox(1).take(wait), self.loop).result(10)

    def sending(self, envelope, timeout=10.0):
        import threading

        out = {}

        def run():
            try:
                self.send(envelope, timeout)
                out["code"] = "OK"
            except Exception as exc:
                out["code"] = getattr(exc, "code", repr(exc))

        t = threading.Thread(target=run)
        t.start()
        return t, out


@pytest.mark.parametrize("answer", ["OK", "ALREADY_EXISTS", "FAILED_PRECONDITION", "PERMISSION_DENIED"])
def test_an_envelope_counts_as_sent_when_the_fetch_acknowledges_it_with_the_clients_status(answer):
    """The outbox's send returns the status the client's ticket acknowledged, so a duplicate is delivered,
    an unknown session re-runs the handshake and a refusal gives it up, as under GRPC."""
    box = _Box()
    envelope = b"sealed"
    thread, out = box.sending(envelope)
    pending = box.fetch()  # the client's long poll is answered with it
    assert pending is not None and pending.envelope is envelope
    thread.join(0.3)
    assert thread.is_alive()  # handed out is not sent: the acknowledgement is
    box.comm.mailbox(1).ack(pending.number, answer, "why")
    thread.join(5)
    assert out["code"] == answer
    assert box.fetch(0.2) is None  # acknowledged: not sent again


def test_an_unacknowledged_envelope_is_handed_out_again_and_a_retry_is_no_new_message():
    box = _Box()
    envelope = b"sealed"
    thread, out = box.sending(envelope, timeout=1.0)
    first = box.fetch()
    again = box.fetch()  # the answer was lost: the next fetch acknowledges nothing, gets it again
    assert again is first
    thread.join(5)
    assert out["code"] == "UNAVAILABLE"  # not fetched and acknowledged within the attempt: retried
    assert box.fetch(0.2) is None  # given up: not left behind for a later fetch
    thread, out = box.sending(envelope)
    retry = box.fetch()
    thread2, out2 = box.sending(envelope)  # the outbox's retry of the same bytes while it waits
    assert box.comm.mailbox(1).number == retry.number
    box.comm.mailbox(1).ack(retry.number, "OK", "")
    thread.join(5), thread2.join(5)
    assert out["code"] == out2["code"] == "OK"


def test_the_replay_memory_of_one_sender_keeps_its_newest_sessions_and_leaves_the_others_alone():
    """The opener keeps, per sender, the sequence numbers of its newest SESSIONS_KEPT sessions (and the
    admitted one); it prunes one sender's without looking at the others' (an envelope costs the same
    at 1,000 devices as at 2: docs/performance.md)."""
    from fedml_ssfl.runtime.fedml.security import HELLO, SESSIONS_KEPT, Duplicate, JobSecurity, Opener, Sealer

    sec = JobSecurity("job", b"k" * 32, None)
    opener = Opener(sec, 0, set(range(1, 4)), 2**20)
    first = Sealer(sec, 1)
    opener.admit(1, first.session)
    opener.open(first.seal(0, b"", HELLO))
    other = Sealer(sec, 2)
    opener.open(other.seal(0, b"", HELLO))
    for _ in range(SESSIONS_KEPT + 3):  # rank 1 restarts many times
        opener.open(Sealer(sec, 1).seal(0, b"", HELLO))
    ones = [k for k in opener.seen if k[0] == 1]
    assert len(ones) == SESSIONS_KEPT + 1 and (1, first.session) in opener.seen  # the admitted one stays too
    assert (2, other.session) in opener.seen
    replay = other.seal(0, b"", HELLO)
    opener.open(replay)
    with pytest.raises(Duplicate):
        opener.open(replay)


def test_a_connect_out_silo_killed_in_a_round_and_started_again_rejoins_and_the_model_is_the_simulators(tmp_path):
    """GRPC's outage semantics, connecting out: in a deployment (one process per silo, its own file)
    silo 0's process dies in round 2 (exit 3) and is started again with the same command; the server,
    which has no address for it, hands the new process the round's task when it fetches, and the run
    ends with the simulator's model."""
    import sys

    from fedml_ssfl.config import load_config
    from fedml_ssfl.experiment import export_deployment
    from tests.conftest import SMALL
    from tests.test_fedml_grpc import DYING_CLIENT, make_certs

    settings = [
        *SMALL,
        "train_args.client_num_in_total=3",
        "train_args.client_num_per_round=3",
        "train_args.comm_round=3",
        "ssfl_args.algorithm=fedavg_ssl",
        "device_args.num_threads=1",
    ]
    sim = load_config(None, [*settings, f"common_args.output_dir={tmp_path / 'runs'}", "common_args.run_name=sim"])
    exported = export_deployment(sim, tmp_path / "data")
    port = free_ports(1)[0]
    (tmp_path / "ipconfig.csv").write_text(f"eid,rank,grpc_server_ip,grpc_server_port\n0,0,127.0.0.1,{port}\n")
    cfg = load_config(
        exported,
        [
            "comm_args.backend=GRPC",
            "comm_args.connect_out=true",
            f"comm_args.grpc_ipconfig_path={tmp_path / 'ipconfig.csv'}",
            "common_args.run_name=out",
            *make_certs(tmp_path, 4),
        ],
    )
    (tmp_path / "c.yaml").write_text(cfg.to_yaml())
    launcher = tmp_path / "launch.py"
    launcher.write_text(DYING_CLIENT)
    environ = env(FEDML_SSFL_HEARTBEAT_INTERVAL="1")

    def launch(cmd: list[str], rank: int) -> subprocess.Popen:
        role = "server" if rank == 0 else "client"
        args = ["run", "--cf", str(tmp_path / "c.yaml"), "--rank", str(rank), "--role", role]
        return subprocess.Popen([*cmd, *args], stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, env=environ)

    procs = [launch([str(CLI)], 0), launch([sys.executable, str(launcher)], 1), launch([str(CLI)], 2)]
    procs.append(launch([str(CLI)], 3))
    ((code, _, _),) = finish([procs[1]], TIMEOUT)
    assert code == 3
    procs[1] = launch([str(CLI)], 1)
    results = finish(procs, TIMEOUT)
    for rank, (code, stdout, stderr) in enumerate(results):
        assert code == 0, f"rank {rank}: {stdout[-2000:]}\n{stderr[-4000:]}"
    assert "rejoined as a new process" in results[0][2]
    local = run_local(sim, run_dir=tmp_path / "local")
    a = load_checkpoint(local.run_dir / "checkpoints" / "last.pt")["algorithm"]["global_state"]
    b = load_checkpoint(cfg.run_dir() / "checkpoints" / "last.pt")["algorithm"]["global_state"]
    assert max(float((a[k] - b[k]).abs().max()) for k in a) < 1e-5
