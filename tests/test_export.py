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
from mobile_export import graph, verify
from mobile_export.edge_label import EDGE_FORMAT_VERSION, OUTPUT_DTYPES, OUTPUT_NAMES, run_batches
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
        "mobile_usability.onnx.txt",
        "mobile_usability.int8.onnx.txt",
        "model.required_operators.config",
        "model.int8.required_operators.config",
        "required_operators.config",
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
        "contract_onnx",
        "contract_ort",
        "int8_contract_onnx",
        "int8_contract_ort",
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
    # each file's input shape, read from the file (an iOS app has no metadata accessor: it reads these)
    shapes = {key: saved["artifacts"][key]["input_shape"] for key in ("onnx", "ort", "int8_onnx", "int8_ort")}
    dynamic, fixed = ["N", 1, 8, 8], [1, 1, 8, 8]
    assert shapes == {"onnx": dynamic, "ort": fixed, "int8_onnx": dynamic, "int8_ort": fixed}


def test_exported_graph_interface_and_metadata(full_export, trained_run):
    report, out = full_export
    model = onnx.load(str(out / "model.onnx"))
    ins = {i.name: i.type.tensor_type for i in model.graph.input}
    assert list(ins) == ["images"]  # the thresholds are a constant (an initializer that is no input)
    assert ins["images"].elem_type == onnx.TensorProto.UINT8
    dims = [d.dim_param or d.dim_value for d in ins["images"].shape.dim]
    assert isinstance(dims[0], str) and dims[1:] == [1, 8, 8]  # dynamic batch
    assert list(next(t for t in model.graph.initializer if t.name == "thresholds").dims) == [10]
    assert [o.name for o in model.graph.output] == ["probs", "label", "confidence", "mask"]
    cfg = load_config(trained_run / "config.yaml")
    ckpt = load_checkpoint(trained_run / "checkpoints" / "last.pt")
    for path, batch in ((out / "model.onnx", "N"), (out / "model.int8.ort", 1)):
        meta = make_session(path).get_modelmeta().custom_metadata_map
        assert json.loads(meta["class_names"]) == [str(i) for i in range(10)]
        assert json.loads(meta["input_shape"]) == [batch, 1, 8, 8]  # the .ort files have a fixed batch
        assert {k: meta[k] for k in ("layout", "channel_order", "resize", "resample", "inputs")} == {
            "layout": "NCHW",
            "channel_order": "L",  # digits: one channel
            "resize": "shorter_side_center_crop",
            "resample": "bilinear",
            "inputs": "images",
        }
        assert json.loads(meta["default_thresholds"]) == [0.95] * 10  # fedavg_ssl's ssfl_args.threshold
        assert meta["threshold_source"] == "config ssfl_args.threshold"
        assert meta["algorithm"] == "fedavg_ssl" and meta["round"] == str(ckpt["round"])
        assert meta["config_hash"] == ckpt["fingerprint"] == cfg.fingerprint()
        ds = load_experiment_dataset(cfg)
        assert json.loads(meta["mean"]) == pytest.approx(list(ds.mean))
        assert json.loads(meta["std"]) == pytest.approx(list(ds.std))
    assert make_session(out / "model.int8.ort").get_modelmeta().custom_metadata_map["precision"] == "int8"
    # exporter stack traces (build-machine paths) are stripped from the nodes, and its annotations from the outputs
    assert not any(n.metadata_props for n in model.graph.node)
    assert not any(v.metadata_props for v in model.graph.output)


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
    tail = {"Softmax", "ReduceMax", "ArgMax", "GatherElements", "GreaterOrEqual", "Where"}
    assert tail <= set(ops)
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


ARTIFACTS = ("model.onnx", "model.ort", "model.int8.onnx", "model.int8.ort")
ORT_TYPES = {"uint8": "tensor(uint8)", "float32": "tensor(float)", "int64": "tensor(int64)"}


def _test_images(n: int = 40) -> np.ndarray:
    cfg = load_config(None, RUN_OVERRIDES)
    return load_experiment_dataset(cfg).test_images[:n].numpy()


def test_mask_is_uint8_zero_or_one(full_export, tmp_path):
    """bool has no tensor type in onnxruntime's Objective-C / Swift API: every file's mask is uint8.

    The graph's own comparison is exercised through a copy whose constant thresholds let odd labels
    pass and even ones not.
    """
    _, out = full_export
    images = _test_images()
    odd = np.where(np.arange(10) % 2 == 0, 1.01, 0.0).astype(np.float32)
    for name in ARTIFACTS:
        sess = make_session(out / name)
        assert {o.name: o.type for o in sess.get_outputs()} == {k: ORT_TYPES[OUTPUT_DTYPES[k]] for k in OUTPUT_NAMES}
        probs, label, conf, mask = run_batches(sess, images)
        assert mask.dtype == np.uint8 and set(np.unique(mask)) <= {0, 1}, name
    for name in ("model.onnx", "model.int8.onnx"):
        model = onnx.load(str(out / name))
        graph.make_constant(model, "thresholds", odd)
        onnx.save(model, str(tmp_path / name))
        _, label, _, mask = run_batches(make_session(tmp_path / name), images)
        np.testing.assert_array_equal(mask, (label % 2).astype(np.uint8))
        assert 0 < mask.sum() < len(mask), name  # both values occur, so the comparison is exercised


def test_thresholds_are_a_constant_and_loading_warns_of_nothing(full_export):
    """images is the only input; onnxruntime at warning level says nothing on loading any of the files.

    Contract 2 kept thresholds as an input with a default (an initializer that is also a graph input),
    and onnxruntime logged "Initializer thresholds appears in graph inputs and will not be treated as
    constant value/weight" on every load of the .onnx files.
    """
    import subprocess
    import sys

    _, out = full_export
    images = _test_images()
    defaults = np.full(10, 0.95, np.float32)  # fedavg_ssl's ssfl_args.threshold, the export's default
    for name in ARTIFACTS:
        sess = make_session(out / name)
        assert [i.name for i in sess.get_inputs()] == ["images"], name
        assert sess.get_overridable_initializers() == [], name
        _, label, conf, mask = run_batches(sess, images)
        np.testing.assert_array_equal(mask, (conf >= defaults[label]).astype(np.uint8))
        _, _, _, all_in = run_batches(sess, images, np.zeros(10, np.float32))  # others: from the outputs
        assert all_in.all(), name
    for name in ("model.onnx", "model.int8.onnx"):
        model = onnx.load(str(out / name))
        init = next(t for t in model.graph.initializer if t.name == "thresholds")
        assert onnx.numpy_helper.to_array(init).tolist() == pytest.approx(defaults.tolist())
    script = (
        "import sys, onnxruntime as ort\n"
        "ort.set_default_logger_severity(2)\n"  # warnings and worse, onnxruntime's default
        "for path in sys.argv[1:]:\n"
        "    ort.InferenceSession(path, providers=['CPUExecutionProvider'])\n"
        "print('loaded', len(sys.argv) - 1)\n"
    )
    paths = [str(out / name) for name in ARTIFACTS]
    proc = subprocess.run([sys.executable, "-c", script, *paths], capture_output=True, text=True, timeout=120)
    assert proc.returncode == 0 and proc.stdout.strip() == "loaded 4", proc.stderr
    assert "appears in graph inputs" not in proc.stderr and ":onnxruntime:" not in proc.stderr, proc.stderr


def test_model_version_producer_and_only_the_opset_domains_in_use(full_export, tmp_path):
    import fedml_ssfl

    _, out = full_export
    for name in ("model.onnx", "model.int8.onnx"):
        model = onnx.load(str(out / name))
        assert model.model_version == EDGE_FORMAT_VERSION
        assert (model.producer_name, model.producer_version) == ("fedml_ssfl.mobile_export", fedml_ssfl.__version__)
        assert [o.domain for o in model.opset_import] == [""], name  # every node is standard ONNX
        assert {n.domain for n in model.graph.node} <= {""}
    for name in ARTIFACTS:
        assert make_session(out / name).get_modelmeta().version == EDGE_FORMAT_VERSION, name
    # the quantizer may declare every domain onnxruntime knows; finalize keeps those in use only
    model = onnx.load(str(out / "model.onnx"))
    for domain in ("ai.onnx.ml", "com.microsoft", "com.microsoft.nchwc", "org.pytorch.aten"):
        model.opset_import.append(onnx.helper.make_opsetid(domain, 1))
    model.graph.node[0].domain = "ai.onnx"  # the default domain by its other name counts as in use
    onnx.save(model, str(tmp_path / "m.onnx"))
    done = graph.finalize(tmp_path / "m.onnx", {"format": "x"}, [0.5] * 10, "doc")
    assert done["opset_domains_dropped"] == ["ai.onnx.ml", "com.microsoft", "com.microsoft.nchwc", "org.pytorch.aten"]
    assert [o.domain for o in onnx.load(str(tmp_path / "m.onnx")).opset_import] == [""]


def test_the_contract_check_holds_the_metadata_to_the_files_own_input(full_export, tmp_path):
    """The images input is the one source of truth for the shape: metadata saying otherwise fails the check."""
    _, out = full_export
    images = _test_images(3)
    assert verify.check_contract(make_session(out / "model.ort"), images, [0.95] * 10, 1)["passed"]
    for key, value, failure in (
        ("input_shape", "[1, 1, 8, 8]", "input_shape is [1, 1, 8, 8], the images input's shape ['N', 1, 8, 8]"),
        ("channel_order", "RGB", "image rule metadata {'channel_order': 'RGB'}"),
    ):
        model = onnx.load(str(out / "model.onnx"))
        next(p for p in model.metadata_props if p.key == key).value = value
        onnx.save(model, str(tmp_path / "m.onnx"))
        result = verify.check_contract(make_session(tmp_path / "m.onnx"), images, [0.95] * 10, None)
        assert not result["passed"] and any(failure in f for f in result["failures"]), result["failures"]


def test_ort_files_have_a_fixed_batch_and_the_onnx_files_a_dynamic_one(full_export):
    report, out = full_export
    for name in ("model.ort", "model.int8.ort"):
        sess = make_session(out / name)
        assert sess.get_inputs()[0].shape == [1, 1, 8, 8], name
        assert [o.shape[0] for o in sess.get_outputs()] == [1, 1, 1, 1], name
    for name in ("model.onnx", "model.int8.onnx"):
        assert isinstance(make_session(out / name).get_inputs()[0].shape[0], str), name
    assert report.artifacts["ort"]["batch_size"] == report.artifacts["int8_ort"]["batch_size"] == 1
    assert (
        report.checks["contract_ort"]["batch_size"] == 1 and report.checks["contract_onnx"]["batch_size"] == "dynamic"
    )


def test_mobile_usability_coverage_is_in_the_report(full_export):
    """The fixed-batch graph the .ort files hold gets most nodes on NNAPI and CoreML; the dynamic one none."""
    _, out = full_export
    saved = json.loads((out / "export_report.json").read_text())
    usability = saved["checks"]["mobile_usability"]
    assert usability["model"] == "model.ort" and usability["batch_size"] == 1
    cov = usability["coverage"]
    assert set(cov) == {"nnapi", "coreml_neuralnetwork", "coreml_mlprogram"}
    for ep in ("nnapi", "coreml_mlprogram"):
        c = cov[ep]
        assert c["nodes"] > 10 and c["supported_nodes"] / c["nodes"] >= 0.6, (ep, c)
        assert c["share"] == pytest.approx(c["supported_nodes"] / c["nodes"], abs=1e-4)
        assert c["partitions"] == len(c["partition_sizes"]) >= 1 and sum(c["partition_sizes"]) == c["supported_nodes"]
        assert c["dynamic_shape_nodes"] == 0
        assert "ai.onnx:ArgMax" in cov["nnapi"]["unsupported_ops"]
    # the same graph with a dynamic batch (model.onnx): nothing on NNAPI / CoreML
    dynamic = usability["onnx"]["coverage"]
    assert all(c["supported_nodes"] == 0 and c["dynamic_shape_nodes"] > 0 for c in dynamic.values())
    assert dynamic["nnapi"]["if_shapes_fixed"]["supported_nodes"] > 0
    int8 = saved["checks"]["int8_mobile_usability"]["coverage"]["nnapi"]
    assert int8["supported_nodes"] / int8["nodes"] >= 0.6 and int8["dynamic_shape_nodes"] == 0
    text = (out / "mobile_usability.txt").read_text()
    assert "model.ort's graph (model.onnx with batch 1)" in text and str(out) not in text
    assert f"{cov['nnapi']['supported_nodes']}/{cov['nnapi']['nodes']} nodes can be handled by the NNAPI EP" in text


def test_usability_figures_come_from_onnxruntimes_functions(tmp_path):
    """A graph whose answer is known: Conv (NNAPI and CoreML take it), then ArgMax (NNAPI does not)."""
    from onnx import TensorProto, helper

    def model(batch) -> onnx.ModelProto:
        x = helper.make_tensor_value_info("x", TensorProto.FLOAT, [batch, 1, 4, 4])
        y = helper.make_tensor_value_info("y", TensorProto.INT64, [batch, 1, 4])
        w = onnx.numpy_helper.from_array(np.ones((2, 1, 1, 1), np.float32), "w")
        nodes = [helper.make_node("Conv", ["x", "w"], ["c"]), helper.make_node("ArgMax", ["c"], ["y"], axis=1)]
        graph_proto = helper.make_graph(nodes, "g", [x], [y], [w])
        return helper.make_model(graph_proto, opset_imports=[helper.make_opsetid("", 17)])

    onnx.save(model(1), str(tmp_path / "fixed.onnx"))
    onnx.save(model("N"), str(tmp_path / "dynamic.onnx"))
    fixed = verify.usability_coverage(tmp_path / "fixed.onnx")["nnapi"]
    assert fixed == {
        "supported_nodes": 1,
        "nodes": 2,
        "share": 0.5,
        "partitions": 1,
        "partition_sizes": [1],
        "unsupported_ops": ["ai.onnx:ArgMax"],
        "dynamic_shape_nodes": 0,
        "verdict": "NO",  # one partition of half the nodes
    }
    dynamic = verify.usability_coverage(tmp_path / "dynamic.onnx")["nnapi"]
    # both nodes have an input of dynamic shape (ArgMax is counted for that as well as for its operator)
    assert (dynamic["supported_nodes"], dynamic["partitions"], dynamic["dynamic_shape_nodes"]) == (0, 0, 2)
    assert dynamic["if_shapes_fixed"]["supported_nodes"] == 1 and dynamic["if_shapes_fixed"]["partitions"] == 1
    result = verify.mobile_usability(tmp_path / "fixed.onnx", tmp_path / "report.txt", label="fixed graph")
    assert result["passed"] and result["coverage"]["nnapi"] == fixed
    text = (tmp_path / "report.txt").read_text()  # onnxruntime's own analysis, for a person
    assert "Checking fixed graph for usability" in text and "1/2 nodes can be handled by the NNAPI EP" in text
    broken = tmp_path / "broken.onnx"
    broken.write_bytes(b"not a model")
    result = verify.mobile_usability(broken, tmp_path / "broken.txt")
    assert not result["passed"] and result["coverage"] is None and result["error"]


def test_required_operators_config_for_a_reduced_build(full_export):
    from onnxruntime.tools.reduced_build_config_parser import parse_config

    report, out = full_export
    ops = {}
    configs = ("model.required_operators.config", "model.int8.required_operators.config", "required_operators.config")
    for name in configs:
        text = (out / name).read_text()
        assert "/" not in text.splitlines()[0] and ".ort" in text.splitlines()[0]  # names, not temporary paths
        required, _ = parse_config(str(out / name))
        ops[name] = {d: {op for by_opset in v.values() for op in by_opset} for d, v in required.items()}
    float_ops = ops["model.required_operators.config"]["ai.onnx"]
    graph_ops = {n.op_type for n in onnx.load(str(out / "model.onnx")).graph.node}
    assert {"Conv", "Gemm", "Softmax", "ArgMax", "ReduceMax", "GatherElements", "GreaterOrEqual", "Where"} <= float_ops
    assert float_ops <= graph_ops  # standard operators of the graph (basic optimizations fold some away)
    int8 = ops["model.int8.required_operators.config"]
    assert {"QuantizeLinear", "DequantizeLinear", "Conv"} <= int8["ai.onnx"]
    assert "QLinearConv" in int8["com.microsoft"]  # the runtime optimization's kernels, for the CPU EP
    for domain in ("ai.onnx", "com.microsoft"):
        union = ops["model.required_operators.config"].get(domain, set()) | int8.get(domain, set())
        assert ops["required_operators.config"][domain] == union
    all_ops = report.artifacts["required_operators_all"]["operators"]
    assert all_ops["ai.onnx"] == sorted(float_ops | int8["ai.onnx"])


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


def test_a_deployment_export_measures_agreement_on_the_servers_own_images(trained_run, tmp_path):
    """A deployment's run folder is on the server, which holds no client image: agreement is on its own."""
    import shutil

    import yaml

    from fedml_ssfl.experiment import export_deployment

    cfg = load_config(trained_run / "config.yaml")
    deployment = load_config(export_deployment(cfg, tmp_path / "data"))
    run = tmp_path / "deployed_run"
    (run / "checkpoints").mkdir(parents=True)
    (run / "config.yaml").write_text(yaml.safe_dump(deployment.to_dict()))
    shutil.copy(trained_run / "checkpoints" / "last.pt", run / "checkpoints" / "last.pt")
    server = load_experiment_dataset(deployment)
    calib, held, where = ex.client_image_pools(deployment, server, 16, 40)
    assert where == "server_labeled" and len(calib) + len(held) == len(server.train_images) == 50
    assert ex.client_image_pools(cfg, load_experiment_dataset(cfg), 16, 40)[2] == "client_unlabeled"
    report = ex.export_run(run, tmp_path / "out", parity_samples=100, calibration_samples=16)
    assert report.checks["int8_gates"]["agreement_measured_on"] == "server_labeled"
    assert report.source["agreement_images"] == "server_labeled"
    assert report.metadata["dataset"] == "digits"  # the exported split's data, as deployment.yaml names it


def test_checkpoint_thresholds_and_a_group_model(trained_run, tmp_path):
    ckpt = load_checkpoint(trained_run / "checkpoints" / "last.pt")
    tau = torch.linspace(0.99, 0.9999, 10)  # the fitted model is ~99.5% accurate: lower ones mask nothing
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
    assert parser.parse_args([str(trained_run)]).batch_size == 1  # the .ort files' default
    bad = parser.parse_args([str(trained_run), "--out", str(tmp_path / "bad"), "--batch-size", "-2"])
    assert ex.run_export_from_args(bad) == 1
    assert "--batch-size: the .ort files' batch must be an integer >= 1 (or 0" in capsys.readouterr().err
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
            "--batch-size",
            "3",
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
    # --batch-size 3: the .ort takes 3 images a run (50 parity images: the last run padded); the .onnx any number
    assert make_session(tmp_path / "ok" / "model.ort").get_inputs()[0].shape == [3, 1, 8, 8]
    assert saved["checks"]["parity_ort"]["samples"] == 50 and saved["checks"]["parity_ort"]["passed"]
    assert saved["checks"]["mobile_usability"]["batch_size"] == 3 and saved["artifacts"]["ort"]["batch_size"] == 3


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


def test_a_dynamic_batch_ort_on_request(tmp_path):
    """--batch-size 0: the .ort keeps the dynamic batch (and NNAPI / CoreML get nothing, as the report says)."""
    images = np.random.default_rng(0).integers(0, 256, (20, 1, 8, 8), dtype=np.uint8)
    report = ex.export_model(
        _random_model("cnn28", "bn", 1, 8), tmp_path, _meta(1, 8), test_images=images, quantize=False, batch_size=0
    )
    sess = make_session(tmp_path / "model.ort")
    assert isinstance(sess.get_inputs()[0].shape[0], str)
    assert run_session(sess, images).probs.shape == (20, 10)  # one run
    usability = report.checks["mobile_usability"]
    assert usability["batch_size"] == "dynamic" and "onnx" not in usability
    assert usability["coverage"]["nnapi"]["supported_nodes"] == 0
    assert not (tmp_path / "mobile_usability.onnx.txt").exists()
    with pytest.raises(ex.ExportError, match=r"--batch-size.*got 1.5"):
        ex.export_model(_random_model("cnn28", "bn", 1, 8), tmp_path, _meta(1, 8), test_images=images, batch_size=1.5)


def test_a_broken_contract_fails_the_export(tmp_path, monkeypatch):
    """Thresholds left among the inputs (contract 2's optional input): the contract check says so."""
    real = graph.make_constant

    def also_an_input(model, name, values):
        real(model, name, values)
        model.graph.input.append(onnx.helper.make_tensor_value_info(name, onnx.TensorProto.FLOAT, [len(values)]))

    monkeypatch.setattr(graph, "make_constant", also_an_input)
    images = np.random.default_rng(0).integers(0, 256, (8, 1, 8, 8), dtype=np.uint8)
    with pytest.raises(ex.ExportError, match=r"contract_onnx.*\['thresholds'\] can be fed as inputs"):
        ex.export_model(_random_model("cnn28", "gn", 1, 8), tmp_path, _meta(1, 8), test_images=images, quantize=False)
    assert json.loads((tmp_path / "export_report.json").read_text())["failed_check"] == "contract_onnx"


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
