"""Hostile peers against live GRPC jobs on 127.0.0.1 (mutual TLS and a job key):

* an attacker holding a certificate of the job's CA (not the job key) sits as a proxy between rank 1
  and the server, records every envelope, and replays them all after the job is resumed (before and
  after the real rank 1 rejoins), besides hundreds of corrupted copies: nothing is accepted, the run
  completes with the simulator's model;
* a member gone wrong (rank 1's own process, its key and session) sends the server thousands of
  corrupted payloads: each is dropped with one line, the server never stops, the run completes
  with the simulator's model;
* a member (rank 1, its own key and session) that sends, before its own reply, a well-formed reply
  naming another rank's silo: refused with one line naming the rank, the run completes with the
  simulator's model;
* a worker whose update raises exits non-zero, its traceback in its own log, the server one line
  naming the silo;
* the true cause as the one-line error: a certificate for the wrong name, a plaintext silo against
  a TLS server, an expired certificate.
"""

from __future__ import annotations

import json
import random
import socket
import subprocess
import sys
import textwrap
import time
from concurrent import futures
from pathlib import Path

import pytest

from fedml_ssfl.checkpoint import load_checkpoint
from fedml_ssfl.config import load_config, validate
from fedml_ssfl.runtime.local import run_local
from tests.conftest import one_line_error
from tests.pki import make_ca, make_cert
from tests.test_fedml_grpc import CLI, env, finish, free_ports, grpc_config, wait_for_port

grpc = pytest.importorskip("grpc")
pytest.importorskip("fedml")

TIMEOUT = 300


def spawn(cmd: list[str], environ: dict, log: Path) -> subprocess.Popen:
    """Start ``cmd`` with its output in ``log``.out / .err (files, not pipes: a process that logs
    thousands of dropped messages must never block on a full pipe while the test waits for it)."""
    out, err = open(f"{log}.out", "w"), open(f"{log}.err", "w")  # noqa: SIM115 (closed by reap)
    proc = subprocess.Popen(cmd, stdout=out, stderr=err, text=True, env=environ)
    proc.logs = (out, err, log)
    return proc


def log_of(proc: subprocess.Popen) -> str:
    return Path(f"{proc.logs[2]}.err").read_text()[-3000:]


def wait_until(what: str, check, procs: list[subprocess.Popen], timeout: float = TIMEOUT) -> None:
    """Poll ``check()`` until true; fail naming ``what`` (and the log of a process that exited) otherwise."""
    deadline = time.monotonic() + timeout
    while not check():
        for p in procs:
            if p.poll() is not None:
                raise AssertionError(f"a process exited ({p.returncode}) before {what}: {log_of(p)}")
        assert time.monotonic() < deadline, f"{what}: not within {timeout} s"
        time.sleep(0.2)


def listening(port: int) -> bool:
    with socket.socket() as s:
        return s.connect_ex(("127.0.0.1", port)) == 0


def rounds_done(run_dir: Path) -> int:
    path = run_dir / "metrics.jsonl"
    return len(path.read_text().splitlines()) if path.exists() else 0


def same_model(run_dir: Path, local_dir: Path) -> None:
    """``run_dir`` ended with ``local_dir``'s model and every round's test accuracy."""
    a = load_checkpoint(local_dir / "checkpoints" / "last.pt")["algorithm"]["global_state"]
    b = load_checkpoint(run_dir / "checkpoints" / "last.pt")["algorithm"]["global_state"]
    assert max(float((a[k] - b[k]).abs().max()) for k in a) < 1e-5
    sim = [json.loads(x)["test_acc"] for x in (local_dir / "metrics.jsonl").read_text().splitlines()]
    dep = {
        json.loads(x)["round"]: json.loads(x)["test_acc"] for x in (run_dir / "metrics.jsonl").read_text().splitlines()
    }
    assert [dep[r] for r in sorted(dep)] == sim


def reap(procs: list[subprocess.Popen], timeout: float) -> list[tuple[int, str, str]]:
    """Wait for ``procs`` (kill what is left at ``timeout``); each one's exit code, stdout and stderr."""
    deadline = time.monotonic() + timeout
    results = []
    try:
        for p in procs:
            try:
                p.wait(timeout=max(1.0, deadline - time.monotonic()))
            except subprocess.TimeoutExpired:
                pass
    finally:
        for p in procs:
            if p.poll() is None:
                p.kill()
                p.wait()
    for p in procs:
        out, err, log = p.logs
        out.close()
        err.close()
        results.append((p.returncode, Path(f"{log}.out").read_text(), Path(f"{log}.err").read_text()))
    return results


class Proxy:
    """A gRPC server with a certificate of the job's CA that forwards every request to ``target`` and
    keeps a copy of each envelope (what an attacker on the path, or one holding a certificate, sees)."""

    def __init__(self, certs: Path, port: int, target: int):
        from fedml.core.distributed.communication.grpc import grpc_comm_manager_pb2_grpc as pbg

        ca = (certs / "ca.pem").read_bytes()
        cert, key = (certs / "rank0.pem").read_bytes(), (certs / "rank0.key").read_bytes()
        self.creds = grpc.ssl_channel_credentials(ca, key, cert)
        self.upstream = pbg.gRPCCommManagerStub(
            grpc.secure_channel(f"127.0.0.1:{target}", self.creds, options=[("grpc.enable_http_proxy", 0)])
        )
        self.seen: list[bytes] = []
        proxy = self

        class Forward(pbg.gRPCCommManagerServicer):
            def sendMessage(self, request, context):
                proxy.seen.append(bytes(request.message))
                try:
                    return proxy.upstream.sendMessage(request, timeout=60)
                except grpc.RpcError as exc:
                    context.abort(exc.code(), exc.details() or "")

        self.server = grpc.server(futures.ThreadPoolExecutor(max_workers=8))
        pbg.add_gRPCCommManagerServicer_to_server(Forward(), self.server)
        creds = grpc.ssl_server_credentials([(key, cert)], ca, require_client_auth=True)
        self.server.add_secure_port(f"127.0.0.1:{port}", creds)
        self.server.start()

    def send(self, port: int, envelope: bytes) -> str:
        """Send ``envelope`` to ``port`` as this certificate holder; the status code answered."""
        from fedml.core.distributed.communication.grpc import grpc_comm_manager_pb2 as pb
        from fedml.core.distributed.communication.grpc import grpc_comm_manager_pb2_grpc as pbg

        with grpc.secure_channel(f"127.0.0.1:{port}", self.creds, options=[("grpc.enable_http_proxy", 0)]) as ch:
            try:
                pbg.gRPCCommManagerStub(ch).sendMessage(pb.CommRequest(client_id=1, message=envelope), timeout=30)
            except grpc.RpcError as exc:
                return exc.code().name
        return "OK"

    def stop(self):
        self.server.stop(0)


# Rank 1 gone wrong: after its first reply it sends the server corrupted payloads sealed with its own key
# and session (so they reach the decoder), built from messages that change nothing if they decode.
FUZZING_CLIENT = textwrap.dedent(
    """
    import json, os, random, sys
    import torch
    from fedml.core.distributed.communication.message import Message as FedMessage
    from fedml.cross_silo.server.message_define import MyMessage
    from fedml_ssfl.algorithms.base import Message
    from fedml_ssfl.cli import main
    from fedml_ssfl.runtime.fedml import security, transports, wire
    from fedml_ssfl.runtime.fedml.protocol import Reply

    N = int(os.environ["SSFL_TEST_FUZZ"])
    original, state = transports.QuietGrpcComm.send_message, {"started": False}

    def message(kind, **params):
        m = FedMessage(kind, 1, 0)
        for k, v in params.items():
            m.add_params(k, v)
        return wire.dumps(m, FedMessage)

    def seeds():
        late = Reply(10**6, 0, 1, msg=Message(weights={"w": torch.ones(3, 4)}))
        sparse = torch.sparse_coo_tensor([[0, 2]], [1.0, 2.0], (4,))
        out = [
            message(MyMessage.MSG_TYPE_C2S_SEND_MODEL_TO_SERVER, model_params={"ssfl": late}, num_samples=5),
            message(MyMessage.MSG_TYPE_C2S_SEND_MODEL_TO_SERVER,
                    model_params={"ssfl": Reply(10**6, 0, 1, msg=Message(weights={"s": sparse}))}),
            message("ssfl_no_such_type"),
            message(MyMessage.MSG_TYPE_C2S_SEND_MODEL_TO_SERVER, model_params=None, num_samples=5),
            # the verdicts a process says only to itself: a peer's must not end the run
            message("ssfl_transport", event="undelivered", peer=1, label="a task", cause="forged", code="X"),
            message("ssfl_watchdog", action="fail", reason="forged"),
            message("ssfl_watchdog", action="force"),
        ]
        # the issue's two: a sparse tensor whose index and value counts differ, a shape of 2^62 x 2^62 x 0
        for seed, edit in ((out[1], "counts"), (out[0], "shape")):
            n = int.from_bytes(seed[9:17], "big")
            head = json.loads(seed[17:17 + n])
            text = json.dumps(head)
            if edit == "counts":
                text = text.replace('"float32", [2]', '"float32", [3]', 1)
            else:
                text = text.replace('"float32", [3, 4]', '"float32", [4611686018427387904, 4611686018427387904, 0]', 1)
            body = text.encode()
            out.append(seed[:9] + len(body).to_bytes(8, "big") + body + seed[17 + n:])
        return out

    def mutate(data, rng):
        b = bytearray(data)
        op = rng.randrange(5)
        if op == 0:
            for _ in range(rng.randint(1, 8)):
                b[rng.randrange(len(b))] = rng.randrange(256)
        elif op == 1:
            del b[rng.randrange(len(b)):]
        elif op == 2:
            at = rng.randrange(len(b))
            b[at:at] = rng.randbytes(rng.randint(1, 64))
        elif op == 3:  # inside the JSON header
            n = int.from_bytes(data[9:17], "big")
            for _ in range(rng.randint(1, 4)):
                b[17 + rng.randrange(n)] = rng.choice(b'{}[]",:0123456789-e.ntfalsrue ')
        else:
            at, size = rng.randrange(len(b)), rng.randint(1, 256)
            b[at:at] = b[at:at + size]
        return bytes(b)

    def fuzz(comm):
        rng, pool, codes = random.Random(7), seeds(), {}
        for i in range(N):
            data = pool[i] if i < len(pool) else mutate(rng.choice(pool), rng)
            try:
                comm._stub(0).sendMessage(comm._request(comm.sealer.seal(0, data)), timeout=30)
                code = "OK"
            except Exception as exc:
                code = getattr(exc, "code", lambda: type(exc))().name if hasattr(exc, "code") else type(exc).__name__
            codes[code] = codes.get(code, 0) + 1
        print("fuzz sent", N, json.dumps(codes, sort_keys=True), file=sys.stderr, flush=True)

    def send_message(self, msg):
        original(self, msg)
        if msg.get_type() == MyMessage.MSG_TYPE_C2S_SEND_MODEL_TO_SERVER and not state["started"]:
            state["started"] = True
            fuzz(self)  # on the message thread: the run waits for this rank's next reply meanwhile

    transports.QuietGrpcComm.send_message = send_message
    sys.exit(main(sys.argv[1:]))
    """
)


def corrupt(envelopes: list[bytes], n: int, seed: int = 3) -> list[bytes]:
    """``n`` corrupted copies of ``envelopes``: flipped bytes in header, payload or tag, truncations."""
    rng = random.Random(seed)
    out = []
    for _ in range(n):
        b = bytearray(rng.choice(envelopes))
        if rng.random() < 0.3:
            del b[rng.randrange(len(b)) :]
        else:
            for _ in range(rng.randint(1, 4)):
                b[rng.randrange(len(b))] ^= 1 << rng.randrange(8)
        out.append(bytes(b))
    return out


def test_captured_envelopes_replayed_after_a_resume_and_a_fuzzing_member_change_nothing(tmp_path):
    rounds = 6
    cfg = grpc_config(
        tmp_path,
        3,
        "train_args.client_num_in_total=4",
        f"train_args.comm_round={rounds}",
        "common_args.run_name=attacked",
        tls=True,
    )
    ports = [int(line.split(",")[3]) for line in (tmp_path / "ipconfig.csv").read_text().splitlines()[1:]]
    (proxy_port,) = free_ports(1)
    # rank 1 reaches "rank 0" through the proxy (the ipconfig path may differ per host)
    rows = (tmp_path / "ipconfig.csv").read_text().replace(f"0,0,127.0.0.1,{ports[0]}", f"0,0,127.0.0.1,{proxy_port}")
    (tmp_path / "via_proxy.csv").write_text(rows)
    fuzzer = tmp_path / "fuzz.py"
    fuzzer.write_text(FUZZING_CLIENT)
    environ = env(FEDML_SSFL_HEARTBEAT_INTERVAL="1", FEDML_SSFL_FINISH_GRACE="10")

    started = []

    def launch(rank: int, *extra: str, fuzz: int = 0) -> subprocess.Popen:
        role = "server" if rank == 0 else "client"
        prefix = [sys.executable, str(fuzzer)] if fuzz else [str(CLI)]
        cmd = [*prefix, "run", "--cf", str(tmp_path / "c.yaml"), "--rank", str(rank), "--role", role, *extra]
        via = ["--set", f"comm_args.grpc_ipconfig_path={tmp_path / 'via_proxy.csv'}"] if rank == 1 else []
        started.append(rank)
        log = tmp_path / f"rank{rank}-{len(started)}"
        return spawn([*cmd, *via], {**environ, "SSFL_TEST_FUZZ": str(fuzz)}, log)

    proxy = Proxy(tmp_path / "certs", proxy_port, ports[0])
    procs: list[subprocess.Popen | None] = []
    try:
        # the first process of the job: two rounds, every envelope of rank 1 recorded on the way
        first = reap([launch(0, "--stop-after", "2"), launch(1), launch(2)], TIMEOUT)
        for rank, (code, _, stderr) in enumerate(first):
            assert code == 0, f"rank {rank}: {stderr[-4000:]}"
        captured = list(proxy.seen)
        assert len(captured) >= 4, len(captured)  # the handshake, two replies, FINISHED (and heartbeats)

        # --resume: the server and rank 2 start, the attacker replays everything before rank 1 is back
        run_dir = cfg.run_dir()
        procs = [launch(0, "--resume", str(run_dir)), None, launch(2)]
        wait_until("the server listens", lambda: listening(ports[0]), procs[::2])
        time.sleep(2)

        def attack(envelopes: list[bytes]) -> list[str]:  # while the server runs (it ends when the run does)
            return [proxy.send(ports[0], e) for e in envelopes if procs[0].poll() is None]

        before = attack(captured)
        junk = attack(corrupt(captured, 300))
        procs[1] = launch(1, fuzz=1500)  # the real rank 1, gone wrong: it fuzzes the server once admitted
        wait_until("round 3", lambda: rounds_done(run_dir) >= 3, procs)
        after = attack(captured)  # again, with the real rank 1 admitted
        junk += attack(corrupt(captured, 300, seed=4))
        results = reap(procs, TIMEOUT)
    finally:
        proxy.stop()
        for p in procs:
            if p is not None and p.poll() is None:
                p.kill()
    for rank, (code, _, stderr) in enumerate(results):
        assert code == 0, f"rank {rank}: {stderr[-4000:]}"
    assert json.loads((run_dir / "summary.json").read_text())["status"] == "completed"
    # nothing of the first processes was taken: the handshake and the sessions refused it all
    ended = {"UNAVAILABLE", "CANCELLED"}  # the run ended while the attacker was still at it
    assert set(before) | set(after) <= {"OK", "FAILED_PRECONDITION", "ALREADY_EXISTS", *ended}, (before, after)
    assert "FAILED_PRECONDITION" in before and "FAILED_PRECONDITION" in after
    assert set(junk) <= {"PERMISSION_DENIED", "FAILED_PRECONDITION", *ended}, set(junk)
    assert junk.count("PERMISSION_DENIED") >= 300, len(junk)
    server_log = results[0][2]
    assert "answered a challenge this server did not send" in server_log, server_log[-3000:]
    fuzzed = [x for x in results[1][2].splitlines() if x.startswith("fuzz sent 1500")]
    assert fuzzed, results[1][2][-3000:]
    drops = (
        "it could not decode",
        "unknown type",
        "does not wait for",
        "not a reply of the protocol",
        "only this process",
    )
    dropped = sum(server_log.count(x) for x in drops)
    assert all(x in server_log for x in drops[3:]), server_log[-3000:]
    assert dropped >= 1000, (dropped, fuzzed)
    assert "RuntimeError" not in server_log and "Traceback" not in server_log
    # and the run is the uninterrupted run's
    raw = cfg.to_dict()
    raw["comm_args"] = {"backend": "local"}
    raw["common_args"]["training_type"] = "simulation"
    local = run_local(validate(raw), run_dir=tmp_path / "local")
    same_model(run_dir, local.run_dir)


# Rank 1 gone wrong in one way: before its reply of round 2 it sends a well-formed copy that names
# rank 2's silo, sealed with its own key and session (the issue's "replies for silos [1], expected [0, 1]").
FORGING_CLIENT = textwrap.dedent(
    """
    import dataclasses, sys
    from fedml.core.distributed.communication.message import Message as FedMessage
    from fedml.cross_silo.server.message_define import MyMessage
    from fedml_ssfl.cli import main
    from fedml_ssfl.runtime.fedml import transports

    original, sent = transports.QuietGrpcComm.send_message, []

    def send_message(self, msg):
        if msg.get_type() == MyMessage.MSG_TYPE_C2S_SEND_MODEL_TO_SERVER:
            sent.append(1)
            params = msg.get_params()
            upload = params[MyMessage.MSG_ARG_KEY_MODEL_PARAMS]
            if len(sent) == 2 and isinstance(upload, dict):
                forged = FedMessage(msg.get_type(), msg.get_sender_id(), msg.get_receiver_id())
                for key, value in params.items():
                    if key not in (FedMessage.MSG_ARG_KEY_TYPE, FedMessage.MSG_ARG_KEY_SENDER,
                                   FedMessage.MSG_ARG_KEY_RECEIVER):
                        forged.add_params(key, value)
                reply = upload["ssfl"]
                forged.add_params(MyMessage.MSG_ARG_KEY_MODEL_PARAMS,
                                  {"ssfl": dataclasses.replace(reply, silo=reply.silo + 1, rank=reply.rank + 1)})
                original(self, forged)
                print("forged a reply for silo", reply.silo + 1, file=sys.stderr, flush=True)
        original(self, msg)

    transports.QuietGrpcComm.send_message = send_message
    sys.exit(main(sys.argv[1:]))
    """
)


def job_with_rank1_running(tmp: Path, script: str) -> list[subprocess.Popen]:
    """The 3 ranks of ``tmp/c.yaml``'s GRPC job, rank 1 through ``script`` (a patched ``fedml-ssfl``)."""
    launcher = tmp / "rank1.py"
    launcher.write_text(script)
    procs = []
    for rank in range(3):
        prefix = [sys.executable, str(launcher)] if rank == 1 else [str(CLI)]
        role = "server" if rank == 0 else "client"
        cmd = [*prefix, "run", "--cf", str(tmp / "c.yaml"), "--rank", str(rank), "--role", role]
        procs.append(subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, env=env()))
    return procs


def test_a_members_reply_naming_another_silo_is_refused_and_the_run_completes(tmp_path):
    cfg = grpc_config(tmp_path, 3, "train_args.client_num_in_total=2", "train_args.comm_round=3", tls=True)
    results = finish(job_with_rank1_running(tmp_path, FORGING_CLIENT), TIMEOUT)
    for rank, (code, _, err) in enumerate(results):
        assert code == 0, f"rank {rank}: {err[-3000:]}"
    assert "forged a reply for silo 1" in results[1][2], results[1][2][-2000:]
    server_log = results[0][2]
    refused = [x for x in server_log.splitlines() if "refused rank 1's reply" in x]
    assert len(refused) == 1 and "rank 2 silo 1" in refused[0] and "asked rank 1 for silo 0" in refused[0], refused
    assert "RuntimeError" not in server_log and "Traceback" not in server_log
    raw = cfg.to_dict()
    raw["comm_args"] = {"backend": "local"}
    raw["common_args"]["training_type"] = "simulation"
    local = run_local(validate(raw), run_dir=tmp_path / "local")
    same_model(cfg.run_dir(), local.run_dir)


RAISING_CLIENT = textwrap.dedent(
    """
    import sys
    from fedml_ssfl.algorithms.fedavg_ssl import FedAvgSSL
    from fedml_ssfl.cli import main

    original = FedAvgSSL.client_update

    def raising(self, msg, data, state, ctx):
        if ctx.round_idx == 1:
            raise ValueError("the silo's data went bad")
        return original(self, msg, data, state, ctx)

    FedAvgSSL.client_update = raising
    sys.exit(main(sys.argv[1:]))
    """
)


def test_a_worker_that_raised_exits_non_zero_with_its_traceback_in_its_own_log(tmp_path):
    cfg = grpc_config(tmp_path, 3, "train_args.client_num_in_total=2", "train_args.comm_round=3")
    (code0, _, err0), (code1, _, err1), (code2, _, err2) = finish(
        job_with_rank1_running(tmp_path, RAISING_CLIENT), TIMEOUT
    )
    assert (code0, code1, code2) == (1, 1, 1), (err0[-2000:], err1[-2000:], err2[-2000:])
    summary = json.loads((cfg.run_dir() / "summary.json").read_text())
    assert (
        summary["status"] == "failed" and "failed in round 2: ValueError: the silo's data went bad" in summary["error"]
    )
    line = one_line_error(err0, "fedml-ssfl: error:")
    assert "rank 1 (silo" in line and "ValueError: the silo's data went bad" in line, line
    assert "Traceback" not in err0  # the traceback stays on the silo
    assert "Traceback (most recent call last)" in err1 and "raising" in err1
    for err in (err1, err2):  # each worker ends with the server's one line
        line = err.strip().splitlines()[-1]
        assert line.startswith("fedml-ssfl: error: rank "), line
        assert "the run failed: " in line and "ValueError: the silo's data went bad" in line, line


@pytest.fixture(scope="module")
def pki(tmp_path_factory):
    root = tmp_path_factory.mktemp("pki")
    ca = make_ca(root / "ca")
    return {
        "ca": ca,
        **{f"rank{r}": make_cert(ca, f"rank{r}") for r in range(3)},
        "wrong": make_cert(ca, "wrong", "IP:10.9.9.9"),
        "expired": make_cert(ca, "expired", days=-1),
    }


def tls_job(tmp: Path, pki, certs: dict[int, str]) -> Path:
    """A 3-rank GRPC job over TLS where rank r presents certificate ``certs.get(r, f"rank{r}")``; its config."""
    grpc_config(tmp, 3, "train_args.client_num_in_total=2", "train_args.comm_round=2")
    for r in range(3):
        cert, key = pki[certs.get(r, f"rank{r}")]
        (tmp / f"r{r}.pem").write_bytes(cert.read_bytes())
        (tmp / f"r{r}.key").write_bytes(key.read_bytes())
    raw = load_config(tmp / "c.yaml").to_dict()
    raw["comm_args"].update(
        insecure=False,
        tls_ca=str(pki["ca"] / "ca.pem"),
        tls_cert=str(tmp / "r{rank}.pem"),
        tls_key=str(tmp / "r{rank}.key"),
    )
    (tmp / "c.yaml").write_text(validate(raw).to_yaml())
    return tmp / "c.yaml"


def run_ranks(config: Path, environ: dict, extra: dict[int, list[str]] | None = None, ranks=range(3)):
    procs = []
    for rank in ranks:
        role = "server" if rank == 0 else "client"
        cmd = [str(CLI), "run", "--cf", str(config), "--rank", str(rank), "--role", role, *(extra or {}).get(rank, [])]
        procs.append(subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, env=environ))
    return procs


def test_an_expired_certificate_is_named_before_the_process_listens(tmp_path, pki):
    config = tls_job(tmp_path, pki, {1: "expired"})
    ((code, _, err),) = finish(run_ranks(config, env(), ranks=[1]), 120)
    assert code == 2
    line = one_line_error(err, "fedml-ssfl: error:")
    assert "comm_args.tls_cert" in line and "r1.pem, rank 1) expired on" in line, line


def test_a_plaintext_silo_and_a_peer_certificate_for_another_name_are_named_at_once(tmp_path, pki):
    """A silo run in plaintext against the TLS server: both name it at once (the server: the silo answers
    in plaintext; the silo: the server speaks TLS). Then a silo presenting a certificate for 10.9.9.9
    (it skips its own start-up check, as another version would): the server names the certificate and
    the name, at once."""
    config = tls_job(tmp_path, pki, {1: "wrong"})
    environ = env(FEDML_SSFL_CONNECT_TIMEOUT="240", FEDML_SSFL_FINISH_GRACE="5", FEDML_SSFL_HEARTBEAT_INTERVAL="2")
    t0 = time.monotonic()
    (server,) = run_ranks(config, environ, {0: ["--set", "common_args.run_name=a"]}, ranks=[0])
    wait_for_port(int((tmp_path / "ipconfig.csv").read_text().splitlines()[1].split(",")[3]), server)
    (plain,) = run_ranks(config, environ, {2: ["--set", "comm_args.insecure=true"]}, ranks=[2])
    (code0, _, err0), (code2, _, err2) = finish([server, plain], TIMEOUT)
    assert time.monotonic() - t0 < 200
    assert (code0, code2) == (1, 1), (err0[-3000:], err2[-3000:])
    line = one_line_error(err0, "fedml-ssfl: error:")
    assert "rank 2 (silo 1)" in line and "answers in plaintext" in line, line
    line = one_line_error(err2, "fedml-ssfl: error:")
    assert "speaks TLS, but this process runs in plaintext (comm_args.insecure: true)" in line, line

    skip_check = tmp_path / "nocheck.py"
    skip_check.write_text(
        "import sys\nfrom fedml_ssfl.runtime.fedml import run\nrun.check_own_certificate = lambda *a: None\n"
        "from fedml_ssfl.cli import main\nsys.exit(main(sys.argv[1:]))\n"
    )
    (server,) = run_ranks(config, environ, {0: ["--set", "common_args.run_name=b"]}, ranks=[0])
    wrong = subprocess.Popen(
        [sys.executable, str(skip_check), "run", "--cf", str(config), "--rank", "1", "--role", "client"],
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
        env={**environ, "FEDML_SSFL_OUTAGE_BUDGET": "20"},
    )
    t0 = time.monotonic()
    try:
        ((code0, _, err0),) = finish([server], TIMEOUT)
    finally:
        wrong.kill()  # it cannot be told (nothing reaches it): it would wait for the connect timeout
        wrong.communicate()
    assert code0 == 1 and time.monotonic() - t0 < 200, err0[-3000:]
    line = one_line_error(err0, "fedml-ssfl: error:")
    assert "rank 1 (silo 0)" in line and "is not valid for the name 127.0.0.1" in line, line
