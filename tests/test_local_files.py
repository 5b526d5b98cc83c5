"""A user's own data: the npz and image-folder readers, write_npz, the npz / folder datasets, register_dataset."""

from __future__ import annotations

import logging
from pathlib import Path

import numpy as np
import pytest
import torch
from PIL import Image

from fedml_ssfl.config import ConfigError, load_config
from fedml_ssfl.data import (
    DataFormatError,
    ImageDataset,
    LocalImages,
    available_datasets,
    load_dataset,
    read_image_folder,
    read_local_images,
    read_npz,
    register_dataset,
    write_npz,
)
from fedml_ssfl.data import datasets as datasets_module
from fedml_ssfl.experiment import load_experiment_dataset
from tests.conftest import SMALL

RNG = np.random.default_rng(0)


def _pixels(*shape: int) -> np.ndarray:
    return RNG.integers(0, 256, size=shape, dtype=np.uint8)


def _npz(path: Path, **arrays) -> Path:
    np.savez(path, **arrays)
    return path


def _png(path: Path, pixels: np.ndarray, mode: str | None = None, fmt: str | None = None) -> Path:
    path.parent.mkdir(parents=True, exist_ok=True)
    img = Image.fromarray(pixels)
    if mode is not None:
        img = img.convert(mode)
    img.save(path, format=fmt)
    return path


def _check(data: LocalImages, n: int, c: int, h: int, w: int) -> None:
    assert data.images.dtype == torch.uint8 and data.images.is_contiguous()
    assert tuple(data.images.shape) == (n, c, h, w)
    assert data.labels.dtype == torch.int64 and tuple(data.labels.shape) == (n,)


@pytest.fixture
def restore_registry():
    saved = dict(datasets_module._REGISTRY)
    yield
    datasets_module._REGISTRY.clear()
    datasets_module._REGISTRY.update(saved)


# --------------------------------------------------------------------------------------------
# read_npz: happy paths
# --------------------------------------------------------------------------------------------


def test_npz_grayscale_unlabeled(tmp_path: Path) -> None:
    x = _pixels(5, 6, 7)
    data = read_npz(_npz(tmp_path / "a.npz", images=x))
    _check(data, 5, 1, 6, 7)
    assert torch.equal(data.images[:, 0], torch.from_numpy(x))
    assert data.labels.tolist() == [-1] * 5 and data.num_labeled == 0 and len(data) == 5
    assert data.ids is None and data.class_names is None and data.source == str(tmp_path / "a.npz")


def test_npz_rgb_labels_ids_class_names(tmp_path: Path) -> None:
    x = _pixels(4, 5, 5, 3)
    path = _npz(
        tmp_path / "b.npz",
        images=x,
        labels=np.array([0, -1, 2, 1], dtype=np.int32),
        ids=np.array([10, 11, 12, 13]),
        class_names=np.array(["cat", "dog", "eel"]),
    )
    data = read_npz(path, num_classes=3)
    _check(data, 4, 3, 5, 5)
    assert torch.equal(data.images, torch.from_numpy(x).permute(0, 3, 1, 2))
    assert data.labels.tolist() == [0, -1, 2, 1] and data.num_labeled == 3
    assert data.ids == ["10", "11", "12", "13"] and data.class_names == ["cat", "dog", "eel"]


def test_npz_channel_axis_of_one_and_string_ids(tmp_path: Path) -> None:
    data = read_npz(_npz(tmp_path / "c.npz", images=_pixels(2, 4, 4, 1), ids=np.array(["a", "b"])))
    _check(data, 2, 1, 4, 4)
    assert data.ids == ["a", "b"]


def test_npz_opaque_rgba_drops_alpha(tmp_path: Path) -> None:
    x = _pixels(2, 4, 4, 4)
    x[..., 3] = 255
    data = read_npz(_npz(tmp_path / "d.npz", images=x))
    assert torch.equal(data.images, torch.from_numpy(x[..., :3]).permute(0, 3, 1, 2))


def test_npz_unknown_key_is_logged(tmp_path: Path, caplog: pytest.LogCaptureFixture) -> None:
    with caplog.at_level(logging.WARNING):
        read_npz(_npz(tmp_path / "e.npz", images=_pixels(2, 4, 4), label=np.zeros(2, np.int64)))
    assert "'label'" in caplog.text and "did you mean 'labels'" in caplog.text


# --------------------------------------------------------------------------------------------
# read_npz: every refusal names the file, the key and the fix
# --------------------------------------------------------------------------------------------

NPZ_ERRORS = [
    ({"pixels": _pixels(2, 4, 4)}, ["no 'images' key", "pixels", "np.savez"]),
    ({"images": RNG.random((2, 4, 4)).astype(np.float32)}, ["'images'", "float32", "uint8 0..255"]),
    ({"images": _pixels(2, 4, 4).astype(np.int64)}, ["'images'", "int64", "astype(np.uint8)"]),
    ({"images": _pixels(2, 4)}, ["'images'", "(2, 4)", "(N, H, W)"]),
    ({"images": _pixels(2, 3, 8, 8)}, ["'images'", "1, 3 or 4 channels", "transpose(0, 2, 3, 1)"]),
    ({"images": _pixels(0, 4, 4)}, ["'images'", "N = 0"]),
    ({"images": _pixels(2, 4, 4, 4)}, ["'images'", "transparent", "RGB"]),
    ({"images": _pixels(2, 4, 4), "labels": np.array([0, 1, 1])}, ["'labels'", "(3,)", "(2,)"]),
    ({"images": _pixels(2, 4, 4), "labels": np.array([0.0, 1.0])}, ["'labels'", "float64", "astype(np.int64)"]),
    ({"images": _pixels(2, 4, 4), "labels": np.array([0, -2])}, ["'labels'", "-2", "-1 (unlabeled)"]),
    (
        {"images": _pixels(2, 4, 4), "labels": np.array([0, 2]), "class_names": np.array(["a", "b"])},
        ["'labels'", "class 2", "len(class_names) is 2"],
    ),
    ({"images": _pixels(2, 4, 4), "ids": np.array(["a"])}, ["'ids'", "1 entries", "one id per image"]),
    ({"images": _pixels(2, 4, 4), "ids": np.array([0.5, 1.5])}, ["'ids'", "float64", "dtype=str"]),
    ({"images": _pixels(2, 4, 4), "class_names": np.array(["a", "a"])}, ["'class_names'", "'a' twice"]),
    ({"images": _pixels(2, 4, 4), "ids": np.array([{"x": 1}, {"y": 2}], dtype=object)}, ["'ids'", "object array"]),
]


@pytest.mark.parametrize("arrays, words", NPZ_ERRORS)
def test_npz_errors_name_file_key_and_fix(tmp_path: Path, arrays: dict, words: list[str]) -> None:
    path = tmp_path / "bad.npz"
    np.savez(path, **arrays)
    with pytest.raises(DataFormatError) as err:
        read_npz(path)
    message = str(err.value)
    assert "\n" not in message and str(path) in message
    for word in words:
        assert word in message


def test_npz_label_at_num_classes_refused(tmp_path: Path) -> None:
    path = _npz(tmp_path / "f.npz", images=_pixels(2, 4, 4), labels=np.array([0, 3]))
    assert read_npz(path, num_classes=4).labels.tolist() == [0, 3]
    with pytest.raises(DataFormatError, match=r"class 3 but num_classes is 3"):
        read_npz(path, num_classes=3)
    named = _npz(tmp_path / "g.npz", images=_pixels(2, 4, 4), class_names=np.array(["a", "b", "c"]))
    with pytest.raises(DataFormatError, match=r"'class_names' lists 3 classes but num_classes is 2") as err:
        read_npz(named, num_classes=2)
    assert str(named) in str(err.value)


def test_npz_missing_and_not_a_zip(tmp_path: Path) -> None:
    with pytest.raises(DataFormatError, match="file not found") as err:
        read_npz(tmp_path / "nope.npz")
    assert str(tmp_path / "nope.npz") in str(err.value)
    np.save(tmp_path / "plain.npy", _pixels(2, 4, 4))
    fake = tmp_path / "fake.npz"
    fake.write_bytes((tmp_path / "plain.npy").read_bytes())
    with pytest.raises(DataFormatError, match="not an .npz archive") as err:
        read_npz(fake)
    assert str(fake) in str(err.value) and "np.savez" in str(err.value)


def test_write_npz_round_trip(tmp_path: Path) -> None:
    for c in (1, 3):
        images = torch.from_numpy(_pixels(6, c, 5, 5))
        labels = torch.tensor([0, 1, -1, 2, -1, 0])
        path = write_npz(tmp_path / "silos" / f"c{c}.npz", images, labels, ids=range(6), class_names=["a", "b", "c"])
        back = read_npz(path)
        assert torch.equal(back.images, images) and torch.equal(back.labels, labels)
        assert back.ids == [str(i) for i in range(6)] and back.class_names == ["a", "b", "c"]
        with np.load(path) as raw:  # the documented layout, not NCHW
            assert raw["images"].shape == ((6, 5, 5) if c == 1 else (6, 5, 5, 3))
    minimal = read_npz(write_npz(tmp_path / "m.npz", images))
    assert minimal.labels.tolist() == [-1] * 6 and minimal.ids is None
    assert sorted(p.name for p in tmp_path.iterdir()) == ["m.npz", "silos"]  # no temp file left


def test_write_npz_refuses_bad_arrays_and_writes_nothing(tmp_path: Path) -> None:
    with pytest.raises(DataFormatError, match="'labels'"):
        write_npz(tmp_path / "x.npz", torch.zeros(3, 1, 4, 4, dtype=torch.uint8), labels=[0, 1])
    with pytest.raises(DataFormatError, match=r"\(N, C, H, W\)"):
        write_npz(tmp_path / "x.npz", torch.zeros(3, 4, 4, dtype=torch.uint8))
    assert list(tmp_path.iterdir()) == []


# --------------------------------------------------------------------------------------------
# read_image_folder
# --------------------------------------------------------------------------------------------


def test_folder_mixed_labeled_and_unlabeled_grayscale(tmp_path: Path) -> None:
    root = tmp_path / "silo"
    _png(root / "u2.png", _pixels(6, 6))
    _png(root / "U1.PNG", _pixels(6, 6))
    _png(root / "zebra" / "z.bmp", _pixels(6, 6), fmt="BMP")
    _png(root / "ant" / "b.png", _pixels(6, 6))
    _png(root / "ant" / "a.gif", _pixels(6, 6), fmt="GIF")  # palette mode, grey
    _png(root / "ant" / "c.png", _pixels(6, 6, 3), mode="1")  # bilevel
    (root / "ant" / ".hidden.png").write_bytes(b"not an image")
    (root / "ant" / "notes.txt").write_text("skipped")
    (root / ".git").mkdir()
    data = read_image_folder(root)
    _check(data, 6, 1, 6, 6)
    assert data.ids == ["U1.PNG", "u2.png", "ant/a.gif", "ant/b.png", "ant/c.png", "zebra/z.bmp"]
    assert data.labels.tolist() == [-1, -1, 0, 0, 0, 1]
    assert data.class_names == ["ant", "zebra"]
    assert set(data.images[4].unique().tolist()) <= {0, 255}


def test_folder_rgb_jpeg_and_class_names_order(tmp_path: Path) -> None:
    root = tmp_path / "rgb"
    x = _pixels(8, 8, 3)
    _png(root / "cat" / "1.png", x)
    _png(root / "dog" / "1.JPG", _pixels(8, 8, 3), fmt="JPEG")
    opaque = _pixels(8, 8, 4)
    opaque[..., 3] = 255
    _png(root / "dog" / "2.png", opaque)  # RGBA, fully opaque: alpha dropped
    data = read_image_folder(root, class_names=["dog", "bird", "cat"])
    _check(data, 3, 3, 8, 8)
    assert data.ids == ["cat/1.png", "dog/1.JPG", "dog/2.png"]
    assert data.labels.tolist() == [2, 0, 0] and data.class_names == ["dog", "bird", "cat"]
    assert torch.equal(data.images[0], torch.from_numpy(x).permute(2, 0, 1))


def test_folder_all_unlabeled(tmp_path: Path) -> None:
    for i in range(3):
        _png(tmp_path / f"{i}.png", _pixels(4, 4, 3))
    data = read_local_images(tmp_path)
    _check(data, 3, 3, 4, 4)
    assert data.labels.tolist() == [-1, -1, -1] and data.class_names is None


def _folder_error(tmp_path: Path, build, *words: str, **kwargs) -> None:
    root = tmp_path / "data"
    root.mkdir(parents=True)
    build(root)
    with pytest.raises(DataFormatError) as err:
        read_image_folder(root, **kwargs)
    message = str(err.value)
    assert "\n" not in message and str(root) in message
    for word in words:
        assert word in message, message


def test_folder_missing_or_a_file(tmp_path: Path) -> None:
    with pytest.raises(DataFormatError, match="folder not found") as err:
        read_image_folder(tmp_path / "absent")
    assert str(tmp_path / "absent") in str(err.value)
    (tmp_path / "f.png").write_bytes(b"")
    with pytest.raises(DataFormatError, match="not a folder"):
        read_image_folder(tmp_path / "f.png")


def test_folder_empty(tmp_path: Path) -> None:
    def build(root: Path) -> None:
        (root / "cls").mkdir()
        (root / "readme.txt").write_text("x")

    _folder_error(tmp_path, build, "no images found", ".png")


def test_folder_corrupt_image(tmp_path: Path) -> None:
    def build(root: Path) -> None:
        _png(root / "a" / "ok.png", _pixels(4, 4))
        (root / "a" / "broken.png").write_bytes(b"\x89PNG\r\n\x1a\n garbage")

    _folder_error(tmp_path, build, "broken.png", "unreadable or corrupt", "re-save")


def test_folder_mixed_sizes(tmp_path: Path) -> None:
    def build(root: Path) -> None:
        _png(root / "a" / "one.png", _pixels(4, 4))
        _png(root / "b" / "two.png", _pixels(5, 4))

    _folder_error(tmp_path, build, "a/one.png is 4x4", "b/two.png is 4x5", "resize")


def test_folder_mixed_grey_and_colour(tmp_path: Path) -> None:
    def build(root: Path) -> None:
        _png(root / "a" / "grey.png", _pixels(4, 4))
        _png(root / "a" / "colour.png", _pixels(4, 4, 3))

    _folder_error(tmp_path, build, "grayscale (a/grey.png)", "colour (a/colour.png)", "RGB")


def test_folder_transparent_and_16_bit(tmp_path: Path) -> None:
    def transparent(root: Path) -> None:
        x = _pixels(4, 4, 4)
        x[0, 0, 3] = 0
        _png(root / "t.png", x)

    _folder_error(tmp_path / "1", transparent, "t.png", "transparent")

    def sixteen(root: Path) -> None:
        Image.fromarray(np.full((4, 4), 1000, dtype=np.uint16)).save(root / "deep.png")

    _folder_error(tmp_path / "2", sixteen, "deep.png", "8-bit")


def test_folder_nested_refused(tmp_path: Path) -> None:
    def build(root: Path) -> None:
        _png(root / "a" / "deeper" / "x.png", _pixels(4, 4))

    _folder_error(tmp_path, build, "a/deeper", "nested folder", "move its images up")


def test_folder_class_not_in_class_names_and_num_classes(tmp_path: Path) -> None:
    def build(root: Path) -> None:
        _png(root / "cat" / "1.png", _pixels(4, 4))
        _png(root / "owl" / "1.png", _pixels(4, 4))

    _folder_error(tmp_path / "1", build, "owl", "not in class_names", class_names=["cat", "dog"])
    _folder_error(tmp_path / "2", build, "2 class sub-folders", "num_classes is 1", num_classes=1)
    _folder_error(
        tmp_path / "3", build, "lists 3 classes but num_classes is 4", class_names=["cat", "owl", "x"], num_classes=4
    )


def test_npz_expected_class_names(tmp_path: Path) -> None:
    plain = _npz(tmp_path / "a.npz", images=_pixels(2, 4, 4), labels=np.array([1, 0]))
    assert read_npz(plain, class_names=["x", "y", "z"]).class_names == ["x", "y", "z"]
    with pytest.raises(DataFormatError, match="class 1 but len"):
        read_npz(plain, class_names=["x"])
    named = _npz(tmp_path / "b.npz", images=_pixels(2, 4, 4), class_names=np.array(["y", "x"]))
    with pytest.raises(DataFormatError, match=r"\['y', 'x'\] but \['x', 'y'\] is expected") as err:
        read_npz(named, class_names=["x", "y"])
    assert str(named) in str(err.value)


def test_read_local_images_dispatch(tmp_path: Path) -> None:
    path = tmp_path / "x.NPZ"
    with open(path, "wb") as f:  # np.savez appends ".npz" to a path without that exact suffix
        np.savez(f, images=_pixels(2, 4, 4), labels=np.array([1, 0]))
    data = read_local_images(path, num_classes=2, class_names=["a", "b"])
    assert data.labels.tolist() == [1, 0] and data.class_names == ["a", "b"]
    _png(tmp_path / "folder" / "b" / "0.png", _pixels(4, 4))
    assert read_local_images(tmp_path / "folder", class_names=["a", "b"], num_classes=2).labels.tolist() == [1]
    (tmp_path / "y.txt").write_text("x")
    with pytest.raises(DataFormatError, match="expected an .npz file or a folder"):
        read_local_images(tmp_path / "y.txt")
    with pytest.raises(DataFormatError, match="not found"):
        read_local_images(tmp_path / "absent")


# --------------------------------------------------------------------------------------------
# the npz and folder datasets
# --------------------------------------------------------------------------------------------


def _two_patterns(n: int, seed: int) -> tuple[np.ndarray, np.ndarray]:
    """8x8 grey images: class 0 bright on the left half, class 1 on the right; noise on top."""
    rng = np.random.default_rng(seed)
    labels = np.arange(n) % 2
    images = rng.integers(0, 60, size=(n, 8, 8))
    images[labels == 0, :, :4] += 180
    images[labels == 1, :, 4:] += 180
    return images.astype(np.uint8), labels


def _write_pattern_npz(root: Path, n_train: int = 40, n_test: int = 20) -> Path:
    names = np.array(["left", "right"])
    for split, n, seed in (("train", n_train, 1), ("test", n_test, 2)):
        images, labels = _two_patterns(n, seed)
        np.savez(root / f"{split}.npz", images=images, labels=labels, class_names=names)
    return root


def test_available_lists_npz_and_folder() -> None:
    assert {"npz", "folder", "mnist5k", "digits", "synthetic"} <= set(available_datasets())


def test_npz_dataset(tmp_path: Path) -> None:
    ds = load_dataset("npz", root=_write_pattern_npz(tmp_path))
    assert isinstance(ds, ImageDataset) and ds.name == "npz"
    assert tuple(ds.train_images.shape) == (40, 1, 8, 8) and tuple(ds.test_images.shape) == (20, 1, 8, 8)
    assert ds.num_classes == 2 and ds.class_names == ["left", "right"] and ds.flip is False
    assert ds.mean[0] == pytest.approx(ds.train_images.double().div(255).mean().item())
    assert load_dataset("npz", root=tmp_path, flip=True).flip is True


def test_npz_dataset_without_class_names(tmp_path: Path) -> None:
    """The class count is the number of distinct labels (issue 29), which must number the classes 0..d-1."""
    np.savez(tmp_path / "train.npz", images=_pixels(4, 6, 6, 3), labels=np.array([0, 1, 2, 1]))
    np.savez(tmp_path / "test.npz", images=_pixels(2, 6, 6, 3), labels=np.array([2, 0]))
    ds = load_dataset("npz", root=tmp_path)
    assert ds.num_classes == 3 and ds.class_names == [f"class_{k}" for k in range(3)] and ds.in_channels == 3
    np.savez(tmp_path / "train.npz", images=_pixels(4, 6, 6, 3), labels=np.array([0, 1, 4, 1]))
    with pytest.raises(ValueError, match=r"label 4 appears, but only 4 distinct labels do \(no sample has label 3\)"):
        load_dataset("npz", root=tmp_path)


@pytest.mark.parametrize(
    "train, test, words",
    [
        (
            {"images": _pixels(3, 4, 4), "labels": np.array([0, -1, 1])},
            {"images": _pixels(2, 4, 4), "labels": np.array([0, 1])},
            ["train.npz", "1 of 3 samples have no label", "data_args.local_data"],
        ),
        (
            {"images": _pixels(2, 4, 4), "labels": np.array([0, 1])},
            {"images": _pixels(2, 4, 4)},
            ["test.npz", "2 of 2 samples have no label"],
        ),
        (
            {"images": _pixels(2, 4, 4), "labels": np.array([0, 1])},
            {"images": _pixels(2, 4, 4, 3), "labels": np.array([0, 1])},
            ["train.npz", "1x4x4", "test.npz", "3x4x4", "same channels and size"],
        ),
        (
            {"images": _pixels(2, 4, 6), "labels": np.array([0, 1])},
            {"images": _pixels(2, 4, 6), "labels": np.array([0, 1])},
            ["train.npz", "4x6", "square"],
        ),
        (
            {"images": _pixels(2, 4, 4), "labels": np.array([0, 1]), "class_names": np.array(["a", "b"])},
            {"images": _pixels(2, 4, 4), "labels": np.array([0, 1]), "class_names": np.array(["b", "a"])},
            ["different class_names", "same list in both"],
        ),
        (
            {"images": _pixels(2, 4, 4), "labels": np.array([0, 1]), "class_names": np.array(["a", "b"])},
            {"images": _pixels(2, 4, 4), "labels": np.array([0, 2])},
            ["test.npz", "label 2"],
        ),
    ],
)
def test_npz_dataset_errors(tmp_path: Path, train: dict, test: dict, words: list[str]) -> None:
    np.savez(tmp_path / "train.npz", **train)
    np.savez(tmp_path / "test.npz", **test)
    with pytest.raises(DataFormatError) as err:
        load_dataset("npz", root=tmp_path)
    for word in words:
        assert word in str(err.value), str(err.value)


def test_npz_dataset_missing_file(tmp_path: Path) -> None:
    with pytest.raises(FileNotFoundError, match="train.npz not found.*data_cache_dir"):
        load_dataset("npz", root=tmp_path)


def test_folder_dataset(tmp_path: Path) -> None:
    for split, n in (("train", 3), ("test", 1)):
        for cls in ("cat", "dog"):
            for i in range(n):
                _png(tmp_path / split / cls / f"{i}.png", _pixels(6, 6, 3))
    ds = load_dataset("folder", root=tmp_path)
    assert ds.name == "folder" and ds.class_names == ["cat", "dog"] and ds.num_classes == 2
    assert tuple(ds.train_images.shape) == (6, 3, 6, 6) and tuple(ds.test_images.shape) == (2, 3, 6, 6)
    assert ds.train_labels.tolist() == [0, 0, 0, 1, 1, 1] and ds.test_labels.tolist() == [0, 1]
    assert len(ds.mean) == 3
    _png(tmp_path / "test" / "owl" / "0.png", _pixels(6, 6, 3))
    with pytest.raises(DataFormatError, match="'owl' is not in class_names"):
        load_dataset("folder", root=tmp_path)


def test_folder_dataset_unlabeled_and_missing(tmp_path: Path) -> None:
    _png(tmp_path / "train" / "cat" / "0.png", _pixels(4, 4))
    with pytest.raises(FileNotFoundError, match="test not found; expected train/<class>/<image>"):
        load_dataset("folder", root=tmp_path)
    _png(tmp_path / "test" / "cat" / "0.png", _pixels(4, 4))
    _png(tmp_path / "train" / "stray.png", _pixels(4, 4))
    with pytest.raises(DataFormatError, match="1 of 2 samples have no label"):
        load_dataset("folder", root=tmp_path)


# --------------------------------------------------------------------------------------------
# register_dataset
# --------------------------------------------------------------------------------------------


def _tiny_loader(root: Path, download: bool, seed: int, n: int = 4) -> ImageDataset:
    images = torch.zeros(n, 1, 8, 8, dtype=torch.uint8)
    labels = torch.arange(n) % 2
    return ImageDataset("tiny", images, labels, images.clone(), labels.clone(), 2, ["a", "b"], (0.5,), (0.25,), False)


def test_register_custom_loader(restore_registry: None) -> None:
    register_dataset("tiny", _tiny_loader)
    assert "tiny" in available_datasets()
    assert len(load_dataset("tiny", n=6).train_labels) == 6
    with pytest.raises(ValueError, match=r"does not take option\(s\) \['m'\]; it takes: n"):
        load_dataset("tiny", m=6)

    def star_loader(root, download, seed, **options):
        return _tiny_loader(root, download, seed, **options)

    register_dataset("star", star_loader)
    assert len(load_dataset("star", n=2).test_labels) == 2


def test_register_name_clash_and_overwrite(restore_registry: None) -> None:
    register_dataset("tiny", _tiny_loader)
    with pytest.raises(ValueError, match="'tiny' is already registered; pass overwrite=True"):
        register_dataset("tiny", _tiny_loader)
    with pytest.raises(ValueError, match="already registered"):
        register_dataset("digits", _tiny_loader)
    register_dataset("digits", _tiny_loader, overwrite=True)
    assert len(load_dataset("digits").train_labels) == 4


@pytest.mark.parametrize("name", ["", "has space", "9lives", "a/b", None])
def test_register_bad_name(restore_registry: None, name) -> None:
    with pytest.raises(ValueError, match="must be a non-empty string"):
        register_dataset(name, _tiny_loader)


def test_register_bad_loader_signature(restore_registry: None) -> None:
    with pytest.raises(TypeError, match="must be callable"):
        register_dataset("x", 42)
    with pytest.raises(TypeError, match=r"takes 2 positional parameter\(s\); it must take \(root, download, seed"):
        register_dataset("x", lambda root, download: None)
    with pytest.raises(TypeError, match="takes 0 positional"):
        register_dataset("x", lambda *, root, download, seed: None)
    assert "x" not in available_datasets()


def _bad_results():
    yield "a dict", lambda: {"train": 1}, "returned dict, not an ImageDataset"
    floats = _tiny_loader(Path(), False, 0)
    floats.train_images = floats.train_images.float()
    yield "float images", lambda: floats, "train_images must be a uint8 (N, C, H, W) tensor, got torch.float32"
    labels = _tiny_loader(Path(), False, 0)
    labels.test_labels = labels.test_labels.int()
    yield "int32 labels", lambda: labels, "test_labels must be an int64 (4,) tensor, got torch.int32"
    out_of_range = _tiny_loader(Path(), False, 0)
    out_of_range.train_labels = torch.tensor([0, 1, 2, 1])
    yield "label 2 of 2", lambda: out_of_range, "labels must lie in 0..1, got 0..2"
    count = _tiny_loader(Path(), False, 0)
    count.num_classes = 3
    yield "num_classes", lambda: count, "must be a positive int equal to len(class_names)"
    shapes = _tiny_loader(Path(), False, 0)
    shapes.test_images = torch.zeros(4, 3, 8, 8, dtype=torch.uint8)
    yield "shapes", lambda: shapes, "of one (C, H, W)"
    stats = _tiny_loader(Path(), False, 0)
    stats.mean = (0.1, 0.2, 0.3)
    yield "stats", lambda: stats, "one value per channel"


BAD_RESULTS = list(_bad_results())


@pytest.mark.parametrize("what, make, words", BAD_RESULTS, ids=[b[0] for b in BAD_RESULTS])
def test_bad_loader_result_refused(restore_registry: None, what: str, make, words: str) -> None:
    register_dataset("broken", lambda root, download, seed: make())
    with pytest.raises(ValueError) as err:
        load_dataset("broken")
    assert "dataset 'broken': the loader " in str(err.value) and words in str(err.value)


def test_registered_name_in_a_config(restore_registry: None, tmp_path: Path) -> None:
    register_dataset("tiny", _tiny_loader)
    cfg = load_config(None, [*SMALL, "data_args.dataset=tiny", f"common_args.output_dir={tmp_path}"])
    assert load_experiment_dataset(cfg).name == "tiny"
    typo = load_config(None, [*SMALL, "data_args.dataset=tinny", f"common_args.output_dir={tmp_path}"])
    with pytest.raises(ConfigError, match="Did you mean 'tiny'"):
        load_experiment_dataset(typo)


# --------------------------------------------------------------------------------------------
# end to end
# --------------------------------------------------------------------------------------------


def test_local_run_on_an_npz_dataset_learns(tmp_path: Path) -> None:
    from fedml_ssfl.runtime.local import run_local

    data = tmp_path / "data"
    data.mkdir()
    _write_pattern_npz(data)
    overrides = [
        *SMALL,
        "data_args.dataset=npz",
        f"data_args.data_cache_dir={data}",
        "data_args.num_server_labels=10",
        "train_args.client_num_in_total=2",
        "train_args.client_num_per_round=2",
        "train_args.batch_size=8",
        f"common_args.output_dir={tmp_path / 'runs'}",
    ]
    result = run_local(load_config(None, overrides), run_dir=tmp_path / "run")
    assert result.rounds_completed == 2
    assert result.final_acc >= 0.8  # chance is 0.5
