"""Deployed silos' states as the first phase of a two-phase checkpoint, in one process (no FedML, no MPI).

The server half (:class:`DeployedServerRuntime`) and K :class:`SiloWorker` objects talk through the wire
codec exactly as over MPI / GRPC, on real files: a run that fails at any point of a checkpoint round
(a server killed after the silos saved, a silo that fails after it saved) resumes to the simulator's
model, with the silos restarted or still running (a server restarted alone: its ``Intro`` makes them
reload); a state that is not on disk is refused by name; each silo keeps two states; a second process
for one silo's folder is refused. tests/test_fedml_deployment.py runs the same failure under mpirun.
"""

from __future__ import annotations

import json
import os

import pytest
import torch

from fedml_ssfl.checkpoint import load_checkpoint
from fedml_ssfl.config import load_config
from fedml_ssfl.experiment import build_experiment, export_deployment
from fedml_ssfl.runtime.common import RunFailed
from fedml_ssfl.runtime.fedml import wire as codec
from fedml_ssfl.runtime.fedml.launch import check_server_counts, worker_count
from fedml_ssfl.runtime.fedml.payloads import decode, encode
from fedml_ssfl.runtime.fedml.protocol import Failure, Intro, Task
from fedml_ssfl.runtime.fedml.server import DeployedServerRuntime
from fedml_ssfl.runtime.fedml.worker import SiloWorker, saved_rounds, silo_dir, silo_state_path
from fedml_ssfl.runtime.local import run_local
from tests.conftest import SMALL

SETTINGS = [
    *SMALL,
    "train_args.client_num_in_total=3",
    "train_args.client_num_per_round=2",  # one silo idles every round
    "train_args.comm_round=3",
    "tracking_args.checkpoint_every=1",  # every round is a checkpoint round
    "ssfl_args.algorithm=fedavg_ssl",
    "ssfl_args.threshold=0.5",
    "ssfl_args.bootstrap_steps=30",  # pseudo-labels from round 0: the silos' momentum state matters
    "device_args.num_threads=1",
]


class Killed(BaseException):
    """A process killed at that point: nothing after it runs, not even the runtime's failure path."""


@pytest.fixture(scope="module")
def setup(tmp_path_factory):
    tmp = tmp_path_factory.mktemp("silo_checkpoints")
    sim = load_config(None, [*SETTINGS, f"common_args.output_dir={tmp / 'runs'}", "common_args.run_name=sim"])
    config = export_deployment(sim, tmp / "data")
    local = run_local(sim, run_dir=tmp / "local")
    return {"tmp": tmp, "config": config, "local": local}


def deployed_config(setup, name: str):
    return load_config(setup["config"], [f"common_args.run_name={name}", "tracking_args.progress_bar=false"])


def wire(obj):
    """What a payload looks like after crossing MPI / GRPC."""
    return decode(codec.loads(codec.dumps(encode(obj))))


def drive(cfg, silos: dict, resume: bool = False, after_reply=None):
    """One server process (a new one, as after a restart) with the silo workers in ``silos`` (rank -> worker;
    missing ones are started, as new processes). ``after_reply(round, silo, reply)`` may replace a reply."""
    run_dir = cfg.run_dir()
    exp = build_experiment(cfg)
    check_server_counts(cfg, exp)
    exp.algorithm.setup()
    state = load_checkpoint(run_dir / "checkpoints" / "last.pt", cfg.fingerprint()) if resume else None
    run_dir.mkdir(parents=True, exist_ok=True)
    K = worker_count(cfg)
    rt = DeployedServerRuntime(cfg, exp, run_dir, state, K)
    try:
        while not rt.done:
            payloads = rt.begin_round()
            uploads = []
            for k in range(K):
                worker = silos.setdefault(k + 1, SiloWorker(cfg, k + 1))
                up = wire(worker.handle(wire(payloads[k])))
                uploads.append(after_reply(rt.round, k, up) if after_reply else up)
            rt.finish_round(uploads)
    except Exception as exc:
        raise rt.fail(exc) from exc
    return rt.result()


def assert_ends_with_the_simulators_model(setup, cfg) -> None:
    local = setup["local"]
    a = load_checkpoint(local.run_dir / "checkpoints" / "last.pt")
    b = load_checkpoint(cfg.run_dir() / "checkpoints" / "last.pt")
    for name, v in a["algorithm"]["global_state"].items():
        assert float((v - b["algorithm"]["global_state"][name]).abs().max()) < 1e-5, name
    rows = [json.loads(x) for x in (cfg.run_dir() / "metrics.jsonl").read_text().splitlines()]
    sim_rows = [json.loads(x) for x in (local.run_dir / "metrics.jsonl").read_text().splitlines()]
    assert [r["round"] for r in rows] == [1, 2, 3]
    assert [r["test_acc"] for r in rows] == [r["test_acc"] for r in sim_rows]
    for silo, state in a["client_states"].items():  # each silo's saved state is the simulator's
        saved = load_checkpoint(silo_state_path(silo_dir(cfg, cfg.run_dir().name, silo) / "checkpoints", 2))
        assert saved["round"] == 2 and state.keys() == saved["state"].keys()
        for key, t in state.get("momentum", {}).items():
            assert torch.allclose(t, saved["state"]["momentum"][key], atol=1e-6), (silo, key)


def kill_server_before_it_commits(monkeypatch, round_idx: int) -> None:
    """The server process dies writing ``last.pt`` of round ``round_idx``: every silo has saved that round."""
    import fedml_ssfl.runtime.common as common

    real = common.save_checkpoint

    def save_checkpoint(path, payload):
        if path.name == "last.pt" and payload["round"] == round_idx:
            raise Killed
        return real(path, payload)

    monkeypatch.setattr(common, "save_checkpoint", save_checkpoint)


@pytest.mark.parametrize("silos_restart", [False, True], ids=["server-restarted-alone", "all-restarted"])
def test_a_server_killed_in_a_checkpoint_round_resumes_to_the_simulators_model(setup, monkeypatch, silos_restart):
    cfg = deployed_config(setup, f"killed-{silos_restart}")
    silos: dict = {}
    kill_server_before_it_commits(monkeypatch, 1)
    with pytest.raises(Killed):
        drive(cfg, silos)
    monkeypatch.undo()
    assert load_checkpoint(cfg.run_dir() / "checkpoints" / "last.pt")["round"] == 0  # round 2 never committed
    for k in range(3):  # every silo saved round 2 already, and kept round 1, the one the server committed
        assert sorted(saved_rounds(silo_dir(cfg, cfg.run_dir().name, k) / "checkpoints")) == [0, 1]
    if silos_restart:
        for worker in silos.values():
            worker.lock.release()  # as the OS does when a process dies
        silos = {}
    drive(cfg, silos, resume=True)  # a live silo reloads round 1's state on the new server's Intro
    assert_ends_with_the_simulators_model(setup, cfg)
    for k in range(3):  # the last two states stay
        assert sorted(saved_rounds(silo_dir(cfg, cfg.run_dir().name, k) / "checkpoints")) == [1, 2]


def test_a_silo_that_fails_after_saving_its_state_resumes_to_the_simulators_model(setup):
    cfg = deployed_config(setup, "silo-failed")

    def fail_after_saving(r, silo, up):
        if r == 1 and silo == 2:
            return Failure(r, silo, silo + 1, "RuntimeError: injected after the state was saved")
        return up

    silos: dict = {}
    with pytest.raises(RunFailed, match="rank 3 \\(silo 2\\) failed in round 2: RuntimeError: injected"):
        drive(cfg, silos, after_reply=fail_after_saving)
    for worker in silos.values():
        worker.lock.release()  # as the OS does when a process dies
    drive(cfg, {}, resume=True)
    assert_ends_with_the_simulators_model(setup, cfg)


def test_a_state_that_is_not_on_disk_is_refused_naming_the_file_and_the_fix(setup, tmp_path):
    cfg = deployed_config(setup, "missing")
    silos: dict = {}
    with pytest.raises(RunFailed):
        drive(cfg, silos, after_reply=lambda r, k, up: Failure(r, k, k + 1, "stop") if r == 2 else up)
    for w in silos.values():
        w.lock.release()
    folder = silo_dir(cfg, cfg.run_dir().name, 1) / "checkpoints"
    assert sorted(saved_rounds(folder)) == [1, 2]  # the run stopped in round 3, committed round 2
    silo_state_path(folder, 1).unlink()  # round 2's state of silo 1 is lost
    worker = SiloWorker(cfg, 2)
    task = Task(2, 1, 2, train=False, intro=Intro(_meta(cfg), cfg.run_dir().name, 1))
    reply = worker.handle(task)
    assert isinstance(reply, Failure)
    assert f"no state saved after round 2 at {silo_state_path(folder, 1)} (rounds saved here: 3)" in reply.error
    assert "restore this silo's folder" in reply.error and "\n" not in reply.error
    assert sorted(saved_rounds(folder)) == [2]  # nothing of the refused round's was touched


def test_an_intro_resets_or_reloads_a_running_silo_and_drops_rounds_never_committed(setup):
    cfg = deployed_config(setup, "intro")
    silos: dict = {}
    drive(cfg, silos)
    worker = silos[1]
    folder = silo_dir(cfg, cfg.run_dir().name, 0) / "checkpoints"
    after_2 = load_checkpoint(silo_state_path(folder, 1))["state"]
    assert worker.state and sorted(saved_rounds(folder)) == [1, 2]
    assert not isinstance(
        worker.handle(Task(2, 0, 1, train=False, intro=Intro(_meta(cfg), cfg.run_dir().name, 1))), Failure
    )
    assert set(worker.state) == set(after_2)
    for key, t in after_2.get("momentum", {}).items():
        assert torch.equal(worker.state["momentum"][key], t)
    assert sorted(saved_rounds(folder)) == [1]  # round 3's state: the server never committed it in this timeline
    reply = worker.handle(Task(0, 0, 1, train=False, intro=Intro(_meta(cfg), cfg.run_dir().name, -1)))
    assert not isinstance(reply, Failure) and worker.state == {} and saved_rounds(folder) == {}


def test_a_second_process_for_one_silos_folder_is_refused_naming_the_holder(setup):
    cfg = deployed_config(setup, "two-silos")
    first, second = SiloWorker(cfg, 1), SiloWorker(cfg, 1)
    intro = Intro(_meta(cfg), cfg.run_dir().name, -1)
    assert not isinstance(first.handle(Task(0, 0, 1, train=False, intro=intro)), Failure)
    reply = second.handle(Task(0, 0, 1, train=False, intro=intro))
    assert isinstance(reply, Failure)
    home = silo_dir(cfg, cfg.run_dir().name, 0)
    assert f"silo 0's folder {home} is in use by another process (pid {os.getpid()}" in reply.error, reply.error
    first.lock.release()
    assert not isinstance(second.handle(Task(0, 0, 1, train=False, intro=intro)), Failure)


def _meta(cfg):
    from fedml_ssfl.data.silos import SiloMeta

    return SiloMeta.of(build_experiment(cfg).dataset)
