"""mobile_export.export: torch -> ONNX / ORT / int8 for on-device pseudo-labeling, verified."""

from __future__ import annotations

import argparse
import json
import warnings
from pathlib import Path

import numpy as np
import onnx
import pytest
import torch
from torch import nn

from fedml_ssfl.checkpoint import load_checkpoint, save_checkpoint
from fedml_ssfl.config import load_config
from fedml_ssfl.data.augment import normalize, to_float
from fedml_ssfl.experiment import load_experiment_dataset, model_factory
from fedml_ssfl.models import available_models, build_model, model_spec
from mobile_export import export as ex
from mobile_export.verify import make_session, run_session

RUN_OVERRIDES = [
    "train_args.comm_round=1",
    "train_args.local_steps=2",
    "common_args.compare_with=[]",
    "tracking_args.progress_bar=false",
    "tracking_args.enable_tensorboard=false",
    "data_args.dataset=digits",
    "model_args.model=cnn28",
    "train_args.client_num_in_total=2",
    "train_args.client_num_per_round=2",
]


def _fit(model: nn.Module, images: torch.Tensor, labels: torch.Tensor, mean, std, steps: int = 150) -> None:
    """A quick supervised fit so the exported model is a trained one (int8 gates need real margins)."""
    gen = torch.Generator().manual_seed(0)
    opt = torch.optim.Adam(model.parameters(), lr=1e-2)
    model.train()
    for _ in range(steps):
        idx = torch.randint(0, len(images), (128,), generator=gen)
        loss = nn.functional.cross_entropy(model(normalize(to_float(images[idx]), mean, std)), labels[idx])
        opt.zero_grad()
        loss.backward()
        opt.step()
    model.eval()


@pytest.fixture(scope="module")
def trained_run(tmp_path_factory) -> Path:
    """A real (tiny) run on digits whose checkpointed global model is then fitted for a few seconds."""
    from fedml_ssfl.runtime.local import run_local

    torch.manual_seed(0)
    cfg = load_config(None, RUN_OVERRIDES)
    run_dir = run_local(cfg, run_dir=tmp_path_factory.mktemp("runs") / "run").run_dir
    ckpt = run_dir / "checkpoints" / "last.pt"
    payload = load_checkpoint(ckpt)
    ds = load_experiment_dataset(cfg)
    net = model_factory(cfg, ds)()
    net.load_state_dict(payload["algorithm"]["global_state"])
    _fit(net, ds.train_images, ds.train_labels, ds.mean, ds.std)
    payload["algorithm"]["global_state"] = {k: v.detach().clone() for k, v in net.state_dict().items()}
    payload.pop("format")
    save_checkpoint(ckpt, payload)
    return run_dir


@pytest.fixture(scope="module")
def full_export(trained_run, tmp_path_factory):
    out = tmp_path_factory.mktemp("export")
    return ex.export_run(trained_run, out), out


def test_export_run_writes_verified_float_ort_and_int8_models(full_export, trained_run):
    report, out = full_export
    assert report.ok
    for name in (
        "model.onnx",
        "model.ort",
        "model.int8.onnx",
        "model.int8.ort",
        "export_report.json",
        "mobile_usability.txt",
        "mobile_usability.int8.txt",
    ):
        assert (out / name).is_file(), name
    saved = json.loads((out / "export_report.json").read_text())
    assert saved["status"] == "ok" and saved["exporter"]["exporter"] == "dynamo" and saved["exporter"]["opset"] == 18
    checks = saved["checks"]
    for name in (
        "onnx_checker",
        "mobile_usability",
        "parity_onnx",
        "parity_ort",
        "int8_onnx_checker",
        "int8_mobile_usability",
        "int8_gates",
        "int8_ort_gates",
    ):
        assert checks[name]["passed"], name
    # parity on the whole digits test set (359 images < 1,000)
    assert checks["parity_onnx"]["samples"] == saved["source"]["test_images_available"] == 359
    assert checks["parity_onnx"]["label_mismatches"] == 0 and checks["parity_onnx"]["mask_mismatches"] == 0
    assert checks["parity_onnx"]["torch_test_acc"] > 0.8  # the fixture trained it
    gates = checks["int8_gates"]
    assert gates["test_acc_drop_points"] <= 1.0 and gates["label_agreement"] >= 0.98
    assert gates["agreement_measured_on"] == "client_unlabeled"
    assert {"float_mask_rate", "int8_mask_rate", "mask_rate_change_points"} <= set(gates)
    assert "Checking NNAPI" in (out / "mobile_usability.txt").read_text()
    assert saved["artifacts"]["int8_onnx"]["bytes"] < saved["artifacts"]["onnx"]["bytes"]


def test_exported_graph_interface_and_metadata(full_export, trained_run):
    report, out = full_export
    model = onnx.load(str(out / "model.onnx"))
    ins = {i.name: i.type.tensor_type for i in model.graph.input}
    assert list(ins) == ["images", "thresholds"]
    assert ins["images"].elem_type == onnx.TensorProto.UINT8
    dims = [d.dim_param or d.dim_value for d in ins["images"].shape.dim]
    assert isinstance(dims[0], str) and dims[1:] == [1, 8, 8]  # dynamic batch
    assert [d.dim_value for d in ins["thresholds"].shape.dim] == [10]
    assert [o.name for o in model.graph.output] == ["probs", "label", "confidence", "mask"]
    cfg = load_config(trained_run / "config.yaml")
    ckpt = load_checkpoint(trained_run / "checkpoints" / "last.pt")
    for path in (out / "model.onnx", out / "model.int8.ort"):
        meta = make_session(path).get_modelmeta().custom_metadata_map
        assert json.loads(meta["class_names"]) == [str(i) for i in range(10)]
        assert json.loads(meta["input_shape"]) == ["N", 1, 8, 8]
        assert json.loads(meta["default_thresholds"]) == [0.95] * 10  # fedavg_ssl's ssfl_args.threshold
        assert meta["threshold_source"] == "config ssfl_args.threshold"
        assert meta["algorithm"] == "fedavg_ssl" and meta["round"] == str(ckpt["round"])
        assert meta["config_hash"] == ckpt["fingerprint"] == cfg.fingerprint()
        ds = load_experiment_dataset(cfg)
        assert json.loads(meta["mean"]) == pytest.approx(list(ds.mean))
        assert json.loads(meta["std"]) == pytest.approx(list(ds.std))
    assert make_session(out / "model.int8.ort").get_modelmeta().custom_metadata_map["precision"] == "int8"
    # exporter stack traces (build-machine paths) are stripped from the nodes
    assert not any(n.metadata_props for n in model.graph.node)


def test_int8_model_is_qdq_with_float_tail(full_export):
    _, out = full_export
    model = onnx.load(str(out / "model.int8.onnx"))
    ops = [n.op_type for n in model.graph.node]
    assert ops.count("QuantizeLinear") > 0 and ops.count("DequantizeLinear") > 0
    producers = {o: n for n in model.graph.node for o in n.output}
    softmax = next(n for n in model.graph.node if n.op_type == "Softmax")
    classifier = producers[softmax.input[0]]
    assert classifier.op_type == "Gemm"  # float logits into a float softmax
    assert all(producers[i].op_type != "DequantizeLinear" for i in classifier.input[1:] if i in producers)
    tail = {"Softmax", "ReduceMax", "ArgMax", "GatherND", "Gather", "GreaterOrEqual", "Unsqueeze"}
    for node in model.graph.node:
        if node.op_type in tail:
            assert all(
                producers[i].op_type not in ("QuantizeLinear", "DequantizeLinear") for i in node.input if i in producers
            ), node.name
    # per-channel weights: the first conv's weight scale has one entry per output channel
    inits = {t.name: t for t in model.graph.initializer}
    dq_weight = next(
        n
        for n in model.graph.node
        if n.op_type == "DequantizeLinear"
        and n.input[0] in inits
        and inits[n.input[0]].data_type == onnx.TensorProto.INT8
        and len(inits[n.input[0]].dims) == 4
    )
    assert list(inits[dq_weight.input[1]].dims) == [inits[dq_weight.input[0]].dims[0]]


def test_graph_matches_torch_for_any_batch_and_thresholds(full_export, trained_run):
    _, out = full_export
    cfg = load_config(trained_run / "config.yaml")
    ds = load_experiment_dataset(cfg)
    net = model_factory(cfg, ds)()
    net.load_state_dict(load_checkpoint(trained_run / "checkpoints" / "last.pt")["algorithm"]["global_state"])
    thr = np.linspace(0.3, 0.9, 10).astype(np.float32)
    sess = make_session(out / "model.ort")
    for n in (1, 7):
        images = ds.test_images[:n].numpy()
        got = run_session(sess, images, thr)
        ref = ex.torch_predictions(net, images, ds.mean, ds.std, thr)
        np.testing.assert_allclose(got.probs, ref.probs, rtol=1e-3, atol=1e-5)
        np.testing.assert_array_equal(got.label, ref.label)
        np.testing.assert_array_equal(got.mask, got.confidence >= thr[got.label])


def test_failed_int8_gate_fails_the_export(trained_run, tmp_path):
    with pytest.raises(ex.ExportError, match="agreement"):
        ex.export_run(trained_run, tmp_path, min_agreement=1.01, parity_samples=100, calibration_samples=32)
    saved = json.loads((tmp_path / "export_report.json").read_text())
    assert saved["status"] == "failed" and saved["failed_check"] == "int8_gates"
    assert saved["checks"]["int8_gates"]["failures"]


def test_checkpoint_thresholds_and_a_group_model(trained_run, tmp_path):
    ckpt = load_checkpoint(trained_run / "checkpoints" / "last.pt")
    tau = torch.linspace(0.2, 0.65, 10)
    ckpt["algorithm"]["thresholds"] = tau  # FedSEAL keeps class-wise thresholds in its state
    group = {k: v.clone() for k, v in ckpt["algorithm"]["global_state"].items()}
    group["fc.bias"][3] += 100.0  # a group model that says "3" to everything
    ckpt["algorithm"]["group_states"] = {1: group}  # FedAvg-SSL's per-group models
    ckpt.pop("format")
    other_ckpt = save_checkpoint(trained_run / "checkpoints" / "other.pt", ckpt)
    try:
        report = ex.export_run(other_ckpt, tmp_path, quantize=False, parity_samples=200)
        with pytest.raises(ex.ExportError, match=r"no '7' under 'algorithm.group_states' \(there: 1\)"):
            ex.export_run(other_ckpt, tmp_path / "g7", weights="group_states.7")
        group_report = ex.export_run(
            other_ckpt, tmp_path / "g1", quantize=False, parity_samples=50, weights="group_states.1"
        )
    finally:
        other_ckpt.unlink()
    meta = report.metadata
    assert meta["threshold_source"] == "checkpoint"
    assert json.loads(meta["default_thresholds"]) == pytest.approx(tau.tolist())
    assert report.checks["int8"]["skipped"] and not (tmp_path / "model.int8.onnx").exists()
    assert report.checks["parity_onnx"]["samples"] == 200
    assert 0 < report.checks["parity_onnx"]["mask_rate"] < 1
    assert group_report.metadata["weights"] == "group_states.1"
    assert group_report.metadata["model_version"].endswith(":group_states.1")
    images = np.zeros((2, 1, 8, 8), dtype=np.uint8)
    assert run_session(make_session(tmp_path / "g1" / "model.onnx"), images, tau.numpy()).label.tolist() == [3, 3]


def test_refuses_bad_input(trained_run, tmp_path):
    with pytest.raises(ex.ExportError, match=r"got 3 values for a model with 10 classes"):
        ex.export_run(trained_run, tmp_path / "a", thresholds=[0.5, 0.6, 0.7])
    with pytest.raises(ex.ExportError, match=r"\[0, 1\]"):
        ex.export_run(trained_run, tmp_path / "b", thresholds=[1.5])
    no_ckpt = tmp_path / "run_without_checkpoint"
    no_ckpt.mkdir()
    (no_ckpt / "config.yaml").write_text((trained_run / "config.yaml").read_text())
    with pytest.raises(ex.ExportError, match="has no checkpoint"):
        ex.export_run(no_ckpt, tmp_path / "c")
    with pytest.raises(ex.ExportError, match="does not exist"):
        ex.export_run(tmp_path / "nowhere", tmp_path / "d")


def test_cli_hooks(trained_run, tmp_path, capsys):
    parser = ex.add_export_arguments(argparse.ArgumentParser())
    bad = parser.parse_args([str(trained_run), "--out", str(tmp_path / "bad"), "--threshold", "0.5", "0.6"])
    assert ex.run_export_from_args(bad) == 1
    assert "2 values" in capsys.readouterr().err
    args = parser.parse_args(
        [
            str(trained_run / "checkpoints" / "last.pt"),
            "--no-int8",
            "--threshold",
            "0.7",
            "--parity-samples",
            "50",
            "--opset",
            "17",
        ]
    )
    assert ex.default_out_dir(args.source) == trained_run / "export"
    args.out = str(tmp_path / "ok")
    with pytest.warns(ex.ExporterFallbackWarning, match="opset 17"):  # dynamo writes >= 18; legacy honours 17
        assert ex.run_export_from_args(args) == 0
    assert "report:" in capsys.readouterr().out
    saved = json.loads((tmp_path / "ok" / "export_report.json").read_text())
    assert saved["exporter"]["opset"] == 17 and saved["exporter"]["exporter"] == "legacy"
    assert onnx.load(str(tmp_path / "ok" / "model.onnx")).opset_import[0].version == 17
    assert json.loads(saved["metadata"]["default_thresholds"]) == [0.7] * 10


# ---------------------------------------------------------------------------------------------
# any registry model, without a run

HEAVY_PARAMS = 5_000_000
"""Models bigger than this are exported with one norm only (gn where offered); the small ones cover bn / gn / none."""


def _registry_cases():
    from fedml_ssfl.models import count_parameters

    for name in available_models():
        spec = model_spec(name)
        norms = spec.norms
        if len(norms) > 1:
            size = 8 if spec.accepts_image_size(8) else spec.image_sizes[0]
            net = build_model(name, num_classes=10, in_channels=_channels(spec), image_size=size, norm=norms[0])
            if count_parameters(net) > HEAVY_PARAMS:
                norms = ("gn",) if "gn" in norms else norms[:1]
        for norm in norms:
            yield pytest.param(name, norm, id=f"{name}-{norm}")


def _channels(spec) -> int:
    return 3 if spec.in_channels is None or 3 in spec.in_channels else spec.in_channels[0]


def _meta(channels: int, size: int, k: int = 10) -> ex.EdgeMetadata:
    return ex.EdgeMetadata(
        class_names=[f"c{i}" for i in range(k)],
        mean=[0.4] * channels,
        std=[0.3] * channels,
        in_channels=channels,
        image_size=size,
        thresholds=[0.15],
        model="m",
    )


def _random_model(name: str, norm: str, channels: int, size: int) -> nn.Module:
    torch.manual_seed(0)
    net = build_model(name, num_classes=10, in_channels=channels, image_size=size, norm=norm)
    for m in net.modules():  # non-trivial BatchNorm statistics, so folding them is exercised
        if isinstance(m, nn.BatchNorm2d):
            m.running_mean.uniform_(-0.5, 0.5)
            m.running_var.uniform_(0.5, 2.0)
    return net.eval()


@pytest.mark.parametrize(("name", "norm"), list(_registry_cases()))
def test_every_registry_model_exports_with_parity(name, norm, tmp_path):
    spec = model_spec(name)
    size = 8 if spec.accepts_image_size(8) else spec.image_sizes[0]
    channels = _channels(spec)
    images = np.random.default_rng(0).integers(0, 256, (48, channels, size, size), dtype=np.uint8)
    report = ex.export_model(
        _random_model(name, norm, channels, size), tmp_path, _meta(channels, size), test_images=images, quantize=False
    )
    assert report.ok and report.exporter["exporter"] == "dynamo"
    assert report.checks["parity_onnx"]["passed"] and report.checks["parity_ort"]["passed"]
    assert report.checks["onnx_checker"]["passed"]


def test_a_failed_parity_check_fails_the_export(tmp_path, monkeypatch):
    real = ex.torch_predictions

    def skewed(*args, **kwargs):
        pred = real(*args, **kwargs)
        pred.probs = pred.probs * 1.01
        return pred

    monkeypatch.setattr(ex, "torch_predictions", skewed)
    images = np.random.default_rng(0).integers(0, 256, (16, 1, 8, 8), dtype=np.uint8)
    with pytest.raises(ex.ExportError, match="parity_onnx"):
        ex.export_model(_random_model("cnn28", "gn", 1, 8), tmp_path, _meta(1, 8), test_images=images, quantize=False)
    assert json.loads((tmp_path / "export_report.json").read_text())["failed_check"] == "parity_onnx"


def test_legacy_exporter_is_the_fallback(tmp_path, monkeypatch):
    real_export = torch.onnx.export

    def dynamo_breaks(*args, **kwargs):
        if kwargs.get("dynamo"):
            raise RuntimeError("simulated torch.export failure")
        return real_export(*args, **kwargs)

    monkeypatch.setattr(torch.onnx, "export", dynamo_breaks)
    images = np.random.default_rng(0).integers(0, 256, (16, 1, 8, 8), dtype=np.uint8)
    with pytest.warns(ex.ExporterFallbackWarning, match="legacy"):
        report = ex.export_model(
            _random_model("cnn28", "bn", 1, 8), tmp_path, _meta(1, 8), test_images=images, quantize=False
        )
    assert report.exporter["exporter"] == "legacy" and "simulated" in report.exporter["fallback_reason"]
    assert report.checks["parity_onnx"]["passed"]
    sess = make_session(tmp_path / "model.onnx")
    assert run_session(sess, images[:3], np.full(10, 0.1, np.float32)).probs.shape == (3, 10)  # dynamic batch


@torch.library.custom_op("fedml_ssfl_test::wobble", mutates_args=())
def _wobble(x: torch.Tensor) -> torch.Tensor:
    return x * 2


@_wobble.register_fake
def _(x):
    return torch.empty_like(x)


class _Wobbly(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.fc = nn.Linear(64, 10)

    def forward(self, x):
        return self.fc(torch.flatten(_wobble(x), 1))


def test_an_op_the_exporter_cannot_handle_is_named(tmp_path):
    images = np.zeros((4, 1, 8, 8), dtype=np.uint8)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        with pytest.raises(ex.ExportError, match=r"operator fedml_ssfl_test(\.|::)wobble"):
            ex.export_model(_Wobbly().eval(), tmp_path, _meta(1, 8), test_images=images, quantize=False)
    assert json.loads((tmp_path / "export_report.json").read_text())["failed_check"] == "export"


def test_quantize_needs_calibration_images(tmp_path):
    images = np.zeros((4, 1, 8, 8), dtype=np.uint8)
    with pytest.raises(ex.ExportError, match="calibrat"):
        ex.export_model(_random_model("cnn28", "gn", 1, 8), tmp_path, _meta(1, 8), test_images=images)
    with pytest.raises(ex.ExportError, match=r"expected uint8 images of shape \(N, 1, 8, 8\)"):
        ex.export_model(
            _random_model("cnn28", "gn", 1, 8),
            tmp_path,
            _meta(1, 8),
            test_images=images.astype(np.float32),
            quantize=False,
        )
