"""mobile_export.edge_label: the on-device runner (numpy + onnxruntime only)."""

from __future__ import annotations

import csv
import json
import os
import re
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest

from mobile_export import edge_label as el

REPO = Path(__file__).resolve().parents[1]
K = 4


@pytest.fixture(scope="module")
def models(tmp_path_factory):
    """Two versions (rounds 3 and 4) of a small 1x8x8 model of the same run, and one of another run."""
    import torch

    from fedml_ssfl.models import build_model
    from mobile_export.export import EdgeMetadata, export_model

    images = np.random.default_rng(1).integers(0, 256, (32, 1, 8, 8), dtype=np.uint8)
    paths = {}
    for tag, seed, rnd, run in (("v3", 0, 3, "runA"), ("v4", 1, 4, "runA"), ("other", 2, 0, "runB")):
        torch.manual_seed(seed)
        net = build_model("cnn28", num_classes=K, in_channels=1, image_size=8, norm="gn")
        with torch.no_grad():
            net.fc.weight.mul_(3.0)  # confidences around the 0.6 threshold, so masks are mixed
        meta = EdgeMetadata(
            class_names=["ant", "bee", "cat", "dog"],
            mean=[0.3],
            std=[0.4],
            in_channels=1,
            image_size=8,
            thresholds=[0.6],
            round=rnd,
            config_hash=run,
            model="cnn28",
            norm="gn",
        )
        out = tmp_path_factory.mktemp(tag)
        export_model(net, out, meta, test_images=images, quantize=False)
        paths[tag] = out / "model.ort"
    return paths


@pytest.fixture()
def batch(tmp_path) -> Path:
    path = tmp_path / "unlabeled.npy"
    np.save(path, np.random.default_rng(7).integers(0, 256, (40, 1, 8, 8), dtype=np.uint8))
    return path


def _rows(out: Path) -> list[dict]:
    with open(out / "pseudo_labels.csv", newline="") as fh:
        return list(csv.DictReader(fh))


def _jsonl(out: Path) -> list[dict]:
    return [json.loads(line) for line in (out / "pseudo_labels.jsonl").read_text().splitlines()]


def test_runs_where_torch_cannot_be_imported(models, batch, tmp_path):
    blocker = tmp_path / "no_torch"
    (blocker / "torch").mkdir(parents=True)
    (blocker / "torch" / "__init__.py").write_text("raise ImportError('torch is not on this device')\n")
    script = (
        "import sys\n"
        "try:\n    import torch\nexcept ImportError:\n    pass\nelse:\n    sys.exit('torch imported')\n"
        "from mobile_export.edge_label import main\n"
        "rc = main(sys.argv[1:])\n"
        "loaded = [m for m in sys.modules if (m == 'torch' or m.startswith('torch.')) and sys.modules[m]]\n"
        "assert not loaded, loaded\n"
        "sys.exit(rc)\n"
    )
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(blocker), str(REPO)])}
    out = tmp_path / "labels"
    proc = subprocess.run(
        [sys.executable, "-c", script, str(models["v4"]), str(batch), "--out", str(out), "--batch-size", "16"],
        env=env,
        cwd=tmp_path,
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert proc.returncode == 0, proc.stderr
    assert "images/s" in proc.stdout and "labeled 40 images" in proc.stdout
    assert len(_rows(out)) == 40 and len(_jsonl(out)) == 40


def test_labels_confidence_and_mask_match_the_model(models, batch, tmp_path):
    labeler = el.EdgeLabeler(models["v4"])
    images = np.load(batch)
    ref = labeler.predict(images, batch_size=7)  # default thresholds from metadata: 0.6 for every class
    summary = el.label_images(models["v4"], batch, tmp_path, batch_size=16)
    rows, recs = _rows(tmp_path), _jsonl(tmp_path)
    assert [r["id"] for r in rows] == [f"unlabeled.npy#{i}" for i in range(40)]
    np.testing.assert_array_equal([int(r["label"]) for r in rows], ref["label"])
    np.testing.assert_array_equal([r["mask"] == "1" for r in rows], ref["mask"])
    np.testing.assert_allclose([float(r["confidence"]) for r in rows], ref["confidence"], atol=1e-6)
    assert [r["class_name"] for r in rows] == [["ant", "bee", "cat", "dog"][i] for i in ref["label"]]
    np.testing.assert_allclose([rec["probs"] for rec in recs], ref["probs"], atol=1e-6)
    np.testing.assert_array_equal(ref["mask"], ref["confidence"] >= 0.6)
    assert 0 < ref["mask"].sum() < 40  # mixed, so the threshold is exercised
    assert summary["images"] == 40 and summary["images_per_second"] > 0
    with np.load(tmp_path / "pseudo_labels.npz") as npz:
        np.testing.assert_array_equal(npz["label"], ref["label"])
    # one tau broadcast, or one per class
    el.label_images(models["v4"], batch, tmp_path / "t", thresholds=[0.0])
    assert all(r["mask"] == "1" for r in _rows(tmp_path / "t"))
    el.label_images(models["v4"], batch, tmp_path / "c", thresholds=[1.0, 0.0, 1.0, 0.0])
    assert all((r["mask"] == "1") == (int(r["label"]) in (1, 3)) for r in _rows(tmp_path / "c"))


def test_a_fixed_batch_model_labels_any_number_of_images(models, batch, tmp_path):
    """The .ort files take one image a run (batch fixed to 1 for NNAPI / CoreML); the runner batches for them."""
    images = np.load(batch)
    labeler = el.EdgeLabeler(models["v4"])
    assert labeler.info.batch_size == 1 and labeler.info.format_version == el.EDGE_FORMAT_VERSION
    assert {o.name: o.type for o in labeler.session.get_outputs()}["mask"] == "tensor(uint8)"
    fixed = labeler.predict(images, batch_size=16)  # the model's own batch wins
    dynamic = el.EdgeLabeler(models["v4"].with_suffix(".onnx"))  # the same weights, any batch
    assert dynamic.info.batch_size is None
    ref = dynamic.predict(images, batch_size=16)
    np.testing.assert_allclose(fixed["probs"], ref["probs"], rtol=1e-5, atol=1e-6)
    np.testing.assert_array_equal(fixed["mask"], ref["mask"])
    assert fixed["mask"].dtype == bool  # the graph's 0/1 uint8, as a numpy boolean mask
    assert el.label_images(models["v4"], batch, tmp_path)["batch_size"] == 1
    with np.load(tmp_path / "pseudo_labels.npz") as npz:
        assert npz["mask"].dtype == bool and len(npz["mask"]) == 40
    # the default thresholds are baked in: images alone give the same mask as the metadata's defaults fed
    probs, label, conf, mask = el.run_batches(labeler.session, images)
    _, _, _, fed = el.run_batches(labeler.session, images, labeler.thresholds())
    np.testing.assert_array_equal(mask, fed)
    assert 0 < mask.sum() < len(mask)


def _older_contract(models, tmp_path: Path, version: int) -> Path:
    """The v4 model rewritten as contract 1 (thresholds a required input, bool mask) or 2 (an optional input)."""
    import onnx

    model = onnx.load(str(models["v4"].with_suffix(".onnx")))
    thresholds = next(t for t in model.graph.initializer if t.name == "thresholds")
    model.graph.input.append(onnx.helper.make_tensor_value_info("thresholds", onnx.TensorProto.FLOAT, [K]))
    if version == 1:
        model.graph.initializer.remove(thresholds)
        where = next(n for n in model.graph.node if n.op_type == "Where" and n.output[0] == "mask")
        compare = next(n for n in model.graph.node if n.output[0] == where.input[0])
        compare.output[0] = "mask"
        model.graph.node.remove(where)
        next(o for o in model.graph.output if o.name == "mask").type.tensor_type.elem_type = onnx.TensorProto.BOOL
    next(p for p in model.metadata_props if p.key == "format").value = f"fedml_ssfl.edge/{version}"
    path = tmp_path / f"contract{version}.onnx"
    onnx.save(model, str(path))
    return path


@pytest.mark.parametrize("version", [1, 2])
def test_a_model_of_an_older_contract_still_labels(models, batch, tmp_path, version):
    """Contract 1: thresholds a required input, mask bool; 2: an optional input. The runner feeds them."""
    labeler = el.EdgeLabeler(_older_contract(models, tmp_path, version))
    assert labeler.info.format_version == version and labeler.info.shape == (1, 8, 8)
    takes = [i.name for i in (*labeler.session.get_inputs(), *labeler.session.get_overridable_initializers())]
    assert takes == ["images", "thresholds"]
    images = np.load(batch)
    got, ref = labeler.predict(images), el.EdgeLabeler(models["v4"]).predict(images)
    np.testing.assert_array_equal(got["mask"], ref["mask"])
    assert got["mask"].dtype == bool and 0 < got["mask"].sum() < len(images)
    tau = [1.0, 0.0, 1.0, 0.0]  # fed to the graph here; recomputed from the outputs for contract 3
    got, ref = labeler.predict(images, tau), el.EdgeLabeler(models["v4"]).predict(images, tau)
    np.testing.assert_array_equal(got["mask"], ref["mask"])
    np.testing.assert_array_equal(got["mask"], np.isin(ref["label"], [1, 3]))


def test_self_ensemble_is_the_running_mean_over_model_versions(models, batch, tmp_path):
    images = np.load(batch)
    p3 = el.EdgeLabeler(models["v3"]).predict(images)["probs"]
    p4 = el.EdgeLabeler(models["v4"]).predict(images)["probs"]
    state = tmp_path / "ensemble.npz"
    el.label_images(models["v3"], batch, tmp_path / "r3", ensemble_state=state)
    el.label_images(models["v4"], batch, tmp_path / "r4", ensemble_state=state)
    recs = _jsonl(tmp_path / "r4")
    mean = (p3 + p4) / 2  # Eq. 8 after two versions
    np.testing.assert_allclose([r["probs"] for r in recs], mean, atol=1e-5)
    assert [r["label"] for r in recs] == list(mean.argmax(1))
    assert [r["model_label"] for r in recs] == list(p4.argmax(1))
    assert all(r["ensemble_size"] == 2 for r in recs)
    thr = 0.6
    assert [r["mask"] for r in recs] == list(mean.max(1) >= thr)
    # the same version again does not count twice; new samples start their own mean
    more = tmp_path / "more.npz"
    new_images = np.concatenate([images, np.random.default_rng(9).integers(0, 256, (3, 1, 8, 8), dtype=np.uint8)])
    np.savez(more, images=new_images, ids=np.array([f"unlabeled.npy#{i}" for i in range(43)]))
    el.label_images(models["v4"], more, tmp_path / "again", ensemble_state=state)
    again = _jsonl(tmp_path / "again")
    assert [r["ensemble_size"] for r in again] == [2] * 40 + [1] * 3
    np.testing.assert_allclose([r["probs"] for r in again[:40]], mean, atol=1e-5)
    # a model from another run is refused, unless the state is reset
    with pytest.raises(el.EdgeInputError, match="another state file|--reset-ensemble"):
        el.label_images(models["other"], batch, tmp_path / "x", ensemble_state=state)
    el.label_images(models["other"], batch, tmp_path / "y", ensemble_state=state, reset_ensemble=True)
    assert all(r["ensemble_size"] == 1 for r in _jsonl(tmp_path / "y"))


def test_image_folder_input(models, tmp_path, capsys):
    from PIL import Image

    images = np.random.default_rng(3).integers(0, 256, (5, 1, 8, 8), dtype=np.uint8)
    folder = tmp_path / "photos"
    (folder / "sub").mkdir(parents=True)
    for i, img in enumerate(images):
        Image.fromarray(img[0]).save(folder / ("sub" if i % 2 else ".") / f"img{i}.png")
    ids, loaded = el.load_images(folder, el.EdgeLabeler(models["v4"]))
    assert ids == ["img0.png", "img2.png", "img4.png", "sub/img1.png", "sub/img3.png"]
    np.testing.assert_array_equal(loaded, images[[0, 2, 4, 1, 3]])  # the model's size and mode: as they are
    # any size and mode: the image rule brings them to 1x8x8, and the summary says what it did
    Image.fromarray(np.full((8, 8, 3), (0, 255, 0), np.uint8)).save(folder / "rgb.png")
    Image.fromarray(np.full((9, 8), 77, np.uint8)).save(folder / "tall.png")
    Image.fromarray(np.full((23, 37, 3), 200, np.uint8)).save(folder / "odd.jpg", quality=95)
    assert el.main([str(models["v4"]), str(folder), "--out", str(tmp_path / "o"), "--convert"]) == 0
    assert "image rule (8x8, L): 1 cropped, 1 resized, 2 to L" in capsys.readouterr().out
    rows = {r["id"]: r for r in _rows(tmp_path / "o")}
    assert len(rows) == 8
    ids, loaded = el.load_images(folder, el.EdgeLabeler(models["v4"]))
    got = dict(zip(ids, loaded))
    assert (got["rgb.png"] == 150).all() and (got["tall.png"] == 77).all()  # luma of pure green; a crop
    assert abs(got["odd.jpg"].astype(int) - 200).max() <= 2  # JPEG's rounding


def _png(path: Path, array: np.ndarray, **save) -> Path:
    from PIL import Image

    Image.fromarray(array).save(path, **save)
    return path


def test_the_image_rule_pinned_by_value(tmp_path):
    """Each step of prepare_image on small real files and arrays, against values worked out by hand."""
    from PIL import Image

    prep = el.prepare_image
    # 5. channels: luma (299 R + 587 G + 114 B + 500) // 1000 for a 1-channel model; grey in R, G, B for 3
    rgb = np.array([[[255, 0, 0], [0, 255, 0]], [[0, 0, 255], [10, 20, 30]]], np.uint8)
    np.testing.assert_array_equal(prep(_png(tmp_path / "rgb.png", rgb), (1, 2, 2)), [[[76, 150], [29, 18]]])
    grey = np.array([[0, 128], [200, 255]], np.uint8)
    np.testing.assert_array_equal(prep(_png(tmp_path / "grey.png", grey), (3, 2, 2)), np.stack([grey] * 3))
    # 3. alpha over black, round(c * a / 255): RGBA, and a palette with a transparent entry
    rgba = np.array([[[200, 100, 50, 128], [200, 100, 50, 0], [10, 20, 30, 255]]], np.uint8)
    got = prep(_png(tmp_path / "rgba.png", rgba), (3, 1, 3))
    np.testing.assert_array_equal(got[:, 0].T, [[100, 50, 25], [0, 0, 0], [10, 20, 30]])
    assert prep(rgba, (1, 1, 3)).tolist() == [[[62, 0, 18]]]
    pal = Image.new("P", (2, 1))
    pal.putpalette([200, 100, 50, 9, 9, 9] + [0] * 762)
    pal.putdata([0, 1])
    pal.save(tmp_path / "pal.png", transparency=1)
    assert prep(tmp_path / "pal.png", (3, 1, 2))[:, 0].T.tolist() == [[200, 100, 50], [0, 0, 0]]
    # 2. 16 bits to 8: round(v / 257)
    deep = np.array([[0, 128, 129, 25828, 65535]], np.uint16)
    assert Image.open(_png(tmp_path / "deep.png", deep)).mode == "I;16"
    assert prep(tmp_path / "deep.png", (1, 1, 5)).tolist() == [[[0, 0, 1, 100, 255]]]
    assert prep(tmp_path / "deep.png", (3, 1, 5))[2].tolist() == [[0, 0, 1, 100, 255]]
    # 1. EXIF orientation 6 (the camera was turned): the picture is turned upright, 90 degrees clockwise
    side = (np.arange(6, dtype=np.uint8) * 40).reshape(2, 3)
    exif = Image.Exif()
    exif[0x0112] = 6
    np.testing.assert_array_equal(prep(_png(tmp_path / "side.png", side, exif=exif), (1, 3, 2))[0], np.rot90(side, -1))
    # 4. the centre H x W at scale 1 (a 4x2 image for a 2x2 model: columns 1 and 2), and the centre of a
    # 30x10 image scaled by 0.8 to cover 8x8: columns 10..20, all of them in the green band
    wide = np.arange(8, dtype=np.uint8).reshape(2, 4)
    assert prep(wide, (1, 2, 2)).tolist() == [[[1, 2], [5, 6]]]
    bands = np.zeros((10, 30, 3), np.uint8)
    bands[:, :9, 0], bands[:, 9:21, 1], bands[:, 21:, 2] = 255, 255, 255
    assert (prep(_png(tmp_path / "bands.png", bands), (3, 8, 8)) == np.array([0, 255, 0])[:, None, None]).all()
    assert (prep(bands.T.transpose(1, 2, 0).copy(), (1, 8, 8)) == 150).all()  # 10x30, tall: rows 10..20
    # odd sizes, up and down, a Pillow image as well as a file
    for h, w in ((1, 1), (5, 3), (17, 41), (64, 9)):
        flat = np.full((h, w, 3), (30, 60, 90), np.uint8)
        for source in (flat, Image.fromarray(flat), _png(tmp_path / f"{h}x{w}.png", flat)):
            out = prep(source, (3, 8, 8))
            assert out.shape == (3, 8, 8) and out.dtype == np.uint8 and out.flags.c_contiguous
            assert (out == np.array([30, 60, 90], np.uint8)[:, None, None]).all()


@pytest.mark.parametrize(
    ("image", "message"),
    [
        (np.zeros((8, 8), np.float32), r"float32 .*\(image \* 255\)\.round\(\)\.astype\(np\.uint8\)"),
        (np.zeros((8, 8), np.int64), r"image\.astype\(np\.uint8\)"),
        (np.zeros((3, 8, 8), np.uint8), r"channels first\? pass image\.transpose\(1, 2, 0\)"),
        (np.zeros((8, 8, 5), np.uint8), r"expected \(H, W\) grey or \(H, W, C\)"),
        ([[0, 1]], "expected a file path, a Pillow image or a numpy array, got list"),
        ("nowhere.png", "image file nowhere.png does not exist"),
    ],
)
def test_an_image_the_rule_cannot_take_is_named(image, message):
    with pytest.raises(el.EdgeInputError, match=message):
        el.prepare_image(image, (1, 8, 8))


def test_the_rule_refuses_float_files_and_models_it_does_not_cover(tmp_path):
    from PIL import Image

    Image.fromarray(np.zeros((4, 4), np.float32)).save(tmp_path / "float.tif")
    with pytest.raises(el.EdgeInputError, match=r"float.tif: a 32-bit float image \(Pillow mode F\)"):
        el.prepare_image(tmp_path / "float.tif", (1, 4, 4))
    with pytest.raises(el.EdgeInputError, match=r"1- \(L\) or 3-channel \(RGB\) models; this one takes 2"):
        el.prepare_image(np.zeros((4, 4), np.uint8), (2, 4, 4))


@pytest.mark.parametrize(
    ("array", "hint"),
    [
        (np.zeros((3, 1, 8, 8), np.float32), "astype"),
        (np.zeros((3, 3, 8, 8), np.uint8), "3 channels, the model takes 1"),
        (np.zeros((3, 8, 8, 1), np.uint8), "channels-last"),
        (np.zeros((3, 8, 8), np.uint8), r"images\[:, None\]"),
        (np.zeros((3, 1, 16, 16), np.uint8), "got uint8 array of shape"),
    ],
)
def test_wrong_input_is_refused_naming_the_expected_input(models, tmp_path, array, hint):
    path = tmp_path / "bad.npy"
    np.save(path, array)
    with pytest.raises(el.EdgeInputError, match=r"expected uint8 images of shape \(N, 1, 8, 8\)") as err:
        el.label_images(models["v4"], path, tmp_path / "out")
    assert re.search(hint, str(err.value))


def test_cli_errors_and_thresholds(models, batch, tmp_path, capsys):
    assert el.main([str(models["v4"]), str(batch), "--out", str(tmp_path), "--threshold", "0.5", "0.5"]) == 2
    assert "got 2 values for a model with 4 classes" in capsys.readouterr().err
    assert el.main([str(models["v4"]), str(tmp_path / "missing.npy"), "--out", str(tmp_path)]) == 2
    assert "does not exist" in capsys.readouterr().err
    text = tmp_path / "labels.txt"
    text.write_text("x")
    assert el.main([str(models["v4"]), str(text), "--out", str(tmp_path)]) == 2
    assert ".npy or .npz" in capsys.readouterr().err
    assert el.main([str(models["v4"]), str(batch), "--out", str(tmp_path / "ok"), "--threads", "1"]) == 0
    assert "images/s" in capsys.readouterr().out


def test_a_model_file_that_is_not_onnx_is_refused_in_one_line(models, batch, tmp_path, capsys):
    """onnxruntime's InvalidProtobuf / Fail came through as a traceback."""
    from mobile_export.__main__ import main as mobile_export_main
    from tests.conftest import one_line_error

    text = tmp_path / "model.onnx"
    text.write_text("not a model\n")
    truncated = tmp_path / "model.ort"
    truncated.write_bytes(models["v4"].read_bytes()[:1000])
    empty = tmp_path / "empty.onnx"
    empty.write_bytes(b"")
    for path in (text, truncated, empty):
        assert mobile_export_main(["label", str(path), str(batch), "--out", str(tmp_path / "out")]) == 2
        line = one_line_error(capsys.readouterr().err, "edge_label: error:")
        assert f"{path} is not an ONNX model onnxruntime can load (" in line, line
        assert "export the model with `fedml-ssfl export RUN_DIR`" in line
    assert "(an empty file)" in line
    assert not (tmp_path / "out").exists()


def test_an_output_path_that_is_a_file_is_refused_in_one_line(models, batch, tmp_path, capsys):
    from tests.conftest import one_line_error

    blocker = tmp_path / "labels"
    blocker.write_text("the user's file\n")
    for out in (blocker, blocker / "sub"):
        assert el.main([str(models["v4"]), str(batch), "--out", str(out)]) == 2
        line = one_line_error(capsys.readouterr().err, "edge_label: error:")
        assert f"output folder {out} cannot be created ({blocker} is a file, not a folder)" in line, line
    assert blocker.read_text() == "the user's file\n"


# ---------------------------------------------------------------------------------------------
# inputs bounded and named (issue 29): each row under an address-space limit


def _object_npy(tmp: Path) -> Path:
    path = tmp / "objects.npy"
    np.save(path, np.array([{"a": 1}, None], dtype=object), allow_pickle=True)
    return path


def _npy_claiming_5_tib(tmp: Path) -> Path:
    path = tmp / "claims.npy"
    with open(path, "wb") as fh:
        np.lib.format.write_array_header_1_0(fh, {"descr": "|u1", "fortran_order": False, "shape": (10**10, 1, 8, 8)})
        fh.write(bytes(64))
    return path


def _npz_bomb(tmp: Path) -> Path:
    import zipfile

    from tests.conftest import write_npz_member

    path = tmp / "bomb.npz"
    with zipfile.ZipFile(path, "w", zipfile.ZIP_DEFLATED) as zf:
        write_npz_member(zf, "images", (4 * 2**20, 1, 8, 8))  # 256 MiB of zeros, 260 KB deflated
    return path


def _png_folder(width: int, height: int, cut: int = 0, palette: bool = False):
    def make(tmp: Path) -> Path:
        from tests.conftest import write_png

        write_png(tmp / "photos" / "a.png", 8, 8)
        write_png(tmp / "photos" / "b.png", width, height, cut=cut, palette=palette)
        return tmp / "photos"

    return make


def _model_of_3_gib(tmp: Path) -> Path:
    path = tmp / "huge.onnx"
    with open(path, "wb") as fh:
        fh.truncate(3 * 2**30)  # sparse: no disk, no memory
    return path


EDGE_CASES = [
    # (id, make the input, make the model or None (the exported one), exit status, the error's text)
    ("an object .npy", _object_npy, None, 2, "objects.npy: the array is an object array (pickled Python objects"),
    ("a .npy claiming 5 TiB", _npy_claiming_5_tib, None, 2, "claims.npy: the array's header claims shape"),
    ("an npz bomb", _npz_bomb, None, 2, "bomb.npz: key 'images' (4194304, 1, 8, 8) of uint8 would take 256.0 MiB"),
    ("a 12000x12000 PNG", _png_folder(12000, 12000, palette=True), None, 2, "b.png: 12000x12000 pixels, more than"),
    ("a 400-megapixel PNG", _png_folder(20000, 20000), None, 2, "b.png: more pixels than Pillow opens"),
    ("a truncated image", _png_folder(64, 64, cut=30), None, 2, "b.png: unreadable or corrupt image"),
    ("a truncated 8x8 image", _png_folder(8, 8, cut=24), None, 2, "b.png: unreadable or corrupt image"),
    ("a 3 GiB model file", None, _model_of_3_gib, 2, "huge.onnx has 3.0 GiB, more than the 2 GiB an ONNX model"),
]


def test_no_input_of_the_edge_labeller_can_exhaust_memory(models, batch, tmp_path):
    """`edge_label.py MODEL INPUT --out DIR` per row, with 400 MiB of address space to spare: one line, exit 2."""
    from tests.conftest import run_bounded

    calls = []
    for n, (_, make_input, make_model, _, _) in enumerate(EDGE_CASES):
        tmp = tmp_path / f"case{n}"
        tmp.mkdir()
        source = make_input(tmp) if make_input else batch
        model = make_model(tmp) if make_model else models["v4"]
        argv = [str(model), str(source), "--out", str(tmp / "out")]
        calls.append(f"__import__('mobile_export.edge_label').edge_label.main({argv!r})")
    preload = ["numpy", "onnxruntime", "PIL.Image", "PIL.PngImagePlugin", "mobile_export.edge_label"]
    for (name, _, _, code, expected), res in zip(EDGE_CASES, run_bounded(preload, calls)):
        assert res.code == code, (name, res.err[-3000:])
        line = res.err.strip()
        assert line.startswith("edge_label: error: ") and "\n" not in line and expected in line, (name, res.err)
        assert 0 <= res.peak_growth < 64 * 2**20, (name, res.peak_growth)  # refused before anything was decoded
    assert not any((tmp_path / f"case{n}" / "out").exists() for n in range(len(EDGE_CASES)))


def test_a_full_disk_under_the_outputs_is_one_line_naming_the_file(models, batch, small_disk, capsys):
    disk = small_disk("8k")
    assert el.main([str(models["v4"]), str(batch), "--out", str(disk / "labels")]) == 1
    line = capsys.readouterr().err.strip()
    assert line.startswith(f"edge_label: error: {disk / 'labels' / 'pseudo_labels.'}") and "\n" not in line, line
    assert line.endswith(": No space left on device; free disk space, or pass --out another folder"), line
