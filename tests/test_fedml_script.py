"""A FedML user's own script, model and dataset list, run by FedML's FedMLRunner with fedml_ssfl's classes.

The script below is written as FedML's cross-silo examples are (``fedml.init()``, a device, FedML's
8-entry dataset list, the user's ``nn.Module``, a trainer and an aggregator, ``FedMLRunner(...).run()``);
its model has no layer named ``fc`` and its list is built here from the shipped digits. It runs under
``mpirun`` (each process one party), and in this process, where the server's aggregation can be
checked against the silos' replies exactly.
"""

from __future__ import annotations

import importlib.util
import json
import logging
import re
import sys
import textwrap
import time
from types import SimpleNamespace

import numpy as np
import pytest
import torch
import yaml

from fedml_ssfl.config import SCRIPT_DATA, ConfigError
from fedml_ssfl.data import build_split
from fedml_ssfl.data.fedml_lists import read_loader, server_dataset, silo_data
from fedml_ssfl.data.partition_methods import PartitionOptions

pytest.importorskip("fedml")
pytest.importorskip("mpi4py")

from tests.test_fedml_mpi import metrics, mpi_env, mpirun  # noqa: E402  (after the skips)

SCRIPT = textwrap.dedent(
    '''
    """A FedML user's cross-silo script: its own model, its own data in FedML's list format."""
    import sys

    import fedml
    import torch
    from fedml import FedMLRunner
    from torch import nn

    from fedml_ssfl.runtime.fedml.hooks import SSFLAggregator, SSFLTrainer


    class TinyNet(nn.Module):  # no layer named fc: the head is "classifier"
        def __init__(self, classes=10):
            super().__init__()
            self.body = nn.Sequential(nn.Conv2d(1, 8, 3, padding=1), nn.ReLU(), nn.AdaptiveAvgPool2d(2), nn.Flatten())
            self.classifier = nn.Linear(32, classes)

        def forward(self, x):
            return self.classifier(self.body(x))


    def digits_list(silos, skip_silo=None):
        """FedML's 8 entries from the digits: float images in [0, 1] (ToTensor's), silo k = every silos-th image."""
        from fedml_ssfl.data import load_dataset

        d = load_dataset("digits")
        x, y = d.train_images.float() / 255, d.train_labels
        loader = lambda i: torch.utils.data.DataLoader(torch.utils.data.TensorDataset(x[i], y[i]), batch_size=32)
        parts = {k: torch.arange(k, len(y), silos) for k in range(silos) if k != skip_silo}
        test = torch.utils.data.TensorDataset(d.test_images.float() / 255, d.test_labels)
        return [
            len(y), len(d.test_labels), loader(torch.arange(len(y))), torch.utils.data.DataLoader(test, batch_size=64),
            {k: len(p) for k, p in parts.items()}, {k: loader(p) for k, p in parts.items()}, None, 10,
        ]


    if __name__ == "__main__":
        args = fedml.init()
        device = fedml.device.get_device(args)
        skip = int(sys.argv[sys.argv.index("--skip-silo") + 1]) if "--skip-silo" in sys.argv else -1
        dataset = digits_list(2, skip_silo=skip if args.rank == skip + 1 else None)  # --skip-silo k: rank k + 1's
        out = sys.argv[sys.argv.index("--out") + 1]
        model = TinyNet()
        initial = {k: v.clone() for k, v in model.state_dict().items()}
        trainer, aggregator = SSFLTrainer(model, args), SSFLAggregator(model, args)
        FedMLRunner(args, device, dataset, model, trainer, aggregator).run()
        torch.save({"initial": initial, "final": model.state_dict()}, f"{out}/rank{args.rank}.pt")
    '''
)

# A config in the layout of FedML's GRPC cross-silo step-by-step example, on MPI, with the keys this
# package adds (local_steps, ssfl_args) and FedML's that it does not use.
FEDML_YAML = textwrap.dedent(
    """
    common_args:
      training_type: "cross_silo"
      scenario: "horizontal"
      using_mlops: false
      random_seed: 0
    data_args:
      dataset: "my_digits"
      partition_method: "hetero"
      partition_alpha: 0.5
      num_server_labels: 40
    model_args:
      model: "lr"
    train_args:
      federated_optimizer: "FedAvg"
      client_id_list:
      client_num_in_total: 2
      client_num_per_round: 2
      comm_round: 2
      local_steps: 3
      batch_size: 16
      client_optimizer: sgd
      learning_rate: 0.05
    validation_args:
      frequency_of_the_test: 1
    device_args:
      worker_num: 2
      using_gpu: false
      num_threads: 1
    comm_args:
      backend: "MPI"
    tracking_args:
      local_log_output_path: ./log
      enable_wandb: false
      enable_tensorboard: false
      progress_bar: false
    ssfl_args:
      algorithm: fedavg_ssl
      threshold: 0.0  # every pseudo-label counts: a tiny model learns from its first round
      bootstrap_steps: 10
    """
)


@pytest.fixture(scope="module")
def script(tmp_path_factory):
    """The script on disk, imported (its model class and list builder), and its FedML config."""
    folder = tmp_path_factory.mktemp("fedml_script")
    path = folder / "torch_job.py"
    path.write_text(SCRIPT)
    spec = importlib.util.spec_from_file_location("b27_torch_job", path)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    config = folder / "fedml_config.yaml"
    config.write_text(FEDML_YAML)
    return SimpleNamespace(path=path, module=module, config=config, folder=folder)


# ---------------------------------------------------------------------------------------------
# FedML's list, read


def test_loaders_are_read_in_dataset_order_without_moving_the_random_streams():
    g = torch.Generator().manual_seed(0)
    images = torch.randint(0, 256, (10, 1, 6, 6), dtype=torch.uint8, generator=g)
    labels = torch.arange(10) % 3
    floats = torch.utils.data.TensorDataset(images.float() / 255, labels)  # ToTensor's scale
    shuffled = torch.utils.data.DataLoader(floats, batch_size=4, shuffle=True)
    torch.manual_seed(5)
    before = torch.get_rng_state()
    read = read_loader(shuffled, "train_data_local_dict[0]")
    assert torch.equal(torch.get_rng_state(), before)
    assert torch.equal(read.images, images) and torch.equal(read.labels, labels)  # exact bytes, dataset order
    batches = [(images[:6].reshape(6, 36).numpy(), labels[:6].tolist()), (images[6:].reshape(4, 36), labels[6:])]
    flat = read_loader(batches, "vectors")  # FedML's MNIST lr data: flat vectors of s * s values
    assert flat.sample_shape == (36,) and torch.equal(flat.images, images)
    with pytest.raises(ConfigError, match=r"test_data_global: its float images lie in \[-1, 1\].*before Normalize"):
        read_loader([(images.float() / 127.5 - 1, labels)], "test_data_global")
    with pytest.raises(ConfigError, match="vectors of 35 values"):
        read_loader([(torch.zeros(2, 35), torch.zeros(2, dtype=torch.long))], "v")


def test_the_server_draws_the_simulators_labels_and_silos_hide_theirs(script):
    dataset = script.module.digits_list(2)
    server, shape = server_dataset(dataset, num_server_labels=40, num_server_val=10, seed=3)
    labels = dataset[2].dataset.tensors[1]
    options = PartitionOptions(num_server_labels=40, num_server_val=10)
    split = build_split(labels, 10, options, num_clients=2, seed=3)  # the simulator's split of the same data
    assert torch.equal(server.train_labels, labels[torch.cat([split.server_labeled, split.server_val])])
    assert server.num_server_val == 10 and shape == (1, 8, 8) and len(server.test_labels) == len(dataset[3].dataset)
    hidden, _ = silo_data(dataset, 1, scenario="server", num_classes=10, seed=3)
    assert len(hidden.labels) == dataset[4][1] and bool((hidden.labels == -1).all())  # labels-at-server
    kept, _ = silo_data(dataset, 0, scenario="client", num_classes=10, seed=3, labels_per_class_client=2)
    assert int((kept.labels >= 0).sum()) == 20  # 2 per class of the 10
    with pytest.raises(ConfigError, match=r"train_data_local_dict\[2\] is missing.*rank k \+ 1 trains silo k"):
        silo_data(dataset, 2, scenario="server", num_classes=10, seed=3)


# ---------------------------------------------------------------------------------------------
# the public classes in this process: the server aggregates exactly what the silos sent


def _round_trip(script, tmp_path, *settings):
    """FedMLRunner's calls on the aggregator and one trainer per silo, in process, until the run ends."""
    from fedml_ssfl.runtime.fedml import hooks
    from fedml_ssfl.runtime.fedml.launch import fedml_args
    from fedml_ssfl.runtime.fedml.payloads import decode

    cfg = hooks.script_config(str(script.config), argv=["--set", f"common_args.output_dir={tmp_path}", *settings])
    dataset, model = script.module.digits_list(2), script.module.TinyNet()
    initial = {k: v.clone() for k, v in model.state_dict().items()}

    def args(rank):
        a = fedml_args(cfg, rank)
        a.ssfl_config = cfg
        return a

    aggregator = hooks.SSFLAggregator(model, args(0))
    aggregator.receive(dataset, model)
    trainers = {k: hooks.SSFLTrainer(script.module.TinyNet(), args(k + 1)) for k in range(2)}
    for t in trainers.values():
        t.receive(dataset, t.model)
    payloads, rounds = aggregator.get_model_params(), []
    while not aggregator.runtime.done:
        uploads = []
        for k, t in trainers.items():
            t.set_model_params(payloads[k])
            t.train(None, None, None)
            uploads.append((0, t.get_model_params()))
        algo = aggregator.runtime.exp.algorithm
        rounds.append((dict(getattr(algo, "_server_state", None) or {}), [decode(u["ssfl"]) for _, u in uploads]))
        payloads = aggregator.aggregate(uploads)
    return SimpleNamespace(cfg=cfg, model=model, initial=initial, aggregator=aggregator, rounds=rounds)


def test_the_classes_train_the_scripts_model_on_its_list_and_aggregate_the_silos(script, tmp_path):
    from fedml_ssfl.aggregation import fedavg_with_server
    from fedml_ssfl.checkpoint import load_checkpoint

    run = _round_trip(script, tmp_path)
    algo, result = run.aggregator.runtime.exp.algorithm, run.aggregator.result
    assert result is not None and result.summary["status"] == "completed"
    assert result.summary["model"] == "TinyNet-none" and result.summary["dataset"] == "my_digits"
    assert "measured_non_iid_r" not in result.summary  # the server holds no client data to measure it on
    assert run.cfg.data_args.local_data == SCRIPT_DATA and run.cfg.comm_args.mode == "deployment"
    # the last round: the global model is FedAvg-SSL's average of the server's step and both silos' replies
    server_state, replies = run.rounds[-1]
    assert [r.silo for r in replies] == [0, 1] and all(r.trained for r in replies)
    expected = fedavg_with_server(server_state, [r.msg.weights for r in replies], keys=algo.parameter_names())
    for k, v in expected.items():
        assert torch.equal(algo.global_state[k], v), k
    assert not torch.equal(replies[0].msg.weights["classifier.weight"], replies[1].msg.weights["classifier.weight"])
    # the script's own model object holds it, changed from its start, and so does the checkpoint
    final = run.model.state_dict()
    assert all(not torch.equal(final[k], run.initial[k]) for k in final)
    saved = load_checkpoint(result.run_dir / "checkpoints" / "last.pt")["algorithm"]["global_state"]
    assert saved.keys() == final.keys() and all(torch.equal(saved[k], final[k]) for k in final)
    assert algo.head_names() == ["classifier.weight", "classifier.bias"]  # found by a forward pass
    assert all("client_pseudo_acc" not in r for r in metrics(result.run_dir))  # the silos' labels stayed hidden


@pytest.mark.parametrize("algorithm", ["fedmatch", "fedsiam"])
def test_labels_at_client_algorithms_derive_what_they_need_from_the_scripts_model(script, tmp_path, algorithm):
    """FedMatch's sigma / psi split and FedSiam's layers come from the module itself (no naming rule)."""
    from fedml_ssfl.algorithms.fedsiam import layer_groups

    run = _round_trip(
        script,
        tmp_path,
        *("--set", f"ssfl_args.algorithm={algorithm}", "--set", "data_args.label_scenario=client"),
        *("--set", "data_args.num_server_labels=0", "--set", "data_args.labels_per_class_client=3"),
    )
    algo, result = run.aggregator.runtime.exp.algorithm, run.aggregator.result
    assert result.summary["status"] == "completed" and result.summary["model"] == "TinyNet-none"
    names = sorted(name for name, _ in run.model.named_parameters())
    if algorithm == "fedmatch":
        assert sorted(algo.sigma) == sorted(algo.psi) == names  # every trainable parameter, sigma + psi
    else:
        assert list(layer_groups(run.model.state_dict())) == ["body.0", "classifier"]  # the module's own layers
    final = run.model.state_dict()
    assert any(not torch.equal(final[k], run.initial[k]) for k in final)
    assert all(r.trained and r.msg is not None for _, replies in run.rounds for r in replies)


def test_a_script_config_names_the_fedml_keys_it_does_not_use(script, caplog):
    from fedml_ssfl.runtime.fedml import hooks

    caplog.set_level(logging.INFO)
    cfg = hooks.script_config(str(script.config), argv=["--set", "common_args.run_name=trial"])
    assert cfg.common_args.run_name == "trial" and cfg.model_args.model == "lr"
    said = [r.getMessage() for r in caplog.records if r.levelno == logging.WARNING]
    for key in ("data_args.partition_method", "data_args.partition_alpha", "model_args.model"):
        assert sum(m.startswith(f"{key} is not used") for m in said) == 1, (key, said)
    assert sum(m.startswith("tracking_args.local_log_output_path is FedML's and is ignored") for m in said) == 1
    raw = yaml.safe_load(FEDML_YAML)
    del raw["data_args"]["dataset"]
    unnamed = script.folder / "unnamed.yaml"
    unnamed.write_text(yaml.safe_dump(raw))
    cfg = hooks.script_config(str(unnamed), argv=[])  # named after the script's data, not a shipped dataset
    assert cfg.data_args.dataset == "script_data" and cfg.common_args.run_name == "script_data_fedavg_ssl"
    raw["common_args"]["training_type"] = "simulation"  # as FedML's own MPI cross-silo example says it
    sim = script.folder / "simulation.yaml"
    sim.write_text(yaml.safe_dump(raw))
    cfg = hooks.script_config(str(sim), argv=[])  # FedMLRunner with our trainer: the cross-silo deployment
    assert (cfg.common_args.training_type, cfg.comm_args.mode) == ("cross_silo", "deployment")
    raw["comm_args"] = {**(raw.get("comm_args") or {}), "mode": "simulation"}
    bad = script.folder / "mode_simulation.yaml"
    bad.write_text(yaml.safe_dump(raw))
    with pytest.raises(ConfigError, match="FedMLRunner runs the deployment mode"):
        hooks.script_config(str(bad), argv=[])


# ---------------------------------------------------------------------------------------------
# under mpirun, as a FedML user runs it


def test_a_fedml_script_under_mpirun_trains_its_model_and_the_checkpoint_holds_it(script, tmp_path):
    from fedml_ssfl.checkpoint import load_checkpoint

    cmd = [sys.executable, str(script.path), "--cf", str(script.config), "--out", str(tmp_path)]
    cmd += ["--set", f"common_args.output_dir={tmp_path / 'runs'}", "--set", "common_args.run_name=mine"]
    proc = mpirun(3, cmd, env=mpi_env())
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    run_dir = tmp_path / "runs" / "mine"
    summary = json.loads((run_dir / "summary.json").read_text())
    assert summary["status"] == "completed" and summary["model"] == "TinyNet-none", summary
    assert summary["dataset"] == "my_digits" and "measured_non_iid_r" not in summary
    server = torch.load(tmp_path / "rank0.pt")
    saved = load_checkpoint(run_dir / "checkpoints" / "last.pt")["algorithm"]["global_state"]
    for k, v in server["final"].items():
        assert not torch.equal(v, server["initial"][k]), k  # trained
        assert torch.equal(v, saved[k]), k  # the script's model object is what the checkpoint holds
    rows = metrics(run_dir)
    assert [r["clients"] for r in rows] == [2, 2]  # both silos' models were aggregated every round
    assert all(np.isfinite(r["weight_diversity_fc"]) and r["weight_diversity_fc"] > 0 for r in rows)
    for silo in (0, 1):  # each silo kept its own state in its own folder
        assert (run_dir / f"silo_{silo}" / "checkpoints" / "silo_state-2.pt").is_file()  # after the last round
    assert sum("is not used" in line and "model_args.model" in line for line in proc.stderr.splitlines()) == 1


def test_an_error_on_one_rank_ends_the_mpi_job_at_once_with_one_line(script, tmp_path):
    """Rank 2's list lacks its silo: it says so in one line and the whole job ends (no hang)."""
    cmd = [sys.executable, str(script.path), "--cf", str(script.config), "--out", str(tmp_path), "--skip-silo", "1"]
    cmd += ["--set", f"common_args.output_dir={tmp_path / 'runs'}"]
    started = time.monotonic()
    proc = mpirun(3, cmd, env=mpi_env(), timeout=180)
    assert proc.returncode != 0 and time.monotonic() - started < 150
    lines = [line for line in proc.stderr.splitlines() if line.startswith("fedml-ssfl: error:")]
    assert len(lines) == 1, proc.stderr[-3000:]
    assert re.match(r"fedml-ssfl: error: rank 2: the dataset list's train_data_local_dict has no entry 1", lines[0])
    assert lines[0].endswith("; ending the MPI job") and "Traceback" not in proc.stderr
