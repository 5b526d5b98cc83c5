"""A run's outputs stand alone (issue 35 item 5): the checkpoint alone gives the run's accuracy, a FedML
script's run exports, a model naming its logits in a tuple / dict trains, names come from the data and
model used."""

from __future__ import annotations

import dataclasses
import json
from pathlib import Path

import numpy as np
import pytest
import torch
import yaml
from torch import nn

from fedml_ssfl.config import ConfigError, load_config
from fedml_ssfl.data import load_dataset
from fedml_ssfl.models.script import norm_kind, script_model_factory
from fedml_ssfl.trained import CARD_KEY, accuracy, load_trained

SIM = [
    "train_args.comm_round=3",
    "train_args.local_steps=4",
    "common_args.compare_with=[]",
    "tracking_args.progress_bar=false",
    "tracking_args.enable_tensorboard=false",
    "data_args.dataset=digits",
    "model_args.model=cnn28",
    "train_args.client_num_in_total=2",
    "train_args.client_num_per_round=2",
]


def test_a_simulator_checkpoint_alone_gives_the_runs_accuracy(tmp_path):
    from fedml_ssfl.runtime.local import run_local

    result = run_local(load_config(None, SIM), run_dir=tmp_path / "run")
    trained = load_trained(result.run_dir)  # nothing but the checkpoint: no config, no dataset options
    digits = load_dataset("digits")
    assert accuracy(trained, digits.test_images, digits.test_labels) == pytest.approx(result.final_acc, abs=1e-9)
    card = trained.card
    unnormalised = dataclasses.replace(trained, card={**card, "norm_mean": [0.0], "norm_std": [1.0]})
    assert accuracy(unnormalised, digits.test_images, digits.test_labels) != pytest.approx(result.final_acc)
    assert card["norm_mean"] == pytest.approx(list(digits.mean)) and card["norm_std"] == pytest.approx(list(digits.std))
    assert (card["label"], card["num_classes"], card["input_shape"]) == ("cnn28-gn", 10, [1, 8, 8])
    summary = json.loads((result.run_dir / "summary.json").read_text())
    assert summary[CARD_KEY] == card and summary["model"] == "cnn28-gn" and summary["dataset"] == "digits"
    head = (result.run_dir / "config.yaml").read_text().splitlines()[0]
    assert head.startswith("# resolved by the run: model cnn28-gn") and str(card["norm_mean"]) in head
    assert yaml.safe_load((result.run_dir / "config.yaml").read_text())["data_args"]["norm_mean"] == []  # as given


class TwoHeads(nn.Module):
    """A model returning (logits, embedding), or a dict of both."""

    def __init__(self, as_dict: bool = False) -> None:
        super().__init__()
        self.as_dict = as_dict
        self.body = nn.Sequential(nn.Flatten(), nn.Linear(64, 16), nn.BatchNorm1d(16), nn.ReLU())
        self.head = nn.Linear(16, 10)

    def forward(self, x):
        emb = self.body(x)
        return {"embedding": emb, "logits": self.head(emb)} if self.as_dict else (self.head(emb), emb)


def test_a_model_returning_a_tuple_or_dict_names_its_logits_with_model_args_logits():
    with pytest.raises(ConfigError, match=r"returns a tuple of 2 .*model_args\.logits"):
        script_model_factory(TwoHeads(), 10, 1, 8, (1, 8, 8))
    with pytest.raises(ConfigError, match=r"returns a dict \(keys: 'embedding', 'logits'\).*model_args\.logits"):
        script_model_factory(TwoHeads(as_dict=True), 10, 1, 8, (1, 8, 8))
    x = torch.zeros(3, 1, 8, 8)
    for module, selector in ((TwoHeads(), 0), (TwoHeads(as_dict=True), "logits"), (TwoHeads(), "0")):
        model = script_model_factory(module, 10, 1, 8, (1, 8, 8), selector)()
        assert model(x).shape == (3, 10)
        assert list(model.state_dict()) == list(module.state_dict())  # the keys the script's module has
    with pytest.raises(ConfigError, match=r"model_args\.logits 'scores'.*keys: 'embedding', 'logits'"):
        script_model_factory(TwoHeads(as_dict=True), 10, 1, 8, (1, 8, 8), "scores")
    cfg = load_config(None, ["model_args.logits=0"])
    assert cfg.model_args.logits == 0 and load_config(None, []).fingerprint() != cfg.fingerprint()


def test_a_run_of_a_model_with_a_tuple_output_trains_and_its_checkpoint_stands_alone(tmp_path):
    """A registered model returning (logits, embedding) runs end to end with model_args.logits: 0."""
    from fedml_ssfl.models import register_model
    from fedml_ssfl.runtime.local import run_local

    @register_model("test_two_heads", norms=("bn",), in_channels=(1,), image_sizes=(8,))
    def _two_heads(num_classes, in_channels, image_size, norm):
        return TwoHeads()

    cfg = load_config(None, [*SIM, "model_args.model=test_two_heads", "model_args.norm=bn", "model_args.logits=0"])
    result = run_local(cfg, run_dir=tmp_path / "run")
    trained = load_trained(result.run_dir)
    digits = load_dataset("digits")
    assert accuracy(trained, digits.test_images, digits.test_labels) == pytest.approx(result.final_acc, abs=1e-9)
    assert trained.card["logits"] == 0 and trained.card["norm"] == "bn"
    from mobile_export import export as ex  # the exported graph takes the logits too, parity checked on them

    report = ex.export_run(result.run_dir, tmp_path / "edge", quantize=False, parity_samples=200)
    assert report.ok and report.checks["parity_onnx"]["label_mismatches"] == 0


def test_norm_layers_are_read_from_the_module():
    assert norm_kind(TwoHeads()) == "bn"
    assert norm_kind(nn.Sequential(nn.Conv2d(1, 4, 3), nn.GroupNorm(2, 4))) == "gn"
    assert norm_kind(nn.Sequential(nn.BatchNorm2d(4), nn.GroupNorm(2, 4))) == "bn+gn"
    assert norm_kind(nn.Linear(3, 2)) == "none"


# ---------------------------------------------------------------------------------------------
# a FedML script's run (in process, as tests/test_fedml_script.py drives FedMLRunner's calls)


@pytest.fixture(scope="module")
def script_run(tmp_path_factory):
    pytest.importorskip("fedml")
    from tests.test_fedml_script import FEDML_YAML, SCRIPT, _round_trip

    folder = tmp_path_factory.mktemp("script_outputs")
    path = folder / "my_job.py"
    with_bn = "nn.BatchNorm2d(8), nn.ReLU(), nn.AdaptiveAvgPool2d"  # the user's model holds BatchNorm
    path.write_text(SCRIPT.replace("nn.ReLU(), nn.AdaptiveAvgPool2d", with_bn))
    raw = yaml.safe_load(FEDML_YAML)
    raw["data_args"]["dataset"] = "mnist"  # FedML's example YAML: not what the script's list holds
    raw["train_args"].update(comm_round=3, local_steps=10, learning_rate=0.1)
    config = folder / "fedml_config.yaml"
    config.write_text(yaml.safe_dump(raw))
    import importlib.util
    from types import SimpleNamespace

    spec = importlib.util.spec_from_file_location("outputs_job", path)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    script = SimpleNamespace(path=path, module=module, config=config, folder=folder)
    run = _round_trip(script, tmp_path_factory.mktemp("runs"))
    return script, run


def test_a_script_run_is_named_after_its_list_and_model_and_its_checkpoint_gives_its_accuracy(script_run):
    script, run = script_run
    result = run.aggregator.result
    assert result.run_dir.name == "script_data_fedavg_ssl"  # not mnist_fedavg_ssl: the YAML's dataset
    assert result.summary["dataset"] == "script_data" and result.summary["model"] == "TinyNet-bn"
    card = result.summary[CARD_KEY]
    assert card["model_class"] == "my_job.TinyNet" and card["model_file"] == str(script.path.resolve())
    server_data = run.aggregator.runtime.exp.dataset
    assert card["norm_mean"] == pytest.approx(list(server_data.mean)) and card["norm_mean"] != [0.0]
    # evaluated as saved: the class imported from the script's folder, the normalisation from the checkpoint
    trained = load_trained(result.run_dir)
    acc = accuracy(trained, server_data.test_images, server_data.test_labels)
    assert acc == pytest.approx(result.final_acc, abs=1e-9)


def test_export_builds_a_script_runs_model_from_its_checkpoint_and_names_what_it_needs(script_run, tmp_path):
    from fedml_ssfl.data.local_files import write_npz
    from mobile_export import export as ex

    script, run = script_run
    result = run.aggregator.result
    with pytest.raises(ex.ExportError, match=r"FedML script's run, which keeps none of the script's data: pass --data"):
        ex.export_run(result.run_dir, tmp_path / "none", quantize=False)
    with pytest.raises(ex.ExportError, match=r"--model 'nowhere:Net': cannot import nowhere"):
        ex.export_run(result.run_dir, tmp_path / "none", quantize=False, model_spec="nowhere:Net", data="x.npz")
    server_data = run.aggregator.runtime.exp.dataset
    data = tmp_path / "test.npz"
    write_npz(data, server_data.test_images.numpy(), server_data.test_labels.numpy())
    report = ex.export_run(result.run_dir, tmp_path / "out", quantize=False, data=data, parity_samples=0)
    assert report.ok
    meta = report.metadata
    assert json.loads(meta["mean"]) == pytest.approx(result.summary[CARD_KEY]["norm_mean"])
    assert meta["dataset"] == "script_data" and meta["model"] == "script:TinyNet"
    ort = pytest.importorskip("onnxruntime")
    sess = ort.InferenceSession(str(tmp_path / "out" / "model.onnx"))
    labels = sess.run(["label"], {"images": server_data.test_images.numpy()})[0]
    assert np.mean(labels == server_data.test_labels.numpy()) == pytest.approx(result.final_acc, abs=1e-9)


def test_a_script_data_name_is_the_configs_own_or_script_data():
    pytest.importorskip("fedml")
    from fedml_ssfl.runtime.fedml.hooks import script_data_name

    assert script_data_name("mnist") == "script_data" and script_data_name("") == "script_data"
    assert script_data_name("my_digits") == "my_digits"


def test_a_checkpoint_without_a_card_names_the_way(tmp_path):
    from fedml_ssfl.checkpoint import save_checkpoint

    save_checkpoint(tmp_path / "old.pt", {"round": 0, "algorithm": {"global_state": {}}})
    with pytest.raises(ConfigError, match="carries no model_card"):
        load_trained(Path(tmp_path / "old.pt"))


def test_an_unset_logits_key_is_no_difference_from_a_checkpoint_written_before_it():
    from fedml_ssfl.checkpoint import config_difference

    before = {"model_args": {"model": "cnn28", "norm": "gn"}}
    assert config_difference(before, {"model_args": {"model": "cnn28", "norm": "gn", "logits": ""}}) == []
    assert config_difference(before, {"model_args": {"model": "cnn28", "norm": "gn", "logits": 0}}) == [
        "model_args.logits (checkpoint '', now 0)"
    ]
