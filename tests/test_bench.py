"""The round-speed harness (fedml_ssfl.bench): passes counted exactly, and replayed exactly."""

from __future__ import annotations

import pytest
import torch
from torch import nn
from torch.func import functional_call
from torch.nn import functional as F

from fedml_ssfl import bench
from fedml_ssfl.bench import (
    Forward,
    OptimizerStep,
    PassRecorder,
    Reference,
    Workload,
    format_bench,
    measure_round_speed,
    parse_variant,
    replay,
)
from fedml_ssfl.config import ConfigError
from fedml_ssfl.experiment import build_experiment
from fedml_ssfl.models import build_model
from fedml_ssfl.training import InputPipeline


def tiny_model() -> nn.Module:
    torch.manual_seed(0)
    return build_model("cnn28", num_classes=10, in_channels=1, image_size=8, norm="bn")


def test_the_recorder_counts_each_forward_and_optimizer_step_of_the_model_class_only():
    model, other = tiny_model(), nn.Linear(4, 2)
    opt = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.5, nesterov=True, weight_decay=1e-3)
    x = torch.rand(6, 1, 8, 8)
    with PassRecorder(type(model)) as rec:
        loss = F.cross_entropy(model(x), torch.zeros(6, dtype=torch.long))
        loss = loss + model(x[:2]).sum()  # two forwards into one backward
        opt.zero_grad()
        loss.backward()
        opt.step()
        with torch.no_grad():
            model.eval()
            model(x[:3])
        model.train()
        other(torch.rand(3, 4))  # another class: not counted
        weights = {k: v.detach() for k, v in model.named_parameters()}  # no gradient through these
        functional_call(model, weights, (x[:1],))
    assert rec.workload.events == [
        Forward((6, 1, 8, 8), grad=True, training=True, classes=10),
        Forward((2, 1, 8, 8), grad=True, training=True, classes=10),
        OptimizerStep(momentum=0.5, nesterov=True, weight_decay=1e-3),
        Forward((3, 1, 8, 8), grad=False, training=False, classes=10),
        Forward((1, 1, 8, 8), grad=False, training=True, classes=10),
    ]
    assert rec.workload.summary() == {
        "forwards_grad": 2,
        "forwards_nograd": 2,
        "optimizer_steps": 1,
        "images_grad": 8,
        "images_nograd": 4,
    }
    assert rec.timers["forward"] > 0 and rec.timers["backward"] > 0
    # the hooks and patches are gone afterwards
    events = len(rec.events)
    model(x)
    assert len(rec.events) == events and torch.Tensor.backward.__name__ == "backward"


def test_replay_runs_exactly_the_recorded_passes():
    work = Workload(
        [
            Forward((5, 1, 8, 8), True, True, 10),
            Forward((5, 1, 8, 8), False, True, 10),
            OptimizerStep(0.9, False, 0.0),
            Forward((7, 1, 8, 8), False, False, 10),
            Forward((3, 1, 8, 8), True, True, 10),
            OptimizerStep(0.9, False, 0.0),
        ]
    )
    model = tiny_model()
    inputs = {s: torch.rand(s) for s in {(5, 1, 8, 8), (7, 1, 8, 8), (3, 1, 8, 8)}}
    before = {k: v.clone() for k, v in model.state_dict().items()}
    with PassRecorder(type(model)) as rec:
        wall, cpu = replay(work, model, inputs, torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9))
    assert rec.workload.events == work.events
    assert wall > 0 and cpu > 0
    assert not torch.equal(before["conv1.weight"], model.state_dict()["conv1.weight"])  # it trained


def test_reference_variants_are_parsed_and_unknown_flags_refused():
    assert parse_variant("eager") == frozenset()
    assert parse_variant("channels_last+inference") == {"channels_last", "inference"}
    with pytest.raises(ConfigError, match="--variants"):
        parse_variant("channel_last")
    with pytest.raises(ConfigError, match="one memory layout"):
        parse_variant("channels_last+contiguous")
    ref = Reference("channels_last", tiny_model(), torch.device("cpu"))
    assert ref.model.conv2.weight.is_contiguous(memory_format=torch.channels_last)
    assert ref.layout == torch.channels_last
    nchw = Reference("contiguous", tiny_model(), torch.device("cpu"), round_layout="channels_last")
    assert nchw.model.conv2.weight.is_contiguous() and nchw.layout == torch.contiguous_format
    assert Reference("eager", tiny_model(), torch.device("cpu"), round_layout="auto").layout == torch.channels_last
    assert Reference("eager", tiny_model(), torch.device("cpu")).layout is None  # unchanged


def test_a_round_and_its_reference_do_the_same_passes(small_config):
    cfg = small_config("ssfl_args.algorithm=fedavg_ssl", "train_args.comm_round=2")
    result = measure_round_speed(cfg, rounds=2, warmup=1, variants=["eager", "channels_last+inference"])
    assert cfg.train_args.comm_round == 4  # raised: no measured round is the last
    assert cfg.device_args.num_threads == 1
    measured = [e for e in result["per_round"] if not e["warmup"]]
    assert len(measured) == 2 and len(result["per_round"]) == 3
    work = result["workload"]
    # fedavg_ssl: the server's T steps, then each of the 4 clients' T steps on one [weak; strong] batch
    steps = cfg.train_args.local_steps
    assert work["optimizer_steps"] == 5 * steps
    assert work["forwards_grad"] == 5 * steps
    assert work["images_grad"] == steps * 32 + 4 * steps * 2 * 32
    assert work["images_nograd"] == len(build_experiment(cfg).dataset.test_labels)  # evaluation, every round
    for name in ("eager", "channels_last+inference"):
        assert result["ratio"][name] > 0 and result["ratio_cpu"][name] > 0
    for e in measured:  # the headline divides by each round's fastest reference
        assert e["best_cpu_seconds"] == min(e["reference_cpu_seconds"].values())
        assert e["reference_cpu_seconds"][e["best_variant"]] == e["best_cpu_seconds"]
    assert result["ratio_best_cpu"] >= max(result["ratio_cpu"].values()) - 1e-12  # pointwise larger, so its median is
    assert set(result["breakdown"]) >= {"forward", "backward", "augment", "record", "other"}
    assert result["peak_rss_mb"] > 0 and len(result["machine"]["loadavg"]) == 3
    text = format_bench(result)
    assert "reference channels_last+inference" in text and "CPU ratio" in text


def test_the_compile_variant_compiles_once_and_times_its_replays_apart(small_config, monkeypatch):
    compiled: list[nn.Module] = []

    def fake_compile(model):  # torch.compile's contract: a callable running the model
        compiled.append(model)
        return model

    monkeypatch.setattr(bench.torch, "compile", fake_compile)
    replays: list[str] = []
    real_run = Reference.run

    def counted(self, *args):
        replays.append(self.name)
        return real_run(self, *args)

    monkeypatch.setattr(Reference, "run", counted)
    cfg = small_config("ssfl_args.algorithm=fedavg_ssl", "train_args.local_steps=1")
    result = measure_round_speed(cfg, rounds=2, warmup=0, variants=["eager", "compile"])
    assert len(compiled) == 1
    # the first replay compiles: its seconds are reported apart and it is replayed again to be timed
    assert replays == ["eager", "compile", "compile", "eager", "compile"]
    assert set(result["compile_seconds"]) == {"compile"} and result["compile_seconds"]["compile"] > 0
    assert "compile (compile): first replay" in format_bench(result)


def test_the_bench_refuses_impossible_counts(small_config):
    with pytest.raises(ConfigError, match="--rounds"):
        measure_round_speed(small_config(), rounds=0)


def test_the_reference_inputs_are_augmented_views_of_the_dataset_images():
    from fedml_ssfl.bench import reference_inputs
    from fedml_ssfl.contract import DataInfo

    images = torch.randint(0, 256, (4, 1, 8, 8), dtype=torch.uint8)
    pipe = InputPipeline(DataInfo(10, 1, 8, (0.5,), (0.25,), False), torch.device("cpu"))
    out = reference_inputs([(6, 1, 8, 8), (2, 3, 4, 4)], images, pipe, torch.Generator().manual_seed(0))
    assert out[(6, 1, 8, 8)].shape == (6, 1, 8, 8) and out[(6, 1, 8, 8)].dtype == torch.float32
    assert out[(2, 3, 4, 4)].shape == (2, 3, 4, 4)  # not the dataset's shape: noise
