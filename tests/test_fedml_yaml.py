"""FedML's own example YAMLs, as FedML ships them (tests/fedml_examples/configs/, each naming its origin):
each loads or is refused naming the key; all of a config's problems are reported in one run; FedML's
MPI simulation with fewer worker processes than silos a round ends with the simulator's model."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest
import torch
import yaml

from fedml_ssfl.checkpoint import load_checkpoint
from fedml_ssfl.cli import main
from fedml_ssfl.config import ConfigError, load_config, validate
from fedml_ssfl.runtime.fedml.server import assign_groups
from fedml_ssfl.runtime.local import run_local

ROOT = Path(__file__).resolve().parents[1]
EXAMPLES = ROOT / "tests" / "fedml_examples" / "configs"
CLI = [sys.executable, "-m", "fedml_ssfl"]

# file -> (the --set a user must add, None if it loads, else the keys its refusal names, one line each)
CASES = {
    "cross_silo_mpi_fedavg_mnist_lr.yaml": ([], None),  # training_type simulation + MPI: the runtime's simulation
    "cross_silo_grpc_step_by_step.yaml": ([], None),
    "quick_start_parrot.yaml": ([], None),  # tracking_args.mlops_api_key: ignored in any section
    "simulation_mpi_fedprox_mnist_lr.yaml": ([], None),  # train_args.lr next to learning_rate: ignored
    "simulation_sp_fedavg_mnist_lr.yaml": ([], None),
    # worker_num 4 < C_k 20: four processes serve five silos each; no GPU here
    "simulation_mpi_fedavg_seq_custom.yaml": (["device_args.device=cpu"], None),
    "simulation_mpi_fedavg_debug.yaml": ([], ["model_args.model", "data_args.dataset"]),
    "simulation_sp_fedavg_cifar10_resnet56.yaml": ([], ["model_args.model"]),
    "simulation_mpi_fedavg_cifar10_mobilenet.yaml": ([], ["device_args.worker_num"]),
    "simulation_mpi_fedavg_dp_mnist_lr.yaml": ([], ["dp_args.enable_dp"]),
    "cross_silo_mqtt_s3_step_by_step.yaml": ([], ["comm_args.backend"]),
    "quick_start_octopus.yaml": ([], ["comm_args.backend"]),
}


def cli(*args: str) -> subprocess.CompletedProcess:
    return subprocess.run([*CLI, *args], capture_output=True, text=True, timeout=120, cwd=ROOT)


def test_every_copied_example_is_listed_and_names_its_origin():
    files = sorted(p.name for p in EXAMPLES.glob("*.yaml"))
    assert files == sorted(CASES)
    for name in files:
        head = (EXAMPLES / name).read_text().splitlines()[:2]
        assert "FedML-AI/FedML, python/examples/" in head[0] and "03e11dfee" in head[1] and "Apache-2.0" in head[1]


@pytest.mark.parametrize("name", sorted(CASES))
def test_fedmls_example_loads_or_is_refused_naming_the_key(name, capsys):
    sets, refused = CASES[name]
    path = EXAMPLES / name
    options = [x for s in sets for x in ("--set", s)]
    if refused is None:  # in-process: the CLI's own validation, names checked
        cfg = load_config(path, sets, check_names=True)
        raw = yaml.safe_load(path.read_text())
        assert cfg.train_args.client_num_per_round == raw["train_args"]["client_num_per_round"]
        assert cfg.train_args.comm_round == raw["train_args"]["comm_round"]
        return
    code = main(["run", "--cf", str(path), "--print-config", *options])  # the command, in this process
    out, err = capsys.readouterr()
    errors = [line for line in err.splitlines() if line.startswith("fedml-ssfl: error: ")]
    assert code == 2 and out == "", err
    assert [line.split("error: ")[1].split(":")[0] for line in errors] == refused, errors


def test_fedmls_keys_count_in_any_section_as_fedml_reads_them():
    raw = yaml.safe_load((EXAMPLES / "quick_start_parrot.yaml").read_text())
    assert "mlops_api_key" in raw["tracking_args"]
    cfg = validate(raw)
    assert cfg.comm_args.backend == "local"
    moved = validate({"data_args": {"batch_size": 7, "learning_rate": 0.5}, "tracking_args": {"wandb_key": "x"}})
    assert (moved.train_args.batch_size, moved.train_args.learning_rate) == (7, 0.5)
    with pytest.raises(ConfigError, match=r"data_args\.batch_size \(7\) and train_args\.batch_size \(8\) disagree"):
        validate({"data_args": {"batch_size": 7}, "train_args": {"batch_size": 8}})
    # FedML's lr: learning_rate where that is not given, ignored next to it (FedML's FedProx example gives both)
    assert validate({"train_args": {"lr": 0.2}}).train_args.learning_rate == 0.2
    fedprox = validate(yaml.safe_load((EXAMPLES / "simulation_mpi_fedprox_mnist_lr.yaml").read_text()))
    assert (fedprox.train_args.learning_rate, fedprox.train_args.weight_decay) == (0.03, 0.001)


def test_a_config_with_three_problems_reports_all_three_in_one_run(tmp_path):
    bad = tmp_path / "bad.yaml"
    bad.write_text(
        "train_args:\n  comm_rounds: 3\n  batch_size: many\n"
        "comm_args:\n  backend: MQTT_S3\n"
        "dp_args:\n  enable_dp: true\n"
    )
    proc = cli("run", "--cf", str(bad), "--set", f"common_args.output_dir={tmp_path / 'runs'}")
    lines = proc.stderr.strip().splitlines()
    assert proc.returncode == 2 and len(lines) == 4, proc.stderr
    assert all(line.startswith("fedml-ssfl: error: ") for line in lines)
    text = proc.stderr
    assert "dp_args.enable_dp" in text and "comm_args.backend: FedML's 'MQTT_S3'" in text
    assert "unknown key 'train_args.comm_rounds'; did you mean 'comm_round'?" in text
    assert "train_args.batch_size: expected an integer, got 'many'" in text
    with pytest.raises(ConfigError) as info:
        validate(yaml.safe_load(bad.read_text()))
    assert len(info.value.problems) == 4
    assert not (tmp_path / "runs").exists()  # nothing started


def test_assign_groups_keeps_silos_on_their_holder_and_balances():
    assert assign_groups([0, 1, 2, 3, 4], {}, 2) == [[0, 1, 2], [3, 4]]
    assert assign_groups([0, 1, 2, 3, 4], {4: 1, 0: 2}, 2) == [[1, 2, 4], [0, 3]]
    assert assign_groups([3, 5], {3: 1, 5: 1}, 1) == [[3, 5]]
    with pytest.raises(ValueError):
        assign_groups([1, 2], {}, 3)


def test_fewer_workers_than_silos_serve_several_each_and_end_with_the_simulators_model(small_config, tmp_path):
    from tests.test_fedml_backend import rows, run_protocol

    cfg = small_config(
        "train_args.client_num_in_total=6",
        "train_args.client_num_per_round=5",
        "train_args.comm_round=3",
        "tracking_args.checkpoint_every=2",
        "device_args.num_threads=1",
    )
    local = run_local(cfg, run_dir=tmp_path / "local")
    fed, _, served = run_protocol(cfg, tmp_path / "fed", n_workers=2)
    assert all(sorted(len(g) for g in groups) == [2, 3] for groups in served)
    a = load_checkpoint(local.run_dir / "checkpoints" / "last.pt")
    b = load_checkpoint(fed.run_dir / "checkpoints" / "last.pt")
    for k, v in a["algorithm"]["global_state"].items():
        assert torch.equal(v, b["algorithm"]["global_state"][k]), k
    assert [r["test_acc"] for r in rows(local.run_dir)] == [r["test_acc"] for r in rows(fed.run_dir)]
    assert json.loads((fed.run_dir / "summary.json").read_text())["workers"] == 2


def test_fedmls_mpi_simulation_example_with_fewer_workers_than_silos_runs_under_mpirun(tmp_path):
    """FedML's FedAvg_seq example (worker_num 4 < client_num_per_round 20), shrunk by --set to two workers for
    five silos a round on tiny data: three processes, ending with the in-process simulator's model."""
    mpi = pytest.importorskip("tests.test_fedml_mpi")
    from fedml_ssfl.runtime.fedml.launch import world_size

    path = EXAMPLES / "simulation_mpi_fedavg_seq_custom.yaml"
    sets = [
        "data_args.dataset=digits",
        "data_args.num_server_labels=50",
        "model_args.model=cnn28",
        "model_args.norm=gn",
        "train_args.client_num_in_total=6",
        "train_args.client_num_per_round=5",
        "device_args.worker_num=2",
        "device_args.device=cpu",
        "device_args.num_threads=1",
        "train_args.comm_round=2",
        "train_args.epochs=0",
        "train_args.local_steps=2",
        "train_args.batch_size=16",
        "common_args.compare_with=[]",
        "common_args.run_name=fedml_seq",
        f"common_args.output_dir={tmp_path / 'runs'}",
        "tracking_args.progress_bar=false",
        "tracking_args.enable_tensorboard=false",
    ]
    cfg = load_config(path, sets)
    assert world_size(cfg) == 3 and cfg.train_args.client_num_per_round == 5
    options = [x for s in sets for x in ("--set", s)]
    proc = mpi.mpirun(3, [str(mpi.CLI), "run", "--cf", str(path), *options])
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    local = run_local(mpi.local_twin(cfg), run_dir=tmp_path / "local")
    a = load_checkpoint(local.run_dir / "checkpoints" / "last.pt")["algorithm"]["global_state"]
    b = load_checkpoint(cfg.run_dir() / "checkpoints" / "last.pt")["algorithm"]["global_state"]
    assert max(float((a[k] - b[k]).abs().max()) for k in a) < 1e-5
    summary = json.loads((cfg.run_dir() / "summary.json").read_text())
    assert summary["status"] == "completed" and summary["workers"] == 2


def test_a_batch_crosses_the_wire_and_a_malformed_one_is_refused():
    from fedml_ssfl.runtime.fedml import protocol
    from tests.test_fedml_backend import wire

    task = protocol.Task(3, 1, 2, more=[protocol.Task(3, 4, 2), protocol.Task(3, 5, 2)])
    back = wire(task)
    assert [t.silo for t in back.more] == [4, 5] and back.more[0].rank == 2
    for bad in (
        [protocol.Reply(3, 4, 1)],  # another rank
        [protocol.Reply(3, 1, 2)],  # the head's silo again
        [protocol.Reply(2, 4, 2)],  # another round
        [protocol.Reply(3, 4, 2, more=[protocol.Reply(3, 5, 2)])],  # nested
    ):
        with pytest.raises(ValueError, match=r"Reply\.more"):
            protocol.build("Reply", protocol.fields_of(protocol.Reply(3, 1, 2, more=bad)))
