"""A device-scale load on the GRPC server: one process, many virtual devices connecting out.

Starts the real server (``fedml-ssfl run --rank 0 --role server`` with ``comm_args.connect_out: true``,
mutual TLS and a job key) and, in this one process, ``--devices`` virtual devices: each is rank k of
the job with its own certificate (deploy/make_test_certs.sh) and its own
:class:`~fedml_ssfl.runtime.fedml.connect_out.ConnectOutComm` (sealed envelopes, the handshake with
membership and key proof, tickets, heartbeats, outboxes: the real wire protocol), answering each task
at once with the global weights it received (no training: the load is the server's). Each round a
fraction drawn in ``[--drop-min, --drop-max]`` of the devices drop their connection when their task
arrives and come back ``--away`` seconds later to reply (the server's strict rounds wait for them;
quorum rounds are issue 36 item 1's).

Writes ``benchmarks/results/device_load.json`` (one entry per ``--devices``): rounds/min, the server's
CPU seconds per round and per device-round, its resident memory at rest and with every device
connected (per connected device), p50/p99 round latency (the server's ``seconds`` per round), the
bytes each way on the wire, the load average of the machine.

Run::

    python benchmarks/device_load.py --devices 20 --rounds 3
    python benchmarks/device_load.py --devices 100 250 1000 --rounds 4
"""

from __future__ import annotations

import argparse
import json
import os
import queue
import random
import socket
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
RESULTS = ROOT / "benchmarks" / "results" / "device_load.json"
SMALL = [
    "data_args.dataset=digits",
    "data_args.num_server_labels=50",
    "model_args.model=cnn28",
    "model_args.norm=gn",
    "train_args.local_steps=1",
    "train_args.batch_size=32",
    "common_args.compare_with=[]",
    "tracking_args.progress_bar=false",
    "tracking_args.enable_tensorboard=false",
    "tracking_args.checkpoint_every=1000",
    "device_args.num_threads=1",
]


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def proc_stat(pid: int) -> tuple[float, float]:
    """(CPU seconds user+system, resident MiB) of a process."""
    fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    cpu = (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")
    rss = next(int(x.split()[1]) for x in Path(f"/proc/{pid}/status").read_text().splitlines() if x.startswith("VmRSS"))
    return cpu, rss / 1024


def make_job(tmp: Path, devices: int, rounds: int):
    """The job's config file, certificates for every rank, the server's port."""
    from fedml_ssfl.config import load_config

    certs = tmp / "certs"
    subprocess.run(
        ["bash", str(ROOT / "deploy/make_test_certs.sh"), str(certs), str(devices + 1)],
        check=True,
        timeout=1800,
        stdout=subprocess.DEVNULL,
        stderr=subprocess.DEVNULL,
    )
    port = free_port()
    (tmp / "ipconfig.csv").write_text(f"eid,rank,grpc_server_ip,grpc_server_port\n0,0,127.0.0.1,{port}\n")
    cfg = load_config(
        None,
        [
            *SMALL,
            f"common_args.output_dir={tmp / 'runs'}",
            "common_args.run_name=device_load",
            "common_args.training_type=cross_silo",
            "comm_args.backend=GRPC",
            "comm_args.connect_out=true",
            f"comm_args.grpc_ipconfig_path={tmp / 'ipconfig.csv'}",
            f"comm_args.tls_ca={certs / 'ca.pem'}",
            f"comm_args.tls_cert={certs / 'rank{rank}.pem'}",
            f"comm_args.tls_key={certs / 'rank{rank}.key'}",
            f"comm_args.job_key_file={certs / 'job.key'}",
            f"train_args.client_num_in_total={devices}",
            f"train_args.client_num_per_round={devices}",
            f"train_args.comm_round={rounds}",
        ],
    )
    (tmp / "c.yaml").write_text(cfg.to_yaml())
    return cfg, port


class Fleet:
    """The virtual devices and the few threads that answer their messages."""

    def __init__(self, cfg, devices: int, drop: tuple[float, float], away: float, seed: int):
        from fedml_ssfl.runtime.fedml import connect_out, launch, security, wire

        self.cfg, self.n, self.drop, self.away = cfg, devices, drop, away
        self.rng = random.Random(seed)
        self.inbox: queue.Queue = queue.Queue()
        self.limits = launch.timeouts()
        self.membership = security.membership(cfg)
        self.comms: dict[int, connect_out.ConnectOutComm] = {}
        self.finished: set[int] = set()
        self.dropping: dict[int, set[int]] = {}  # round -> ranks that drop in it
        self.dropped = 0
        self.bytes_up = self.bytes_down = 0
        self.lock = threading.Lock()
        self.done = threading.Event()
        table = launch.grpc_rank(cfg, 1, "client")[1]
        fleet = self

        class Device(connect_out.ConnectOutComm):
            """One virtual device: the real transport, its messages answered by the fleet's threads."""

            offline_until = 0.0

            def _fetch_call(self, stub):
                wait = self.offline_until - time.monotonic()
                if wait > 0:
                    self._stopping.wait(wait)
                call = super()._fetch_call(stub)

                def counted(ticket, timeout):
                    data = call(ticket, timeout=timeout)
                    with fleet.lock:
                        fleet.bytes_up += len(ticket)
                        fleet.bytes_down += len(data)
                    return data

                return counted

            def _send_to(self, receiver):
                send = super()._send_to(receiver)

                def counted(envelope, timeout):
                    send(envelope, timeout)
                    with fleet.lock:
                        fleet.bytes_up += len(envelope)

                return counted

        for rank in range(1, devices + 1):
            args = argparse.Namespace(
                ssfl_grpc_table=table,
                ssfl_security=security.load_security(cfg, rank),
                ssfl_job=None,
                grpc_ipconfig_path=cfg.comm_args.grpc_ipconfig_path,
            )
            args.ssfl_job = args.ssfl_security.job
            meter = wire.WireMeter()
            from fedml.core.distributed.communication.message import Message as FedMessage

            meter.message_class = FedMessage
            comm = Device.__new__(Device)
            comm.message_q = _Tagged(self.inbox, rank)
            Device.__init__(
                comm,
                grpc_ipconfig_path="",
                client_rank=rank,
                client_num=devices + 1,
                args=args,
                meter=meter,
                limits=self.limits,
            )
            comm.message_q = _Tagged(self.inbox, rank)  # __init__ set its own queue: route to the fleet's
            comm.args = args
            self.comms[rank] = comm
        self.workers = [threading.Thread(target=self._work, daemon=True) for _ in range(4)]
        for t in self.workers:
            t.start()
        self.hello_all()

    def hello_all(self) -> None:
        from fedml.core.distributed.communication.message import Message as FedMessage
        from fedml.cross_silo.server.message_define import MyMessage

        for rank, comm in self.comms.items():
            msg = FedMessage(MyMessage.MSG_TYPE_C2S_CLIENT_STATUS, rank, 0)
            msg.add_params(MyMessage.MSG_ARG_KEY_CLIENT_STATUS, "ONLINE")
            comm.send_message(msg)

    def _work(self) -> None:
        while not self.done.is_set():
            try:
                rank, item = self.inbox.get(timeout=0.5)
            except queue.Empty:
                continue
            comm = self.comms[rank]
            msg = item if not isinstance(item, tuple) else comm._decode(*item)
            if msg is None:
                continue
            try:
                self.handle(rank, comm, msg)
            except Exception as exc:  # a device's bug is the benchmark's: say it
                print(f"device {rank}: {type(exc).__name__}: {exc}", file=sys.stderr)

    def handle(self, rank: int, comm, msg) -> None:
        from fedml.core.distributed.communication.message import Message as FedMessage
        from fedml.cross_silo.server.message_define import MyMessage

        from fedml_ssfl.contract import Message
        from fedml_ssfl.runtime.fedml import payloads, security, transports
        from fedml_ssfl.runtime.fedml.adapters import UPLOAD_KEY
        from fedml_ssfl.runtime.fedml.protocol import Finish, Reply, Task

        kind = msg.get_type()
        if kind == MyMessage.MSG_TYPE_S2C_CHECK_CLIENT_STATUS:
            challenge = msg.get(transports.CHALLENGE)
            if isinstance(challenge, str) and comm.answer(challenge, msg.get(transports.SESSION) or ""):
                out = FedMessage(MyMessage.MSG_TYPE_C2S_CLIENT_STATUS, rank, 0)
                out.add_params(MyMessage.MSG_ARG_KEY_CLIENT_STATUS, "ONLINE")
                out.add_params(MyMessage.MSG_ARG_KEY_CLIENT_OS, "Linux")
                out.add_params(transports.MEMBERSHIP, self.membership)
                out.add_params(transports.CHALLENGE, challenge)
                key = comm.security.key
                out.add_params(
                    transports.PROOF,
                    security.proof(key, comm.args.ssfl_job, rank, self.membership, challenge, comm.session),
                )
                comm.send_message(out)
            return
        if kind in (MyMessage.MSG_TYPE_S2C_INIT_CONFIG, MyMessage.MSG_TYPE_S2C_SYNC_MODEL_TO_CLIENT):
            task = payloads.decode(msg.get(MyMessage.MSG_ARG_KEY_MODEL_PARAMS))
            if isinstance(task, Finish):
                self.finish(rank, comm)
                return
            assert isinstance(task, Task), type(task)
            with self.lock:
                if task.round not in self.dropping:
                    share = self.rng.uniform(*self.drop)
                    self.dropping[task.round] = set(self.rng.sample(sorted(self.comms), round(share * self.n)))
                drops = rank in self.dropping[task.round]
            if drops:  # the connection goes; the device comes back later and replies
                with comm._channel_lock:
                    old = comm._channels.pop(0, None)
                comm.offline_until = time.monotonic() + self.away
                if old is not None:
                    old[0].close()
                with self.lock:
                    self.dropped += 1
                time.sleep(0)  # the reply waits in the outbox until the channel is back
            sent = task.msg
            reply_msg = None
            if task.train and sent is not None:
                reply_msg = Message(weights=dict(sent.weights), extras={}, num_samples=max(sent.num_samples, 1))
            # a pooled worker's cached client states go back when asked (a virtual device keeps none: empty)
            states = {j: (task.round, {}) for j in task.upload}
            reply = Reply(task.round, task.silo, rank, trained=task.train, msg=reply_msg, states=states)
            out = FedMessage(MyMessage.MSG_TYPE_C2S_SEND_MODEL_TO_SERVER, rank, 0)
            out.add_params(MyMessage.MSG_ARG_KEY_MODEL_PARAMS, {UPLOAD_KEY: payloads.encode(reply)})
            out.add_params(MyMessage.MSG_ARG_KEY_NUM_SAMPLES, reply_msg.num_samples if reply_msg else 0)
            if drops:
                threading.Timer(self.away, comm.send_message, (out,)).start()
            else:
                comm.send_message(out)
            return
        if kind == MyMessage.MSG_TYPE_S2C_FINISH:
            self.finish(rank, comm)

    def finish(self, rank: int, comm) -> None:
        from fedml.core.distributed.communication.message import Message as FedMessage
        from fedml.cross_silo.server.message_define import MyMessage

        with self.lock:
            if rank in self.finished:
                return
            self.finished.add(rank)
        out = FedMessage(MyMessage.MSG_TYPE_C2S_CLIENT_STATUS, rank, 0)
        out.add_params(MyMessage.MSG_ARG_KEY_CLIENT_STATUS, "FINISHED")
        comm.send_message(out)

    def close(self) -> None:
        for comm in self.comms.values():
            comm.stop_receive_message(2.0)
        self.done.set()


class _Tagged:
    """A device's receive queue, routed to the fleet's shared one with the device's rank."""

    def __init__(self, inbox: queue.Queue, rank: int):
        self.inbox, self.rank = inbox, rank

    def put(self, item) -> None:
        self.inbox.put((self.rank, item))


def measure(devices: int, rounds: int, drop: tuple[float, float], away: float, seed: int, timeout: float) -> dict:
    from fedml_ssfl.config import ExperimentConfig  # noqa: F401 - the package on the path

    with tempfile.TemporaryDirectory() as tmp_name:
        tmp = Path(tmp_name)
        t0 = time.monotonic()
        cfg, port = make_job(tmp, devices, rounds)
        cert_s = time.monotonic() - t0
        env = dict(os.environ, PYTHONWARNINGS="ignore", FEDML_SSFL_CONNECT_TIMEOUT=str(int(timeout)))
        env["PYTHONPATH"] = os.pathsep.join(x for x in (str(ROOT), os.environ.get("PYTHONPATH", "")) if x)
        cli = Path(sys.executable).parent / "fedml-ssfl"
        log = open(tmp / "server.log", "w")  # noqa: SIM115 - closed below
        server = subprocess.Popen(
            [str(cli), "run", "--cf", str(tmp / "c.yaml"), "--rank", "0", "--role", "server"],
            stdout=log,
            stderr=subprocess.STDOUT,
            env=env,
        )
        try:
            deadline = time.monotonic() + 300
            while True:  # the server listens once its dataset is built
                with socket.socket() as s:
                    if s.connect_ex(("127.0.0.1", port)) == 0:
                        break
                if server.poll() is not None or time.monotonic() > deadline:
                    raise RuntimeError("the server did not start:\n" + (tmp / "server.log").read_text()[-3000:])
                time.sleep(0.5)
            time.sleep(1.0)
            cpu_rest, rss_rest = proc_stat(server.pid)
            fleet = Fleet(cfg, devices, drop, away, seed)
            samples = []
            first_round = None
            end = time.monotonic() + timeout
            rows_path = cfg.run_dir() / "metrics.jsonl"
            connected = None
            while server.poll() is None and time.monotonic() < end:
                cpu, rss = proc_stat(server.pid)
                samples.append((time.monotonic(), cpu, rss))
                if first_round is None and rows_path.exists() and rows_path.read_text().strip():
                    first_round = samples[-1]
                if connected is None and all(c.admitted(0) is not None for c in fleet.comms.values()):
                    connected = samples[-1]
                time.sleep(0.5)
            timed_out = server.poll() is None
            if timed_out:
                server.kill()
            server.wait(60)
            fleet.close()
        finally:
            if server.poll() is None:
                server.kill()
            log.close()
        text = (tmp / "server.log").read_text()
        rows = [json.loads(x) for x in rows_path.read_text().splitlines()] if rows_path.exists() else []
        secs = sorted(r["seconds"] for r in rows if "seconds" in r)
        last = samples[-1] if samples else (0.0, cpu_rest, rss_rest)
        start = connected or samples[0]
        span = max(last[0] - start[0], 1e-9)
        peak = max(s[2] for s in samples) if samples else rss_rest

        def pct(p: float) -> float | None:
            return secs[min(len(secs) - 1, int(round(p * (len(secs) - 1))))] if secs else None

        return {
            "devices": devices,
            "rounds_done": len(rows),
            "rounds_asked": rounds,
            "completed": not timed_out and server.returncode == 0,
            "drop_share": list(drop),
            "away_s": away,
            "devices_dropped": fleet.dropped,
            "rounds_per_min": 60 * len(secs) / sum(secs) if secs else None,
            "round_s_p50": pct(0.5),
            "round_s_p99": pct(0.99),
            "server_cpu_s": last[1] - cpu_rest,
            "server_cpu_s_per_device_round": (last[1] - start[1]) / max(len(rows), 1) / devices,
            "server_rss_mib_at_rest": rss_rest,
            "server_rss_mib_connected": (connected or last)[2],
            "server_rss_mib_peak": peak,
            "server_rss_kib_per_connected_device": 1024 * ((connected or last)[2] - rss_rest) / devices,
            "bytes_up": fleet.bytes_up,
            "bytes_down": fleet.bytes_down,
            "bytes_per_device_round": (fleet.bytes_up + fleet.bytes_down) / max(len(rows), 1) / devices,
            "wall_s_after_connect": span,
            "cert_s": cert_s,
            "load_avg_1min": os.getloadavg()[0],
            "cpus": os.cpu_count(),
            "server_tail": "" if not timed_out and server.returncode == 0 else text[-2000:],
        }


def opener_cost(senders: int, sessions: int = 3, envelopes: int = 3000) -> float:
    """Microseconds the server's :class:`~fedml_ssfl.runtime.fedml.security.Opener` spends on one
    envelope when ``senders`` ranks have each been seen with ``sessions`` sessions (restarts)."""
    from fedml_ssfl.runtime.fedml.security import HELLO, JobSecurity, Opener, Sealer

    sec = JobSecurity("job", b"k" * 32, None)
    opener = Opener(sec, 0, set(range(1, senders + 1)), 2**20)
    for rank in range(1, senders + 1):
        for _ in range(sessions):
            opener.open(Sealer(sec, rank).seal(0, b"", HELLO))
    sealers = [Sealer(sec, 1 + i % senders) for i in range(min(senders, 50))]
    batch = [sealers[i % len(sealers)].seal(0, b"", HELLO) for i in range(envelopes)]
    t0 = time.perf_counter()
    for envelope in batch:
        opener.open(envelope)
    return 1e6 * (time.perf_counter() - t0) / envelopes


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--devices", type=int, nargs="+", default=[20])
    p.add_argument("--rounds", type=int, default=3)
    p.add_argument("--drop-min", type=float, default=0.1)
    p.add_argument("--drop-max", type=float, default=0.3)
    p.add_argument("--away", type=float, default=2.0, help="seconds a dropping device stays away")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--timeout", type=float, default=1200.0)
    p.add_argument("--out", type=Path, default=RESULTS)
    p.add_argument("--opener", type=int, nargs="*", default=None, help="only measure opener_cost at these senders")
    p.add_argument("--label", default="", help="--opener: the key the figures are written under")
    a = p.parse_args(argv)
    out = json.loads(a.out.read_text()) if a.out.exists() else {}
    if a.opener is not None:
        figures = {str(n): opener_cost(n) for n in a.opener}
        print(json.dumps(figures))
        out[f"opener_us_per_envelope{a.label}"] = figures
        a.out.write_text(json.dumps(out, indent=1) + "\n")
        return 0
    for n in a.devices:
        result = measure(n, a.rounds, (a.drop_min, a.drop_max), a.away, a.seed, a.timeout)
        print(json.dumps(result, indent=1))
        out[str(n)] = result
        a.out.parent.mkdir(parents=True, exist_ok=True)
        a.out.write_text(json.dumps(out, indent=1) + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
