"""Dataset loaders: shipped sets, the synthetic set, and each real on-disk format written tiny."""

from __future__ import annotations

import gzip
import pickle
import struct
from pathlib import Path

import numpy as np
import pytest
import torch

from fedml_ssfl.data import ImageDataset, available_datasets, load_dataset
from fedml_ssfl.data.datasets import read_idx

REAL = ["cifar10", "cifar100", "svhn", "mnist", "fashion_mnist", "emnist_balanced"]


def _check_tensors(ds: ImageDataset, shape: tuple[int, int, int], num_classes: int) -> None:
    for images, labels in ((ds.train_images, ds.train_labels), (ds.test_images, ds.test_labels)):
        assert images.dtype == torch.uint8 and images.is_contiguous()
        assert tuple(images.shape[1:]) == shape
        assert labels.dtype == torch.int64 and labels.shape == (images.shape[0],)
        assert 0 <= int(labels.min()) and int(labels.max()) < num_classes
    assert ds.num_classes == num_classes == len(ds.class_names)
    assert len(ds.mean) == len(ds.std) == shape[0]
    assert ds.in_channels == shape[0] and ds.image_size == shape[1]


# --------------------------------------------------------------------------------------------
# shipped and synthetic
# --------------------------------------------------------------------------------------------


@pytest.fixture(scope="module")
def mnist5k() -> ImageDataset:
    return load_dataset("mnist5k")


def test_mnist5k_shapes_and_fixed_split(mnist5k: ImageDataset) -> None:
    _check_tensors(mnist5k, (1, 28, 28), 10)
    assert len(mnist5k.train_labels) == 4000 and len(mnist5k.test_labels) == 1000
    assert not mnist5k.flip
    assert int(mnist5k.train_images.max()) > 200
    # stratified: every class has about 20% of its samples in the test set
    train_counts = torch.bincount(mnist5k.train_labels, minlength=10).double()
    test_counts = torch.bincount(mnist5k.test_labels, minlength=10).double()
    frac = test_counts / (train_counts + test_counts)
    assert torch.all((frac - 0.2).abs() < 0.01)
    other = load_dataset("mnist5k", seed=123)
    assert torch.equal(other.test_images, mnist5k.test_images)
    assert torch.equal(other.test_labels, mnist5k.test_labels)
    mean = mnist5k.train_images.double().div(255).mean().item()
    assert abs(mnist5k.mean[0] - mean) < 1e-6


def test_digits() -> None:
    ds = load_dataset("digits")
    _check_tensors(ds, (1, 8, 8), 10)
    assert len(ds.train_labels) + len(ds.test_labels) == 1797
    assert len(ds.test_labels) == round(0.2 * 1797)
    assert int(ds.train_images.max()) == 255 and not ds.flip
    again = load_dataset("digits", seed=7)
    assert torch.equal(again.test_images, ds.test_images)


def test_synthetic_deterministic_and_learnable() -> None:
    a = load_dataset("synthetic", seed=3, num_samples=200, num_test=50, num_classes=4, shape=(1, 8, 8))
    b = load_dataset("synthetic", seed=3, num_samples=200, num_test=50, num_classes=4, shape=(1, 8, 8))
    c = load_dataset("synthetic", seed=4, num_samples=200, num_test=50, num_classes=4, shape=(1, 8, 8))
    _check_tensors(a, (1, 8, 8), 4)
    assert torch.equal(a.train_images, b.train_images) and torch.equal(a.test_labels, b.test_labels)
    assert not torch.equal(a.train_images, c.train_images)
    # nearest class mean (from train) classifies the test set well above chance
    x_tr, x_te = a.train_images.flatten(1).float(), a.test_images.flatten(1).float()
    means = torch.stack([x_tr[a.train_labels == k].mean(0) for k in range(4)])
    pred = torch.cdist(x_te, means).argmin(1)
    assert (pred == a.test_labels).float().mean() > 0.9


def test_synthetic_default_shape() -> None:
    ds = load_dataset("synthetic", num_samples=40, num_test=20)
    _check_tensors(ds, (3, 32, 32), 10)
    assert len(ds.train_labels) == 40


def test_unknown_name_suggests_closest() -> None:
    with pytest.raises(ValueError, match="cifar10") as err:
        load_dataset("cifar-10")
    assert "Did you mean" in str(err.value) and "mnist5k" in str(err.value)


def test_unknown_option() -> None:
    with pytest.raises(ValueError, match="per_class_limit"):
        load_dataset("mnist5k", per_class_limit=3)


def test_available() -> None:
    assert {"mnist5k", "digits", "synthetic", *REAL} <= set(available_datasets())


# --------------------------------------------------------------------------------------------
# tiny files in the real on-disk formats
# --------------------------------------------------------------------------------------------


def _pixels(rng: np.random.Generator, n: int, *shape: int) -> np.ndarray:
    return rng.integers(0, 256, size=(n, *shape), dtype=np.uint8)


def _dump(path: Path, obj: dict) -> None:
    with open(path, "wb") as f:
        pickle.dump(obj, f)


def test_cifar10(tmp_path: Path) -> None:
    rng = np.random.default_rng(0)
    folder = tmp_path / "cifar-10-batches-py"
    folder.mkdir()
    batches = []
    for i in range(1, 6):
        x = _pixels(rng, 4, 3, 32, 32)
        y = [int(v) for v in rng.integers(0, 10, 4)]
        batches.append((x, y))
        _dump(folder / f"data_batch_{i}", {b"data": x.reshape(4, -1), b"labels": y})
    x_test = _pixels(rng, 10, 3, 32, 32)
    x_test[0, 2, 5, 7] = 201  # blue channel, row 5, column 7
    _dump(folder / "test_batch", {b"data": x_test.reshape(10, -1), b"labels": list(range(10))})
    _dump(folder / "batches.meta", {b"label_names": [f"c{i}".encode() for i in range(10)]})
    ds = load_dataset("cifar10", root=tmp_path)
    _check_tensors(ds, (3, 32, 32), 10)
    assert ds.flip and ds.class_names[3] == "c3" and len(ds.train_labels) == 20
    assert int(ds.test_images[0, 2, 5, 7]) == 201
    assert torch.equal(ds.train_images[4:8], torch.from_numpy(batches[1][0]))
    assert ds.train_labels[4:8].tolist() == batches[1][1]
    assert ds.mean == (0.4914, 0.4822, 0.4465)


class _Pwned:
    def __init__(self, path):
        self.path = str(path)

    def __reduce__(self):
        return (open, (self.path, "w"))


def test_a_crafted_cifar_batch_runs_nothing_and_is_named(tmp_path: Path) -> None:
    import pickle

    rng = np.random.default_rng(0)
    folder = tmp_path / "cifar-10-batches-py"
    folder.mkdir()
    for i in range(1, 6):
        _dump(folder / f"data_batch_{i}", {b"data": _pixels(rng, 2, 3, 32, 32).reshape(2, -1), b"labels": [0, 1]})
    _dump(folder / "test_batch", {b"data": _pixels(rng, 2, 3, 32, 32).reshape(2, -1), b"labels": [0, 1]})
    marker = tmp_path / "pwned"
    (folder / "batches.meta").write_bytes(pickle.dumps({b"label_names": _Pwned(marker)}))
    with pytest.raises(ValueError, match=r"batches.meta: not a CIFAR python batch \(names (builtins|io)\.open"):
        load_dataset("cifar10", root=tmp_path)
    assert not marker.exists()
    (folder / "batches.meta").write_bytes(pickle.dumps({b"label_names": [b"a"] * 10})[:20])  # truncated
    with pytest.raises(ValueError, match="batches.meta: not a CIFAR python batch"):
        load_dataset("cifar10", root=tmp_path)


def test_cifar100(tmp_path: Path) -> None:
    rng = np.random.default_rng(1)
    folder = tmp_path / "cifar-100-python"
    folder.mkdir()
    x_train, x_test = _pixels(rng, 20, 3, 32, 32), _pixels(rng, 10, 3, 32, 32)
    y_train = [int(v) for v in rng.integers(0, 100, 20)]
    _dump(
        folder / "train",
        {b"data": x_train.reshape(20, -1), b"fine_labels": y_train, b"coarse_labels": [0] * 20},
    )
    _dump(folder / "test", {b"data": x_test.reshape(10, -1), b"fine_labels": [99] * 10})
    _dump(folder / "meta", {b"fine_label_names": [f"f{i}".encode() for i in range(100)]})
    ds = load_dataset("cifar100", root=str(tmp_path))
    _check_tensors(ds, (3, 32, 32), 100)
    assert torch.equal(ds.train_images, torch.from_numpy(x_train))
    assert ds.train_labels.tolist() == y_train and ds.class_names[99] == "f99"


def test_svhn(tmp_path: Path) -> None:
    from scipy.io import savemat

    rng = np.random.default_rng(2)
    for split, n in (("train", 20), ("test", 10)):
        x = rng.integers(0, 256, size=(32, 32, 3, n), dtype=np.uint8)
        x[3, 9, 1, 0] = 77  # row 3, column 9, green, first sample
        y = (np.arange(n) % 10 + 1).reshape(n, 1)  # labels 1..10, 10 meaning digit 0
        savemat(str(tmp_path / f"{split}_32x32.mat"), {"X": x, "y": y})
    ds = load_dataset("svhn", root=tmp_path)
    _check_tensors(ds, (3, 32, 32), 10)
    assert int(ds.train_images[0, 1, 3, 9]) == 77 and int(ds.test_images[0, 1, 3, 9]) == 77
    assert ds.train_labels[:10].tolist() == [1, 2, 3, 4, 5, 6, 7, 8, 9, 0]
    assert not ds.flip


def _write_idx(path: Path, array: np.ndarray, compress: bool) -> None:
    header = struct.pack(">BBBB", 0, 0, 0x08, array.ndim) + struct.pack(f">{array.ndim}i", *array.shape)
    payload = header + np.ascontiguousarray(array, dtype=np.uint8).tobytes()
    if compress:
        with gzip.open(f"{path}.gz", "wb") as f:
            f.write(payload)
    else:
        path.write_bytes(payload)


def _write_idx_set(
    folder: Path, prefix: str, train: int, test: int, num_classes: int, rng: np.random.Generator
) -> dict[str, np.ndarray]:
    """Train files gzip-compressed, test files plain: both forms must be accepted."""
    folder.mkdir(parents=True)
    arrays = {
        "train-images-idx3-ubyte": _pixels(rng, train, 28, 28),
        "train-labels-idx1-ubyte": (np.arange(train) % num_classes).astype(np.uint8),
        "t10k-images-idx3-ubyte": _pixels(rng, test, 28, 28),
        "t10k-labels-idx1-ubyte": (np.arange(test) % num_classes).astype(np.uint8),
    }
    for stem, array in arrays.items():
        name = stem.replace("t10k", "test") if prefix else stem
        _write_idx(folder / f"{prefix}{name}", array, compress=stem.startswith("train"))
    return arrays


@pytest.mark.parametrize(
    ("name", "subdir", "flip"), [("mnist", "MNIST", False), ("fashion_mnist", "FashionMNIST", True)]
)
def test_mnist_family(tmp_path: Path, name: str, subdir: str, flip: bool) -> None:
    arrays = _write_idx_set(tmp_path / subdir / "raw", "", 20, 10, 10, np.random.default_rng(3))
    ds = load_dataset(name, root=tmp_path)
    _check_tensors(ds, (1, 28, 28), 10)
    assert torch.equal(ds.train_images[:, 0], torch.from_numpy(arrays["train-images-idx3-ubyte"]))
    assert torch.equal(ds.test_images[:, 0], torch.from_numpy(arrays["t10k-images-idx3-ubyte"]))
    assert ds.train_labels.tolist() == list(np.arange(20) % 10)
    assert ds.flip is flip


def test_emnist_transposed_and_truncated(tmp_path: Path) -> None:
    folder = tmp_path / "EMNIST" / "raw"
    arrays = _write_idx_set(folder, "emnist-balanced-", 94, 47, 47, np.random.default_rng(4))
    stored = arrays["train-images-idx3-ubyte"]
    ds = load_dataset("emnist_balanced", root=tmp_path)
    _check_tensors(ds, (1, 28, 28), 47)
    assert ds.class_names[10] == "A" and ds.class_names[-1] == "t"
    assert len(ds.train_labels) == 94  # under the default limit of 2400 per class
    # stored transposed: pixel (row 2, column 5) of the image is stored at (5, 2)
    assert int(ds.train_images[0, 0, 2, 5]) == int(stored[0, 5, 2])
    assert torch.equal(ds.train_images[:, 0], torch.from_numpy(stored).transpose(1, 2))

    limited = load_dataset("emnist_balanced", root=tmp_path, per_class_limit=1)
    assert len(limited.train_labels) == 47
    assert torch.equal(limited.train_images, ds.train_images[:47])  # first come, first kept
    assert torch.bincount(limited.train_labels, minlength=47).max() == 1
    assert len(limited.test_labels) == 47


def test_read_idx_rejects_bad_magic(tmp_path: Path) -> None:
    path = tmp_path / "bad"
    path.write_bytes(b"\x01\x02\x03\x04" + b"\x00" * 8)
    with pytest.raises(ValueError, match="magic"):
        read_idx(path)


@pytest.mark.parametrize("name", REAL)
def test_missing_files_message(tmp_path: Path, name: str) -> None:
    with pytest.raises(FileNotFoundError) as err:
        load_dataset(name, root=tmp_path / "nowhere")
    message = str(err.value)
    assert name in message and "download: true" in message and "data_cache_dir" in message
    assert str(tmp_path / "nowhere") in message
    expected = {
        "cifar10": "data_batch_5",
        "cifar100": "meta",
        "svhn": "test_32x32.mat",
        "mnist": "t10k-labels-idx1-ubyte",
        "fashion_mnist": "train-images-idx3-ubyte",
        "emnist_balanced": "emnist-balanced-test-images-idx3-ubyte",
    }[name]
    assert expected in message


# --------------------------------------------------------------------------------------------
# damaged files and label counts: one line through the command line, naming the files
# --------------------------------------------------------------------------------------------


def _partition(root: Path, name: str) -> int:
    """``fedml-ssfl partition`` on dataset ``name`` read from ``root`` (it loads the data first)."""
    from fedml_ssfl.cli import main

    sets = [
        f"data_args.dataset={name}",
        f"data_args.data_cache_dir={root}",
        "data_args.num_server_labels=10",
        "train_args.client_num_in_total=2",
        "train_args.client_num_per_round=2",
    ]
    return main(["partition", *[a for s in sets for a in ("--set", s)], "--out", str(root / "p.png")])


def _write_real(root: Path, name: str, extra_train_labels: int = 0) -> Path:
    """Tiny files of dataset ``name`` under ``root``; the train labels get ``extra_train_labels`` more (or fewer).

    Returns the file holding the train labels.
    """
    from scipy.io import savemat

    rng = np.random.default_rng(5)
    n, k = 20, {"cifar100": 100, "emnist_balanced": 47}.get(name, 10)
    if name in ("mnist", "emnist_balanced"):
        subdir, prefix = ("MNIST", "") if name == "mnist" else ("EMNIST", "emnist-balanced-")
        folder = root / subdir / "raw"
        _write_idx_set(folder, prefix, n, 10, k, rng)
        labels = folder / f"{prefix}train-labels-idx1-ubyte.gz"
        _write_idx(labels.with_suffix(""), np.arange(n + extra_train_labels) % k, compress=True)
        return labels
    if name == "svhn":
        root.mkdir(parents=True, exist_ok=True)
        for split, m in (("train", n), ("test", 10)):
            y = (np.arange(m + (extra_train_labels if split == "train" else 0)) % 10 + 1).reshape(-1, 1)
            savemat(str(root / f"{split}_32x32.mat"), {"X": _pixels(rng, m, 32, 32, 3).transpose(1, 2, 3, 0), "y": y})
        return root / "train_32x32.mat"
    if name == "npz":
        from fedml_ssfl.data.local_files import write_npz

        root.mkdir(parents=True, exist_ok=True)
        write_npz(root / "test.npz", _pixels(rng, 10, 1, 8, 8), np.arange(10) % k)
        np.savez(root / "train.npz", images=_pixels(rng, n, 8, 8), labels=np.arange(n + extra_train_labels) % k)
        return root / "train.npz"
    folder, label_key = {
        "cifar10": (root / "cifar-10-batches-py", b"labels"),
        "cifar100": (root / "cifar-100-python", b"fine_labels"),
    }[name]
    folder.mkdir(parents=True)
    train = ["data_batch_3"] if name == "cifar10" else ["train"]
    for stem in [f"data_batch_{i}" for i in range(1, 6)] + ["test_batch"] if name == "cifar10" else ["train", "test"]:
        m = n + (extra_train_labels if stem in train else 0)
        _dump(folder / stem, {b"data": _pixels(rng, n, 3 * 32 * 32), label_key: [i % k for i in range(m)]})
    meta = ("batches.meta", b"label_names") if name == "cifar10" else ("meta", b"fine_label_names")
    _dump(folder / meta[0], {meta[1]: [f"c{i}".encode() for i in range(k)]})
    return folder / train[0]


@pytest.mark.parametrize("extra", [5, -5], ids=["more_labels", "fewer_labels"])
@pytest.mark.parametrize("name", ["mnist", "emnist_balanced", "cifar10", "cifar100", "svhn", "npz"])
def test_label_count_mismatch_is_refused_at_load_naming_the_files_and_counts(tmp_path, capsys, name, extra):
    """More labels than images failed mid-training; fewer dropped images silently (EMNIST's per-class cut)."""
    from tests.conftest import one_line_error

    labels = _write_real(tmp_path, name, extra_train_labels=extra)
    assert _partition(tmp_path, name) == 2
    line = one_line_error(capsys.readouterr().err, "fedml-ssfl: error:")
    if name in ("mnist", "emnist_balanced"):
        images = labels.parent / labels.name.replace("labels-idx1", "images-idx3")
        assert f"{labels} holds {20 + extra} labels but {images} holds 20 images" in line, line
        assert "delete both and download the dataset again" in line
    elif name == "npz":
        assert f"{labels}: key 'labels' has shape ({20 + extra},); expected (20,), one label per image" in line, line
    else:
        assert f"{labels}: holds {20 + extra} labels but 20 images" in line, line
        assert "download the dataset again" in line
    assert not (tmp_path / "p.png").exists()


@pytest.mark.parametrize("name", ["svhn", "cifar10", "mnist"])
@pytest.mark.parametrize("cut", [0.5, 100], ids=["half", "100_bytes"])
def test_a_truncated_dataset_file_is_one_line_naming_it(tmp_path, capsys, name, cut):
    """SVHN's .mat reader let scipy's OSError / IndexError through; a cut .gz raised EOFError."""
    from tests.conftest import one_line_error

    path = _write_real(tmp_path, name)
    if name == "mnist":
        path = path.parent / "train-images-idx3-ubyte.gz"
    data = path.read_bytes()
    path.write_bytes(data[: int(len(data) * cut) if cut < 1 else int(cut)])
    assert _partition(tmp_path, name) == 2
    line = one_line_error(capsys.readouterr().err, "fedml-ssfl: error:")
    what = {"svhn": "not an SVHN .mat file", "cifar10": "not a CIFAR python batch", "mnist": "not a readable gzip"}
    assert f"{path}: {what[name]}" in line, line
    assert "download the dataset again" in line


def test_an_svhn_mat_without_its_arrays_is_named(tmp_path, capsys):
    from scipy.io import savemat

    from tests.conftest import one_line_error

    path = _write_real(tmp_path, "svhn")
    savemat(str(path), {"X": _pixels(np.random.default_rng(0), 4, 32, 32, 3)})  # no y; X the wrong way round
    assert _partition(tmp_path, "svhn") == 2
    line = one_line_error(capsys.readouterr().err, "fedml-ssfl: error:")
    assert f"{path}: no 'y' array" in line, line
    savemat(str(path), {"X": _pixels(np.random.default_rng(0), 4, 32, 32, 3), "y": np.ones((4, 1))})
    assert _partition(tmp_path, "svhn") == 2
    line = one_line_error(capsys.readouterr().err, "fedml-ssfl: error:")
    assert f"{path}: 'X' has shape (4, 32, 32, 3), not (32, 32, 3, N)" in line, line
