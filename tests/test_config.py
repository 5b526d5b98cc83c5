"""Config validation: typos, types, ranges, impossible combinations, overrides, round-trip."""

from __future__ import annotations

from pathlib import Path

import pytest
import yaml

from fedml_ssfl.config import ConfigError, load_config, validate


def test_the_main_job_is_semifl_on_mnist5k_against_server_only():

    from fedml_ssfl.cli import DEFAULT_JOB

    cfg = load_config(DEFAULT_JOB)
    assert cfg.algorithm == "semifl"
    assert cfg.data_args.dataset == "mnist5k" and cfg.data_args.num_server_labels == 50
    assert cfg.train_args.client_num_in_total == 10
    assert cfg.common_args.compare_with == ["server_only"]
    repo_copy = Path(__file__).resolve().parents[1] / "configs" / "mnist5k" / "semifl.yaml"
    assert repo_copy.resolve() == DEFAULT_JOB.resolve()


def test_unknown_key_names_it_and_the_closest_valid_one():
    with pytest.raises(ConfigError, match=r"train_args\.comm_rund.*did you mean 'comm_round'"):
        validate({"train_args": {"comm_rund": 3}})


def test_unknown_section_and_unknown_algorithm_key():
    with pytest.raises(ConfigError, match="unknown section 'trian_args'.*'train_args'"):
        validate({"trian_args": {}})
    with pytest.raises(ConfigError, match=r"ssfl_args\.treshold.*'threshold'"):
        validate({"ssfl_args": {"algorithm": "fedavg_ssl", "treshold": 0.9}})


def test_unknown_algorithm_suggests_closest():
    with pytest.raises(ValueError, match="did you mean 'fedavg_ssl'"):
        validate({"ssfl_args": {"algorithm": "fedavg_sssl"}})


@pytest.mark.parametrize(
    "raw, pattern",
    [
        ({"train_args": {"comm_round": "ten"}}, r"train_args\.comm_round: expected an integer"),
        ({"train_args": {"learning_rate": "fast"}}, r"train_args\.learning_rate: expected a number"),
        ({"tracking_args": {"progress_bar": "yes"}}, r"progress_bar: expected true or false"),
        (
            {"data_args": {"non_iid_r": 1.5}},
            r"data_args\.non_iid_r: 1\.5 is out of range; it must be >= 0\.0 and <= 1\.0",
        ),
        ({"train_args": {"comm_round": 0}}, r"train_args\.comm_round: 0 is out of range"),
        ({"device_args": {"device": "tpu"}}, r"device_args\.device: 'tpu' is not allowed; choose one of cpu, cuda"),
        ({"data_args": {"partition_method": "noniid"}}, r"partition_method.*iid, r, dirichlet, shards"),
    ],
)
def test_wrong_type_or_range_names_key_and_allowed(raw, pattern):
    with pytest.raises(ConfigError, match=pattern):
        validate(raw)


def test_more_clients_per_round_than_clients_is_refused():
    with pytest.raises(ConfigError, match=r"client_num_per_round \(C_k=12\).*client_num_in_total \(K=10\)"):
        validate({"train_args": {"client_num_per_round": 12}})


def test_more_groups_than_clients_per_round_is_refused():
    raw = {"train_args": {"client_num_per_round": 2}, "ssfl_args": {"averaging": "grouping", "num_groups": 3}}
    with pytest.raises(ConfigError, match=r"num_groups \(S=3\).*C_k=2"):
        validate(raw)


def test_label_scenario_the_algorithm_cannot_serve():
    with pytest.raises(ConfigError, match="supports server, not 'client'"):
        validate({"data_args": {"label_scenario": "client"}, "ssfl_args": {"algorithm": "fedavg_ssl"}})


def test_wandb_and_mlops_stay_off(caplog):
    cfg = validate({"tracking_args": {"enable_wandb": True, "using_mlops": True}})  # warned about, not refused
    assert not cfg.tracking_args.enable_wandb and not cfg.tracking_args.using_mlops
    assert caplog.text.count("offline") == 2


def test_missing_and_malformed_files(tmp_path):
    with pytest.raises(ConfigError, match="config file not found"):
        load_config(tmp_path / "nope.yaml")
    bad = tmp_path / "bad.yaml"
    bad.write_text("train_args: [1, 2\n")
    with pytest.raises(ConfigError, match="not valid YAML"):
        load_config(bad)


def test_overrides_apply_and_are_checked(tmp_path):
    cfg = load_config(None, ["train_args.comm_round=7", "data_args.dataset=digits", "ssfl_args.averaging=grouping"])
    assert cfg.train_args.comm_round == 7
    assert cfg.data_args.dataset == "digits"
    assert cfg.ssfl_args.averaging == "grouping"
    with pytest.raises(ConfigError, match="expected section.key=value"):
        load_config(None, ["comm_round=7"])
    with pytest.raises(ConfigError, match="comm_rond"):
        load_config(None, ["train_args.comm_rond=7"])


def test_switching_the_algorithm_on_the_command_line_starts_its_ssfl_args_afresh(caplog):
    root = Path(__file__).resolve().parents[1]
    paper = root / "configs" / "cifar10" / "fedmatch_batch_iid_client.yaml"  # has fedmatch-only keys
    cfg = load_config(paper, ["ssfl_args.algorithm=fedprox_uda", "ssfl_args.mu=0.1"])
    assert cfg.algorithm == "fedprox_uda" and cfg.ssfl_args.mu == 0.1 and cfg.ssfl_args.temperature == 0.4
    assert "helper_interval" in caplog.text  # the dropped keys are named
    same = load_config(paper, ["ssfl_args.algorithm=fedmatch"])  # same algorithm: the file's keys stay
    assert same.ssfl_args.num_helpers == 2
    with pytest.raises(ConfigError, match="helper_intervall"):  # typos are still caught
        load_config(paper, ["ssfl_args.helper_intervall=3"])


def test_resolved_config_round_trips(tmp_path):
    cfg = load_config(None, ["train_args.comm_round=3", "ssfl_args.threshold=0.9"])
    path = tmp_path / "config.yaml"
    path.write_text(cfg.to_yaml())
    again = load_config(path)
    assert again.to_dict() == cfg.to_dict()
    assert again.fingerprint() == cfg.fingerprint()
    assert yaml.safe_load(path.read_text())["ssfl_args"]["algorithm"] == "fedavg_ssl"


def test_fingerprint_ignores_output_location_but_not_hyperparameters():
    a = load_config(None, ["common_args.run_name=a"])
    b = load_config(None, ["common_args.run_name=b", "common_args.output_dir=/elsewhere"])
    c = load_config(None, ["train_args.learning_rate=0.1"])
    assert a.fingerprint() == b.fingerprint()
    assert a.fingerprint() != c.fingerprint()


def test_shipped_configs_validate():

    root = Path(__file__).resolve().parents[1] / "configs"
    files = sorted(root.rglob("*.yaml"))
    assert files, "configs/ should ship experiment YAMLs"
    for f in files:
        load_config(f)


def test_config_accepts_exactly_the_partition_methods_the_data_layer_has():
    from fedml_ssfl.config import CHOICES
    from fedml_ssfl.data.partition import METHODS

    assert CHOICES["data_args.partition_method"] == METHODS


def test_the_run_name_follows_what_runs_unless_set(tmp_path, caplog):
    """No run_name: <dataset>_<algorithm>. A file's own name stays unless --set changes the dataset or the
    algorithm; --set common_args.run_name always wins (in either order)."""
    from fedml_ssfl.cli import DEFAULT_JOB

    caplog.set_level("INFO", logger="fedml_ssfl.config")

    def name(path, *overrides):
        return load_config(path, list(overrides)).common_args.run_name

    assert name(None) == "mnist5k_fedavg_ssl"
    assert name(None, "data_args.dataset=digits", "ssfl_args.algorithm=fedmatch") == "digits_fedmatch"
    assert name(DEFAULT_JOB) == "mnist5k_semifl"  # the file's own name
    assert name(DEFAULT_JOB, "train_args.comm_round=2", "data_args.dataset=mnist5k") == "mnist5k_semifl"
    assert name(DEFAULT_JOB, "ssfl_args.algorithm=fedavg_ssl") == "mnist5k_fedavg_ssl"
    assert "mnist5k_semifl -> mnist5k_fedavg_ssl" in caplog.text  # the change is said
    assert name(DEFAULT_JOB, "data_args.dataset=digits") == "digits_semifl"
    assert name(DEFAULT_JOB, "ssfl_args.algorithm=fedavg_ssl", "common_args.run_name=mine") == "mine"
    assert name(DEFAULT_JOB, "common_args.run_name=mine", "data_args.dataset=digits") == "mine"
    nameless = tmp_path / "c.yaml"
    nameless.write_text("data_args:\n  dataset: digits\nssfl_args:\n  algorithm: semifl\n")
    assert name(nameless) == "digits_semifl"
    assert name(nameless, "ssfl_args.algorithm=server_only") == "digits_server_only"
    with pytest.raises(ConfigError, match="common_args.run_name: '' must be one folder name"):
        load_config(nameless, ["common_args.run_name="])  # an explicit empty name is still refused
    cfg = load_config(DEFAULT_JOB)
    assert cfg.with_algorithm("fedavg_ssl").common_args.run_name == "mnist5k_fedavg_ssl"
    assert cfg.with_algorithm("fedavg_ssl", run_name="x").common_args.run_name == "x"
    again = tmp_path / "resolved.yaml"  # a run's resolved config.yaml keeps its name
    again.write_text(load_config(nameless).to_yaml())
    assert name(again) == "digits_semifl"


def test_fedml_ssfl_set_shrinks_every_loaded_config_but_a_command_line_set_wins(monkeypatch, caplog):
    import fedml_ssfl.config as config
    from fedml_ssfl.cli import DEFAULT_JOB

    monkeypatch.setattr(config, "_smoke_warned", set())
    monkeypatch.setenv("FEDML_SSFL_SET", "train_args.comm_round=2 train_args.local_steps=3 ssfl_args.server_steps=4")
    cfg = load_config(DEFAULT_JOB, ["train_args.local_steps=7"])  # the main job: semifl, 20 rounds of T = 16
    assert cfg.train_args.comm_round == 2 and cfg.ssfl_args.server_steps == 4  # the file's 20 and 100 replaced
    assert cfg.train_args.local_steps == 7  # the command line's --set wins
    warned = [r.getMessage() for r in caplog.records if "FEDML_SSFL_SET is set" in r.getMessage()]
    assert len(warned) == 1 and "train_args.comm_round=2" in warned[0] and "local_steps=3" not in warned[0]
    # an ssfl_args key applies only where the algorithm has it (fedavg_ssl has no server_steps)
    other = load_config(DEFAULT_JOB, ["ssfl_args.algorithm=fedavg_ssl"])
    assert other.algorithm == "fedavg_ssl" and other.train_args.comm_round == 2
    assert other.common_args.run_name == "mnist5k_fedavg_ssl"
    monkeypatch.delenv("FEDML_SSFL_SET")
    assert load_config(DEFAULT_JOB).train_args.comm_round == 20


@pytest.mark.parametrize(
    "value, pattern",
    [
        ("ssfl_args.algorithm=fedavg_ssl", r"FEDML_SSFL_SET: ssfl_args\.algorithm names the run"),
        ("comm_round=2", r"FEDML_SSFL_SET=.*expected section\.key=value"),
        ("train_args.comm_rund=2", r"train_args\.comm_rund.*did you mean 'comm_round'"),
    ],
)
def test_fedml_ssfl_set_refuses_naming_keys_and_malformed_items(monkeypatch, value, pattern):
    monkeypatch.setenv("FEDML_SSFL_SET", value)
    with pytest.raises(ConfigError, match=pattern):
        load_config(None)
