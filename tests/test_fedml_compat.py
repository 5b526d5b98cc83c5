"""FedML's own fedml_config.yaml and launch flags: aliases, ignored keys (one warning each), refusals."""

from __future__ import annotations

import logging
import math
from pathlib import Path

import pytest
import yaml

from fedml_ssfl import fedml_compat
from fedml_ssfl.cli import build_parser, main
from fedml_ssfl.config import ConfigError, load_config, validate

# FedML 0.9.6's cross-silo template, verbatim except the backend (MQTT_S3 needs FedML's cloud):
# fedml/computing/scheduler/build-package/mlops-core/fedml-client/client-package/fedml/config/fedml_config.yaml
FEDML_CROSS_SILO = """
common_args:
  training_type: "cross_silo"
  using_mlops: false
  random_seed: 0

environment_args:
  bootstrap: config/bootstrap.sh

data_args:
  dataset: "mnist"
  data_cache_dir: "../../../../data/mnist"
  partition_method: "hetero"
  partition_alpha: 0.5

model_args:
  model: "lr"
  model_file_cache_folder: "./model_file_cache" # will be filled by the server automatically
  global_model_file_path: "./model_file_cache/global_model.pt"

train_args:
  federated_optimizer: "FedAvg"
  client_id_list:
  client_num_in_total: 2
  client_num_per_round: 2
  comm_round: 50
  epochs: 1
  batch_size: 10
  client_optimizer: sgd
  learning_rate: 0.03
  weight_decay: 0.001

validation_args:
  frequency_of_the_test: 5

device_args:
  worker_num: 2
  using_gpu: false
  gpu_mapping_file: config/gpu_mapping.yaml
  gpu_mapping_key: mapping_default

comm_args:
  backend: "BACKEND"
  mqtt_config_path: config/mqtt_config.yaml
  s3_config_path: config/s3_config.yaml

tracking_args:
   # When running on MLOps platform(open.fedml.ai), the default log path is at ~/.fedml/fedml-client/fedml/logs/ and ~/.fedml/fedml-server/fedml/logs/
  enable_wandb: false
  wandb_key: ee0b5f53d949c84cee7decbe7a629e63fb2f8408
  wandb_project: fedml
  wandb_name: fedml_torch_fedavg_mnist_lr4
"""  # noqa: E501

TEMPLATE_IGNORED = {
    "environment_args",
    "common_args.using_mlops",
    "model_args.model_file_cache_folder",
    "model_args.global_model_file_path",
    "comm_args.mqtt_config_path",
    "comm_args.s3_config_path",
    "tracking_args.wandb_key",
    "tracking_args.wandb_project",
    "tracking_args.wandb_name",
}


def template(backend: str = "MPI") -> dict:
    return yaml.safe_load(FEDML_CROSS_SILO.replace("BACKEND", backend))


def compat_warnings(caplog) -> list[str]:
    return [r.getMessage() for r in caplog.records if r.name == fedml_compat.log.name and r.levelno == logging.WARNING]


def cross_silo(**sections) -> dict:
    raw = {"common_args": {"training_type": "cross_silo"}, "comm_args": {"backend": "MPI"}}
    for name, body in sections.items():
        raw.setdefault(name, {}).update(body)
    return raw


@pytest.mark.parametrize("backend", ["MPI", "GRPC"])
def test_fedml_cross_silo_template_loads_with_one_warning_per_ignored_key(backend, caplog):
    caplog.set_level(logging.INFO)
    cfg = validate(template(backend))
    warnings = compat_warnings(caplog)
    named = {w.split(" is FedML's")[0].removeprefix("section ") for w in warnings}
    assert named == TEMPLATE_IGNORED and len(warnings) == len(TEMPLATE_IGNORED)
    assert all("ignored" in w for w in warnings)
    assert "TensorBoard and metrics.jsonl" in next(w for w in warnings if w.startswith("common_args.using_mlops"))
    assert "common_args.run_name" in next(w for w in warnings if w.startswith("tracking_args.wandb_name"))
    # aliases and shared keys resolved
    assert cfg.common_args.training_type == "cross_silo" and cfg.comm_args.backend == backend
    assert cfg.data_args.partition_method == "dirichlet" and cfg.data_args.partition_alpha == 0.5
    t = cfg.train_args
    assert (t.client_num_in_total, t.client_num_per_round, t.comm_round, t.epochs, t.batch_size) == (2, 2, 50, 1, 10)
    assert (t.learning_rate, t.weight_decay, cfg.validation_args.frequency_of_the_test) == (0.03, 0.001, 5)
    assert not cfg.tracking_args.using_mlops and not cfg.tracking_args.enable_wandb
    assert cfg.device_args.device == "cpu" and cfg.device_args.gpu_mapping_key == "mapping_default"


@pytest.mark.parametrize("backend", ["MQTT_S3", "MQTT_S3_MNN", "MQTT", "TRPC"])
def test_backends_that_need_fedmls_cloud_are_refused_with_the_offline_ones_named(backend):
    with pytest.raises(ConfigError, match=rf"comm_args\.backend: FedML's '{backend}' is not supported.*MPI.*GRPC"):
        validate(template(backend))


def test_translate_is_pure_and_leaves_this_packages_own_configs_alone():
    raw = template()
    before = yaml.safe_dump(raw)
    result = fedml_compat.translate(raw)
    assert yaml.safe_dump(raw) == before  # the input is not changed
    assert result.warnings and "environment_args" not in result.raw
    own = load_config(None).to_dict()
    again = fedml_compat.translate(own)
    assert again.raw == own and not again.warnings and not again.notes


def test_shipped_configs_need_no_translation(caplog):
    caplog.set_level(logging.INFO)
    root = Path(__file__).resolve().parents[1] / "configs"
    for f in sorted(root.rglob("*.yaml")):
        raw = yaml.safe_load(f.read_text())
        result = fedml_compat.translate(raw)
        assert result.raw == raw and not result.warnings and not result.notes, f


@pytest.mark.parametrize(
    "ids, k",
    [([11, 12, 13], 3), ("[11, 12, 13, 14]", 4), ("11, 12", 2), (["a", "b"], 2)],
)
def test_client_id_list_gives_k_when_client_num_in_total_is_absent(ids, k):
    cfg = validate(cross_silo(train_args={"client_id_list": ids, "client_num_per_round": 2}))
    assert cfg.train_args.client_num_in_total == k


@pytest.mark.parametrize("ids", [None, "", "[]", []])
def test_an_empty_client_id_list_changes_nothing(ids):
    cfg = validate(cross_silo(train_args={"client_id_list": ids, "client_num_in_total": 5, "client_num_per_round": 2}))
    assert cfg.train_args.client_num_in_total == 5


def test_one_edge_id_is_recorded_not_used_for_k(caplog):
    caplog.set_level(logging.INFO)
    raw = cross_silo(train_args={"client_id_list": "[4711]", "client_num_in_total": 6, "client_num_per_round": 3})
    assert fedml_compat.translate(raw).edge_ids == [4711]
    assert validate(raw).train_args.client_num_in_total == 6
    assert "4711" in caplog.text and not compat_warnings(caplog)


def test_client_id_list_disagreeing_with_client_num_in_total_names_both():
    raw = cross_silo(train_args={"client_id_list": [1, 2, 3], "client_num_in_total": 2})
    with pytest.raises(ConfigError, match=r"train_args\.client_id_list has 3 .*train_args\.client_num_in_total is 2"):
        validate(raw)
    with pytest.raises(ConfigError, match=r"train_args\.client_id_list: expected a list"):
        validate(cross_silo(train_args={"client_id_list": {"a": 1}}))


def test_worker_num_is_client_num_per_round():
    cfg = validate(cross_silo(train_args={"client_num_in_total": 8}, device_args={"worker_num": 3}))
    assert cfg.train_args.client_num_per_round == 3
    same = validate(cross_silo(train_args={"client_num_per_round": 3}, device_args={"worker_num": 3}))
    assert same.train_args.client_num_per_round == 3
    more = r"device_args\.worker_num: 4 is more than train_args\.client_num_per_round \(3\)"
    with pytest.raises(ConfigError, match=more):
        validate(cross_silo(train_args={"client_num_per_round": 3}, device_args={"worker_num": 4}))
    with pytest.raises(ConfigError, match=r"device_args\.worker_num: expected an integer >= 1"):
        validate(cross_silo(device_args={"worker_num": -1}))
    # fewer workers than C_k: each serves several silos a round (FedML's MPI simulation)
    few = validate(cross_silo(train_args={"client_num_per_round": 5}, device_args={"worker_num": 2}))
    assert (few.train_args.client_num_per_round, few.device_args.worker_num) == (5, 2)
    assert few.fingerprint() == validate(cross_silo(train_args={"client_num_per_round": 5})).fingerprint()


def test_epochs_set_the_servers_steps_from_its_own_labels():
    from fedml_ssfl.experiment import resolve_local_steps, train_settings

    cfg = validate({"train_args": {"epochs": 2, "batch_size": 10, "local_steps": 5}})
    assert resolve_local_steps(cfg, 53) == 2 * math.ceil(53 / 10) == 12  # E passes over the server's 53 labels
    assert train_settings(cfg, 53).local_steps == 12 and train_settings(cfg, 53).epochs == 2
    assert resolve_local_steps(validate({"train_args": {"local_steps": 5}}), 53) == 5  # epochs 0: local_steps


def test_epochs_in_a_real_split(small_config):
    from fedml_ssfl.experiment import build_experiment

    exp = build_experiment(small_config("train_args.epochs=1", "train_args.batch_size=50"))
    for k in range(len(exp.split.client_unlabeled)):  # each client its own size (tests/test_local_epochs.py)
        data = exp.client_data(k, 0)
        assert exp.algorithm.client_train(data).local_steps == math.ceil(data.num_unlabeled / 50)


def test_epochs_are_accepted_in_deployment_mode_where_each_silo_knows_its_size():
    files = {"local_data": "s_{silo}.npz", "server_data": "s.npz", "test_data": "t.npz"}
    raw = cross_silo(comm_args={"mode": "deployment"}, train_args={"epochs": 1}, data_args=files)
    assert validate(raw).train_args.epochs == 1
    with pytest.raises(ConfigError, match=r"train_args\.epochs: -1 is out of range"):
        validate({"train_args": {"epochs": -1}})


@pytest.mark.parametrize("fedml, ours", [("hetero", "dirichlet"), ("homo", "iid")])
def test_fedml_partition_names(fedml, ours):
    cfg = validate({"data_args": {"partition_method": fedml, "partition_alpha": 0.3}})
    assert cfg.data_args.partition_method == ours and cfg.data_args.partition_alpha == 0.3


def test_backend_defaults_and_names():
    assert validate({"common_args": {"training_type": "cross_silo"}}).comm_args.backend == "MPI"
    assert validate({"comm_args": {"backend": "sp"}}).comm_args.backend == "local"
    assert validate({}).comm_args.backend == "local"  # a simulation with no backend: unchanged
    cuda = fedml_compat.translate({"device_args": {"using_gpu": True}}).raw
    assert cuda["device_args"]["device"] == "cuda"
    assert validate({"device_args": {"using_gpu": True, "device": "cpu"}}).device_args.device == "cpu"


def test_mlops_and_wandb_switches_are_warned_about_and_stay_off(caplog):
    cfg = validate({"tracking_args": {"using_mlops": True, "enable_wandb": True}, "common_args": {"using_mlops": True}})
    assert not cfg.tracking_args.using_mlops and not cfg.tracking_args.enable_wandb
    warnings = compat_warnings(caplog)
    assert len(warnings) == 3 and all("offline" in w and "TensorBoard" in w for w in warnings)


def test_run_id_is_kept_and_not_fingerprinted():
    cfg = validate(cross_silo(train_args={"run_id": 1234}))
    assert cfg.common_args.run_id == "1234"
    assert cfg.fingerprint() == validate(cross_silo()).fingerprint()
    with pytest.raises(ConfigError, match=r"train_args\.run_id .* common_args\.run_id"):
        validate(cross_silo(train_args={"run_id": "1"}, common_args={"run_id": "2"}))


@pytest.mark.parametrize(
    "raw, pattern",
    [
        ({"train_args": {"epoch": 1}}, r"unknown key 'train_args\.epoch'.*did you mean 'epochs'"),
        ({"tracking_args": {"wandb_projct": "x"}}, r"unknown key 'tracking_args\.wandb_projct'"),
        ({"device_args": {"worker_nun": 2}}, r"unknown key 'device_args\.worker_nun'"),
        ({"environment_argz": {}}, r"unknown section 'environment_argz'"),
        ({"comm_args": {"backend": "mpi"}}, r"comm_args\.backend: 'mpi' is not allowed"),
    ],
)
def test_keys_that_are_neither_ours_nor_fedmls_are_still_refused(raw, pattern):
    with pytest.raises(ConfigError, match=pattern):
        validate(raw)


def test_parser_takes_fedmls_launch_flags():
    args = build_parser().parse_args(
        ["run", "--yaml_config_file", "c.yaml", "--run_id", "7", "--rank", "1", "--local_rank", "0", "--node_rank", "0"]
        + ["--role", "client", "--run_device_id", "42", "--using_mlops", "False"]
    )
    assert (args.cf, args.run_id, args.rank, args.role, args.run_device_id) == ("c.yaml", "7", 1, "client", "42")
    assert args.using_mlops is False and build_parser().parse_args(["run", "--using_mlops"]).using_mlops is True
    with pytest.raises(SystemExit):
        build_parser().parse_args(["run", "--run_idd", "7"])  # unknown flags are still errors


def test_fedml_style_launch_of_fedmls_template(tmp_path, capsys, caplog):
    path = tmp_path / "fedml_config.yaml"
    path.write_text(FEDML_CROSS_SILO.replace("BACKEND", "GRPC"))
    argv = ["run", "--print-config", "--cf", str(path), "--run_id", "7", "--local_rank", "0", "--node_rank", "0"]
    argv += ["--rank", "0", "--role", "server", "--run_device_id", "42", "--using_mlops", "True"]
    assert main(argv) == 0
    resolved = yaml.safe_load(capsys.readouterr().out)
    assert resolved["common_args"]["run_id"] == "7" and resolved["comm_args"]["backend"] == "GRPC"
    assert resolved["train_args"]["epochs"] == 1 and resolved["data_args"]["partition_method"] == "dirichlet"
    assert "--using_mlops true is ignored" in caplog.text
    assert len(compat_warnings(caplog)) == len(TEMPLATE_IGNORED)
    assert main(["run", "--print-config", "--cf", str(path).replace("fedml_config", "nope")]) == 2


# Configs of our own in the layout of FedML's repository examples (python/examples/federate/): the MPI
# simulation (simulation/mpi_torch_fedavg_mnist_lr_example/config/fedml_config.yaml, with the FedOpt
# keys of FedML's other MPI simulation configs) and the GRPC cross-silo step-by-step example
# (cross_silo/grpc_fedavg_mnist_lr_example/step_by_step/config/fedml_config.yaml). Same sections and
# keys; values chosen for this package's shipped data.
FEDML_MPI_SIMULATION = """
common_args:
  training_type: "simulation"
  random_seed: 0
data_args:
  dataset: "digits"
  data_cache_dir: ~/.cache/fedml_data
  partition_method: "hetero"
  partition_alpha: 0.5
model_args:
  model: "lr"
train_args:
  federated_optimizer: "FedOpt"
  client_id_list: "[]"
  client_num_in_total: 10
  client_num_per_round: 4
  comm_round: 3
  epochs: 1
  batch_size: 10
  client_optimizer: sgd
  learning_rate: 0.03
  weight_decay: 0.001
  server_optimizer: sgd
  server_lr: 1.0
  server_momentum: 0.9
validation_args:
  frequency_of_the_test: 5
device_args:
  worker_num: 4
  using_gpu: false
  gpu_mapping_file: config/gpu_mapping.yaml
  gpu_mapping_key: mapping_config1_5
comm_args:
  backend: "MPI"
  is_mobile: 0
tracking_args:
  enable_wandb: false
  wandb_key: ee0b5f53d949c84cee7decbe7a629e63fb2f8408
  wandb_project: fedml
  wandb_name: fedml_torch_fedavg_mnist_lr
  using_mlops: false
attack_args:
  enable_attack: false
  attack_type: None
defense_args:
  enable_defense: false
  defense_type: norm_diff_clipping
  norm_bound: 5.0
"""

FEDML_GRPC_CROSS_SILO = """
common_args:
  training_type: "cross_silo"
  scenario: "horizontal"
  using_mlops: false
  random_seed: 0
environment_args:
  bootstrap: config/bootstrap.sh
data_args:
  dataset: "digits"
  data_cache_dir: "../../../../data/mnist"
  partition_method: "hetero"
  partition_alpha: 0.5
model_args:
  model: "lr"
  model_file_cache_folder: "./model_file_cache"
  global_model_file_path: "./model_file_cache/global_model.pt"
train_args:
  federated_optimizer: "FedAvg"
  client_id_list:
  client_num_in_total: 1000
  client_num_per_round: 2
  comm_round: 50
  epochs: 1
  batch_size: 10
  client_optimizer: sgd
  learning_rate: 0.03
  weight_decay: 0.001
validation_args:
  frequency_of_the_test: 5
device_args:
  worker_num: 2
  using_gpu: false
  gpu_mapping_file: config/gpu_mapping.yaml
  gpu_mapping_key: mapping_default
comm_args:
  backend: "GRPC"
  grpc_ipconfig_path: config/grpc_ipconfig.csv
tracking_args:
  local_log_output_path: ./log
  enable_wandb: false
  wandb_key: ee0b5f53d949c84cee7decbe7a619e63fb1f8408
  wandb_project: fedml
  wandb_name: fedml_torch_fedavg_mnist_lr
"""

WORKS = {  # FedML's key -> where its value lands here (an alias's target, or the same key)
    "device_args.worker_num": "train_args.client_num_per_round",
    "data_args.partition_method": None,  # hetero -> dirichlet (checked below)
    "train_args.client_id_list": None,  # empty: nothing to do
    "common_args.training_type": None,  # checked below (simulation + MPI -> cross_silo)
}


def _each_key_works_or_is_named(raw: dict, cfg, warnings: list[str]) -> None:
    """Every key of ``raw``: named in exactly one warning, or its value is in ``cfg`` (under its alias)."""
    for section, body in raw.items():
        named = [w for w in warnings if w.startswith(f"section {section} ")]
        if named:
            assert len(named) == 1, (section, named)
            continue
        for key, value in body.items():
            dotted = f"{section}.{key}"
            said = [w for w in warnings if w.startswith((f"{dotted} ", f"{dotted}:"))]
            if said:
                assert len(said) == 1, (dotted, said)
                continue
            target = WORKS.get(dotted, dotted)
            if target is None:
                continue
            where, name = target.split(".")
            got = getattr(getattr(cfg, where), name)
            assert got == value or str(got) == str(value), (dotted, value, got)


def test_fedmls_mpi_simulation_layout_runs_as_the_fedml_runtimes_simulation_mode(caplog):
    from fedml_ssfl.runtime.fedml.launch import world_size

    caplog.set_level(logging.INFO)
    raw = yaml.safe_load(FEDML_MPI_SIMULATION)
    cfg = validate(raw)
    warned = compat_warnings(caplog)
    named = {w.split(" ")[0].rstrip(":") if not w.startswith("section") else w.split(" ")[1] for w in warned}
    assert named == {
        "train_args.federated_optimizer",
        "train_args.server_optimizer",
        "train_args.server_lr",
        "train_args.server_momentum",
        "comm_args.is_mobile",
        "tracking_args.wandb_key",
        "tracking_args.wandb_project",
        "tracking_args.wandb_name",
        "attack_args",
        "defense_args",
    } and len(warned) == len(named)
    assert "ssfl_args.algorithm (fedavg_ssl, the default) trains and aggregates" in caplog.text  # not FedOpt
    # FedML's MPI simulation: the FedML runtime's simulation mode, worker_num + 1 processes
    assert (cfg.common_args.training_type, cfg.comm_args.backend, cfg.comm_args.mode) == (
        "cross_silo",
        "MPI",
        "simulation",
    )
    assert world_size(cfg) == 5 and cfg.train_args.client_num_per_round == 4
    assert (cfg.model_args.model, cfg.model_args.norm) == ("lr", "none")  # FedML's logistic regression
    assert cfg.data_args.partition_method == "dirichlet" and cfg.train_args.federated_optimizer == "FedAvg"
    _each_key_works_or_is_named(raw, cfg, warned)
    raw["attack_args"]["enable_attack"] = True
    with pytest.raises(ConfigError, match=r"attack_args\.enable_attack: true asks for FedML's attack simulation"):
        validate(raw)
    raw = yaml.safe_load(FEDML_MPI_SIMULATION)
    raw["comm_args"]["mode"] = "deployment"
    with pytest.raises(ConfigError, match=r"training_type simulation .* does not go with comm_args\.mode"):
        validate(raw)


def test_fedmls_grpc_step_by_step_layout_loads_with_each_unused_key_named(caplog):
    caplog.set_level(logging.INFO)
    raw = yaml.safe_load(FEDML_GRPC_CROSS_SILO)
    cfg = validate(raw)
    warned = compat_warnings(caplog)
    assert sum(w.startswith("tracking_args.local_log_output_path is FedML's and is ignored") for w in warned) == 1
    assert (cfg.comm_args.backend, cfg.comm_args.mode, cfg.train_args.client_num_per_round) == ("GRPC", "simulation", 2)
    _each_key_works_or_is_named(raw, cfg, warned)
    # in deployment mode FedML's worker_num counts one process per silo: K
    raw["comm_args"]["mode"], raw["device_args"]["worker_num"] = "deployment", 1000
    raw["data_args"].update(local_data="s_{silo}.npz", server_data="s.npz", test_data="t.npz")
    raw["train_args"]["epochs"] = 0
    assert validate(raw).train_args.client_num_in_total == 1000
    raw["device_args"]["worker_num"] = 2
    with pytest.raises(
        ConfigError, match=r"device_args\.worker_num \(2\) and train_args\.client_num_in_total \(1000\)"
    ):
        validate(raw)
