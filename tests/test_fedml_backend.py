"""The FedML runtime's pieces, in one process: protocol, per-silo state, checks, offline guard.

The server and worker halves of :mod:`fedml_ssfl.runtime.fedml` contain no FedML; here
they talk through the wire codec exactly as over MPI/GRPC (:mod:`fedml_ssfl.runtime.fedml.wire`), so the round logic,
per-silo state routing and fault handling are checked fast, without launching processes.
"""

from __future__ import annotations

import json
import socket
import subprocess
import sys

import pytest
import torch

from fedml_ssfl.algorithms.base import Message
from fedml_ssfl.checkpoint import load_checkpoint
from fedml_ssfl.config import ConfigError
from fedml_ssfl.experiment import build_experiment
from fedml_ssfl.runtime import offline
from fedml_ssfl.runtime.common import RunFailed
from fedml_ssfl.runtime.fedml import wire as codec
from fedml_ssfl.runtime.fedml.launch import gpu_for_rank, grpc_rank, read_ipconfig
from fedml_ssfl.runtime.fedml.payloads import check_reply, decode, encode
from fedml_ssfl.runtime.fedml.server import ServerRuntime, assign_silos
from fedml_ssfl.runtime.fedml.worker import ClientWorker
from fedml_ssfl.runtime.local import run_local


def wire(obj):
    """What a payload looks like after crossing MPI / GRPC."""
    return decode(codec.loads(codec.dumps(encode(obj))))


def run_protocol(cfg, run_dir, tamper=None, stop_after=None, resume=False, workers_out=None, n_workers=None):
    """Drive ServerRuntime + C_k ClientWorkers (one experiment each, as separate processes would), or
    ``n_workers`` of them serving several silos each; ``workers_out`` (a dict) receives the workers by rank."""
    exp = build_experiment(cfg)
    exp.algorithm.setup()
    state = load_checkpoint(run_dir / "checkpoints" / "last.pt") if resume else None
    ck = n_workers or cfg.train_args.client_num_per_round
    rt = ServerRuntime(cfg, exp, run_dir, state, ck, stop_after=stop_after)
    workers = {w: ClientWorker(build_experiment(cfg), w) for w in range(1, ck + 1)}
    if workers_out is not None:
        workers_out.update(workers)
    served = []
    try:
        while not rt.done:
            payloads = rt.begin_round()
            served.append(rt.plan(rt.round) if n_workers is None else rt.groups(rt.round))
            uploads = []
            for i, k in enumerate(rt.routing()):
                up = wire(workers[i + 1].handle(wire(payloads[k])))
                uploads.append(tamper(rt.round, i + 1, up) if tamper else up)
            rt.finish_round(uploads)
    except Exception as exc:
        raise rt.fail(exc) from exc
    return rt.result(), rt, served


def rows(run_dir):
    return [json.loads(x) for x in (run_dir / "metrics.jsonl").read_text().splitlines()]


FEDSEAL = [
    "ssfl_args.algorithm=fedseal",
    "data_args.num_server_val=50",
    "ssfl_args.bootstrap_steps=5",
    "ssfl_args.server_steps=2",
    "train_args.client_num_per_round=2",
    "train_args.comm_round=4",
    "tracking_args.checkpoint_every=2",
    "device_args.num_threads=1",
]


def test_protocol_matches_local_and_client_state_follows_the_silo(small_config, tmp_path):
    # K=4, C_k=2: two workers serve four silos; FedSEAL keeps a per-client ensemble (state).
    cfg = small_config(*FEDSEAL)
    local = run_local(cfg, run_dir=tmp_path / "local")
    fed, rt, served = run_protocol(cfg, tmp_path / "fed")
    a = load_checkpoint(local.run_dir / "checkpoints" / "last.pt")
    b = load_checkpoint(fed.run_dir / "checkpoints" / "last.pt")
    for k, v in a["algorithm"]["global_state"].items():
        assert torch.equal(v, b["algorithm"]["global_state"][k]), k
    assert [r["test_acc"] for r in rows(local.run_dir)] == [r["test_acc"] for r in rows(fed.run_dir)]
    assert [r["bytes_up"] for r in rows(local.run_dir)] == [r["bytes_up"] for r in rows(fed.run_dir)]
    # every silo's state in the checkpoint equals the local runtime's, key by key
    for k, st in a["client_states"].items():
        assert st.keys() == b["client_states"][k].keys(), k
        for name, v in st.items():
            assert torch.equal(torch.as_tensor(v), torch.as_tensor(b["client_states"][k][name])), (k, name)
    # Algorithm 1 step 2: every client, sampled or not, folded every round's model into its ensemble
    for states in (a["client_states"], b["client_states"]):
        assert {k: s.get("ensemble_count") for k, s in states.items()} == {k: 4 for k in range(4)}
    # ... and the server counted K = 4 messages a round down (a model and the thresholds each), not C_k = 2
    for a_row, b_row in zip(rows(local.run_dir), rows(fed.run_dir)):
        assert a_row["bytes_down"] == b_row["bytes_down"] > 1.9 * b_row["bytes_up"] > 0
    # some silo was served by two different workers, so its state really moved with it
    where: dict[int, set[int]] = {}
    for plan in served:
        for i, k in enumerate(plan):
            where.setdefault(k, set()).add(i + 1)
    assert any(len(ws) > 1 for ws in where.values()), served
    fed_rows = rows(fed.run_dir)
    assert sum(r["state_bytes_down"] for r in fed_rows) > 0 and sum(r["state_bytes_up"] for r in fed_rows) > 0
    assert json.loads((fed.run_dir / "summary.json").read_text())["runtime"] == "fedml-MPI"


@pytest.mark.parametrize("extra", [FEDSEAL, ["ssfl_args.algorithm=fedmatch", "train_args.client_num_per_round=2"]])
def test_the_idle_client_control_is_the_same_in_both_runtimes(small_config, tmp_path, extra):
    """``train_args.idle_clients``: the workers send back what they received (the base class decides, in
    the worker process), so the pooled FedML runtime ends with the simulator's model, traffic and states."""
    cfg = small_config(*extra, "train_args.comm_round=3", "train_args.idle_clients=true")
    local = run_local(cfg, run_dir=tmp_path / "local")
    fed, _, _ = run_protocol(cfg, tmp_path / "fed")
    a = load_checkpoint(local.run_dir / "checkpoints" / "last.pt")
    b = load_checkpoint(fed.run_dir / "checkpoints" / "last.pt")
    for k, v in a["algorithm"]["global_state"].items():
        assert torch.equal(v, b["algorithm"]["global_state"][k]), k
    keys = ("test_acc", "bytes_up", "bytes_down")
    assert [[r[k] for k in keys] for r in rows(local.run_dir)] == [[r[k] for k in keys] for r in rows(fed.run_dir)]
    assert not any("ensemble" in s for s in b["client_states"].values())  # idle: nothing folded, nothing trained


def test_deployed_silos_not_sampled_fold_the_broadcast_like_the_simulator(small_config, tmp_path):
    """FedSEAL's Algorithm 1 step 2 in deployment mode: the server sends every silo the round's model,
    the silos not sampled fold it into their ensembles and stay idle; each silo's state (kept on the
    silo) and the server's model end as the simulator's."""
    from fedml_ssfl.config import load_config
    from fedml_ssfl.experiment import export_deployment
    from fedml_ssfl.runtime.fedml.server import DeployedServerRuntime
    from fedml_ssfl.runtime.fedml.worker import SiloWorker

    sim = small_config(*FEDSEAL, "common_args.run_name=sim")
    local = run_local(sim, run_dir=tmp_path / "local")
    dcfg = load_config(export_deployment(sim, tmp_path / "data"), [f"common_args.output_dir={tmp_path / 'dep'}"])
    exp = build_experiment(dcfg)
    exp.algorithm.setup()
    K = dcfg.train_args.client_num_in_total
    rt = DeployedServerRuntime(dcfg, exp, tmp_path / "dep" / "run", None, K)
    silos = {k: SiloWorker(dcfg, k + 1) for k in range(K)}
    while not rt.done:
        payloads = rt.begin_round()
        rt.finish_round([wire(silos[k].handle(wire(payloads[k]))) for k in range(K)])
    rt.result()
    a = load_checkpoint(local.run_dir / "checkpoints" / "last.pt")
    b = load_checkpoint(tmp_path / "dep" / "run" / "checkpoints" / "last.pt")
    for k, v in a["algorithm"]["global_state"].items():
        assert torch.equal(v, b["algorithm"]["global_state"][k]), k
    for k, state in a["client_states"].items():
        assert state["ensemble_count"] == silos[k].state["ensemble_count"] == 4, k
        assert torch.equal(state["ensemble"], silos[k].state["ensemble"]), k


def test_resume_after_stop_continues_bit_for_bit(small_config, tmp_path):
    cfg = small_config(*FEDSEAL, "train_args.comm_round=3", "tracking_args.checkpoint_every=5")
    full, _, _ = run_protocol(cfg, tmp_path / "full")
    part, rt, _ = run_protocol(cfg, tmp_path / "part", stop_after=2)
    assert part.summary["status"] == "stopped" and part.rounds_completed == 2
    resumed, _, _ = run_protocol(cfg, tmp_path / "part", resume=True)
    a = load_checkpoint(full.run_dir / "checkpoints" / "last.pt")["algorithm"]["global_state"]
    b = load_checkpoint(resumed.run_dir / "checkpoints" / "last.pt")["algorithm"]["global_state"]
    assert all(torch.equal(v, b[k]) for k, v in a.items())
    assert resumed.final_acc == full.final_acc


def test_a_failure_in_a_checkpoint_round_of_pooled_workers_resumes_bit_for_bit(small_config, tmp_path):
    """Simulation mode keeps every silo's state in the server's checkpoint (uploaded at checkpoint rounds):
    a worker failing after its update in a checkpoint round leaves the previous last.pt, which resumes."""
    from fedml_ssfl.runtime.fedml.protocol import Failure

    cfg = small_config(*FEDSEAL, "train_args.comm_round=3", "tracking_args.checkpoint_every=1")
    full, _, _ = run_protocol(cfg, tmp_path / "full")

    def fail_in_round_2(r, rank, up):
        return Failure(r, up.silo, rank, "RuntimeError: injected after the update") if r == 1 and rank == 2 else up

    with pytest.raises(RunFailed, match="failed in round 2: RuntimeError: injected"):
        run_protocol(cfg, tmp_path / "part", tamper=fail_in_round_2)
    assert load_checkpoint(tmp_path / "part" / "checkpoints" / "last.pt")["round"] == 0
    resumed, _, _ = run_protocol(cfg, tmp_path / "part", resume=True)
    a = load_checkpoint(full.run_dir / "checkpoints" / "last.pt")
    b = load_checkpoint(resumed.run_dir / "checkpoints" / "last.pt")
    assert all(torch.equal(v, b["algorithm"]["global_state"][k]) for k, v in a["algorithm"]["global_state"].items())
    assert resumed.final_acc == full.final_acc and [r["round"] for r in rows(resumed.run_dir)] == [1, 2, 3]


def test_malformed_reply_is_refused_and_the_round_goes_on(small_config, tmp_path):
    cfg = small_config("train_args.client_num_per_round=2", "train_args.comm_round=2")

    def poison(r, w, up):
        if r == 0 and w == 1:
            name = next(iter(up.msg.weights))
            up.msg.weights[name] = torch.full_like(up.msg.weights[name], float("nan"))
        if r == 1 and w == 2:
            up.msg.weights["not.a.layer"] = torch.zeros(3)
        return up

    res, rt, _ = run_protocol(cfg, tmp_path / "run", tamper=poison)
    assert res.summary["status"] == "completed" and res.rounds_completed == 2
    r0, r1 = rows(res.run_dir)
    assert r0["refused_replies"] == 1 and r1["refused_replies"] == 1
    assert "rank 1 (silo" in rt.refused[0] and "NaN" in rt.refused[0]
    assert "unknown weight keys: not.a.layer" in rt.refused[1]
    state = load_checkpoint(res.run_dir / "checkpoints" / "last.pt")["algorithm"]["global_state"]
    assert all(torch.isfinite(v).all() for v in state.values() if v.is_floating_point())


def test_client_exception_stops_the_run_naming_rank_and_silo(small_config, tmp_path, monkeypatch):
    from fedml_ssfl.algorithms.fedavg_ssl import FedAvgSSL

    original = FedAvgSSL.client_update

    def broken(self, msg, data, state, ctx):
        if ctx.round_idx == 1 and data.client_id == 2:
            raise ValueError("disk on fire")
        return original(self, msg, data, state, ctx)

    monkeypatch.setattr(FedAvgSSL, "client_update", broken)
    cfg = small_config("train_args.comm_round=3")  # C_k = K = 4: silo k on rank k + 1
    with pytest.raises(RunFailed, match=r"rank 3 \(silo 2\) failed in round 2: ValueError: disk on fire"):
        run_protocol(cfg, tmp_path / "run")
    summary = json.loads((tmp_path / "run" / "summary.json").read_text())
    assert summary["status"] == "failed" and "silo 2" in summary["error"]
    assert load_checkpoint(tmp_path / "run" / "checkpoints" / "last.pt")["round"] == 0


def test_check_reply_names_what_is_wrong():
    shapes = {"w": (2, 3), "b": (2,)}
    good = Message(weights={"w": torch.zeros(2, 3), "b": torch.zeros(2)}, num_samples=3)
    assert check_reply(good, shapes) is None
    assert check_reply(Message(), shapes) is None  # a client with nothing to send
    assert "shape (3, 2)" in check_reply(Message(weights={"w": torch.zeros(3, 2), "b": torch.zeros(2)}), shapes)
    assert "missing weight keys: b" in check_reply(Message(weights={"w": torch.zeros(2, 3)}), shapes)
    assert check_reply(Message(weights={"w": torch.zeros(2, 3)}), shapes, partial_ok=True) is None
    assert "unknown" in check_reply(Message(weights={**good.weights, "x": torch.zeros(1)}), shapes)
    inf = Message(weights={"w": torch.zeros(2, 3), "b": torch.tensor([0.0, float("inf")])})
    assert "non-finite" in check_reply(inf, shapes)
    assert "non-finite" in check_reply(
        Message(weights=dict(good.weights), extras={"t": torch.tensor([float("nan")])}), shapes
    )
    assert "Message" in check_reply({"w": 1}, shapes)
    assert "num_samples" in check_reply(Message(num_samples=-1), shapes)


def test_assign_silos_keeps_silos_on_their_state_holder():
    assert assign_silos([0, 1, 2], {}, 3) == [0, 1, 2]
    assert assign_silos([1, 3, 5], {5: 1, 3: 3}, 3) == [5, 1, 3]
    assert assign_silos([2, 4], {2: 1, 4: 1}, 2) == [2, 4]  # both on worker 1: one must move
    with pytest.raises(ValueError):
        assign_silos([1], {}, 2)


def test_wire_encoding_is_exact_and_compact():
    x = {
        "m": Message(
            weights={"a": torch.randn(5, 4), "i": torch.arange(3)}, extras={"t": [torch.ones(2)]}, num_samples=4
        ),
        "s": torch.randn(4, 4).to_sparse(),
        "h": torch.zeros(2, dtype=torch.bfloat16),
    }
    y = wire(x)
    assert torch.equal(x["m"].weights["a"], y["m"].weights["a"]) and y["m"].weights["i"].dtype == torch.int64
    assert torch.equal(x["m"].extras["t"][0], y["m"].extras["t"][0]) and y["m"].num_samples == 4
    assert torch.equal(x["s"].to_dense(), y["s"].to_dense()) and y["h"].dtype == torch.bfloat16
    # BatchNorm's counter is a 0-d tensor: it keeps its shape (a reply with shape (1,) is refused)
    counter = wire({"n": torch.tensor(7), "t": torch.randn(3, 4).t()})
    assert counter["n"].shape == () and int(counter["n"]) == 7 and counter["t"].shape == (4, 3)
    big = {f"p{i}": torch.randn(256, 256) for i in range(8)}
    raw = sum(t.numel() * 4 for t in big.values())
    assert len(codec.dumps(encode(big))) < raw * 1.001


def test_deployment_files_are_checked(tmp_path):
    gm = tmp_path / "gpu.yaml"
    gm.write_text("two_nodes:\n  host1: [2, 1]\n  host2: [0, 1]\n")
    assert [gpu_for_rank(gm, "two_nodes", r, 4) for r in range(4)] == [0, 0, 1, 1]
    with pytest.raises(ConfigError, match="places 4 processes, but the job has C_k \\+ 1 = 3"):
        gpu_for_rank(gm, "two_nodes", 0, 3)
    with pytest.raises(ConfigError, match="'other' is not in"):
        gpu_for_rank(gm, "other", 0, 4)
    ip = tmp_path / "ip.csv"
    ip.write_text("eid,rank,grpc_server_ip,grpc_server_port\n0,0,127.0.0.1,9000\n1,1,127.0.0.1,9001\n")
    assert read_ipconfig(ip) == {0: ("127.0.0.1", 9000), 1: ("127.0.0.1", 9001)}


def test_grpc_rank_role_and_ipconfig_errors(small_config, tmp_path):
    ip = tmp_path / "ip.csv"
    ip.write_text("eid,rank,grpc_server_ip,grpc_server_port\n0,0,127.0.0.1,9000\n1,1,127.0.0.1,9001\n")
    cfg = small_config(
        "common_args.training_type=cross_silo",
        "comm_args.backend=GRPC",
        f"comm_args.grpc_ipconfig_path={ip}",
        "train_args.client_num_per_round=2",
    )
    with pytest.raises(ConfigError, match="pass --rank N"):
        grpc_rank(cfg, None, None)
    with pytest.raises(ConfigError, match="rank 0 is the server"):
        grpc_rank(cfg, 1, "server")
    with pytest.raises(ConfigError, match=r"lists ranks \[0, 1\].*C_k \+ 1 = 3: ranks 0..2"):
        grpc_rank(cfg, 0, "server")


def test_grpc_rank_and_ports_from_the_launch_platform(small_config, tmp_path, monkeypatch):
    from fedml_ssfl.runtime.fedml.launch import GRPC_BASE_PORT, run_port

    ip = tmp_path / "ip.csv"
    ip.write_text("eid,rank,grpc_server_ip\n0,0,10.0.0.1\n1,1,10.0.0.2\n2,2,10.0.0.3\n")
    # no port column: every process derives the same table from the run id; another run id, other ports
    a, b = read_ipconfig(ip, "run-a"), read_ipconfig(ip, "run-b")
    assert [p for _, p in a.values()] == [run_port("run-a", r, 3) for r in range(3)]
    assert len({p for _, p in a.values()}) == 3 and {p for _, p in a.values()}.isdisjoint(p for _, p in b.values())
    assert read_ipconfig(ip)[2] == ("10.0.0.3", GRPC_BASE_PORT + 2)  # no run id: FedML's base + rank
    bad = tmp_path / "bad.csv"
    bad.write_text("eid,rank,grpc_server_ip,grpc_server_port\n0,0,10.0.0.1,70000\n")
    with pytest.raises(ConfigError, match="rank 0's grpc_server_port 70000 is not a TCP port; use 1..65535"):
        read_ipconfig(bad)
    cfg = small_config(
        "common_args.training_type=cross_silo",
        "comm_args.backend=GRPC",
        f"comm_args.grpc_ipconfig_path={ip}",
        "train_args.client_num_per_round=2",
    )
    monkeypatch.delenv("FEDML_CLIENT_RANK", raising=False)
    assert grpc_rank(cfg, None, "server")[0] == 0
    monkeypatch.setenv("FEDML_CLIENT_RANK", "2")
    assert grpc_rank(cfg, None, None)[0] == 2
    assert grpc_rank(cfg, 1, "client")[0] == 1  # an explicit --rank wins
    monkeypatch.setenv("FEDML_CLIENT_RANK", "two")
    with pytest.raises(ConfigError, match="FEDML_CLIENT_RANK='two': expected a whole number >= 0"):
        grpc_rank(cfg, None, None)


def test_offline_guard_refuses_and_records_outside_connections(tmp_path, monkeypatch):
    record = tmp_path / "net.log"
    monkeypatch.setenv(offline.RECORD_ENV, str(record))
    monkeypatch.delenv(offline.ALLOW_ENV, raising=False)
    assert offline.install(["10.1.2.3"])
    try:
        with socket.socket() as s, pytest.raises(offline.OfflineViolation):
            s.connect(("8.8.8.8", 53))
        with pytest.raises(socket.gaierror):
            socket.getaddrinfo("open.fedml.ai", 443)
        with socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as u, pytest.raises(offline.OfflineViolation):
            u.sendto(b"x", ("129.6.15.28", 123))
        with socket.socket() as srv:  # loopback is fine
            srv.bind(("127.0.0.1", 0))
            srv.listen(1)
            with socket.create_connection(srv.getsockname(), timeout=2):
                pass
        assert socket.getaddrinfo("localhost", 80)
    finally:
        offline.uninstall()
    text = record.read_text()
    assert "8.8.8.8" in text and "open.fedml.ai" in text and "129.6.15.28" in text
    assert not offline.installed()


def test_importing_the_backend_does_not_import_fedml():
    code = (
        "import sys, fedml_ssfl.runtime.fedml.run, fedml_ssfl.runtime.offline;"
        "bad=[m for m in ('fedml','mpi4py','grpc') if m in sys.modules]; print(bad); sys.exit(1 if bad else 0)"
    )
    res = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert res.returncode == 0, res.stdout + res.stderr


def test_a_rank_whose_address_is_not_this_machines_is_refused_naming_the_row():
    from fedml_ssfl.config import ConfigError
    from fedml_ssfl.runtime.fedml.launch import check_port_free

    with pytest.raises(ConfigError, match=r"rank 2: this machine has no address 203\.0\.113\.9 .*fix the row"):
        check_port_free(2, "203.0.113.9", 8892)


def test_a_port_something_listens_on_is_refused_before_anything_starts():
    import socket

    from fedml_ssfl.config import ConfigError
    from fedml_ssfl.runtime.fedml.launch import check_port_free

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        s.listen()
        port = s.getsockname()[1]
        with pytest.raises(ConfigError, match=rf"rank 1: cannot listen on 127\.0\.0\.1:{port} \(its port is in use"):
            check_port_free(1, "127.0.0.1", port)
    check_port_free(1, "127.0.0.1", port)  # free again
