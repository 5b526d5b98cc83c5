"""FedML's own dataset files from a local folder: its MNIST cache (LEAF JSON) and FEMNIST (TFF's h5 files).

The files are written here, tiny, in the layouts FedML 0.9.6's loaders read
(``fedml/data/MNIST/data_loader.py``: ``MNIST/train/*.json``, ``MNIST/test/*.json`` with ``users``,
``num_samples``, ``user_data{x, y}``; ``fedml/data/FederatedEMNIST/data_loader.py``:
``fed_emnist_{train,test}.h5`` with ``examples/<writer>/{pixels, label}``).
"""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import pytest

from fedml_ssfl.data import load_dataset
from fedml_ssfl.data.fedml_files import read_fed_emnist_h5, read_leaf_json
from fedml_ssfl.data.local_files import DataFormatError


def _leaf(folder: Path, name: str, users: dict[str, tuple[np.ndarray, list[int]]]) -> Path:
    folder.mkdir(parents=True, exist_ok=True)
    doc = {
        "users": list(users),
        "num_samples": [len(y) for _, y in users.values()],
        "user_data": {
            u: {"x": np.round(x.reshape(len(x), -1) / 255.0, 6).tolist(), "y": y} for u, (x, y) in users.items()
        },
    }
    path = folder / name
    path.write_text(json.dumps(doc))
    return path


def _images(n: int, seed: int, side: int = 28) -> np.ndarray:
    return np.random.default_rng(seed).integers(0, 256, (n, side, side), dtype=np.uint8)


@pytest.fixture
def mnist_cache(tmp_path):
    """FedML's MNIST cache: two train files (three users), one test file."""
    a, b, c, t = _images(3, 0), _images(2, 1), _images(4, 2), _images(5, 3)
    _leaf(tmp_path / "MNIST" / "train", "all_data_0_train.json", {"f_0": (a, [0, 1, 2]), "f_1": (b, [3, 4])})
    _leaf(tmp_path / "MNIST" / "train", "all_data_1_train.json", {"f_2": (c, [5, 6, 7, 9])})
    _leaf(tmp_path / "MNIST" / "test", "all_data_0_test.json", {"f_0": (t, [9, 8, 7, 6, 5])})
    return tmp_path, np.concatenate([a, b, c]), t


def test_fedml_mnist_reads_leafs_json_users_exactly(mnist_cache):
    root, train, test = mnist_cache
    read = read_leaf_json(root / "MNIST" / "train")
    assert np.array_equal(read.images[:, 0], train)  # floats in [0, 1] back to the exact bytes
    assert read.labels.tolist() == [0, 1, 2, 3, 4, 5, 6, 7, 9] and read.users == ["f_0"] * 3 + ["f_1"] * 2 + ["f_2"] * 4
    ds = load_dataset("fedml_mnist", root=root)
    assert (
        ds.train_images.shape == (9, 1, 28, 28) and ds.num_classes == 10 and ds.test_labels.tolist() == [9, 8, 7, 6, 5]
    )
    assert np.array_equal(ds.test_images[:, 0].numpy(), test)
    assert ds.mean[0] == pytest.approx(train.mean() / 255.0)  # measured on its own images


def test_a_malformed_leaf_file_is_refused_in_one_line_naming_it(mnist_cache):
    root, _, _ = mnist_cache
    bad = root / "MNIST" / "train" / "all_data_1_train.json"
    doc = json.loads(bad.read_text())
    doc["num_samples"] = [3]
    bad.write_text(json.dumps(doc))
    with pytest.raises(
        DataFormatError, match=r"all_data_1_train\.json: user_data\['f_2'\] holds 4 samples, num_samples"
    ):
        load_dataset("fedml_mnist", root=root)
    bad.write_text("{not json")
    with pytest.raises(DataFormatError, match=r"all_data_1_train\.json: not a readable JSON file"):
        read_leaf_json(bad.parent)
    bad.write_text(json.dumps({"users": ["u"], "user_data": {"u": {"x": [[1.5] * 784], "y": [1]}}}))
    with pytest.raises(DataFormatError, match=r"pixel values in \[1.5, 1.5\].*floats in \[0, 1\]"):
        read_leaf_json(bad.parent)
    with pytest.raises(FileNotFoundError, match=r"'fedml_mnist': no LEAF \.json files .*MNIST\.zip"):
        load_dataset("fedml_mnist", root=root / "elsewhere")


def test_a_leaf_file_too_large_to_decode_is_refused_before_it_is_read(mnist_cache, monkeypatch):
    root, _, _ = mnist_cache
    monkeypatch.setenv("FEDML_SSFL_MAX_INPUT_BYTES", "1KiB")
    with pytest.raises(DataFormatError, match=r"all_data_0_train\.json: the LEAF file .* more than the 1\.0 KiB"):
        read_leaf_json(root / "MNIST" / "train")


h5py = pytest.importorskip("h5py")


def _femnist(path: Path, writers: dict[str, tuple[np.ndarray, list[int]]]) -> None:
    with h5py.File(path, "w") as fh:
        for writer, (x, y) in writers.items():
            group = fh.create_group(f"examples/{writer}")
            group.create_dataset("pixels", data=(x / 255.0).astype(np.float32))  # TFF's: floats in [0, 1]
            group.create_dataset("label", data=np.asarray(y, dtype=np.int32))


def test_femnist_reads_feds_h5_writers_exactly(tmp_path):
    a, b, t = _images(2, 4), _images(3, 5), _images(2, 6)
    _femnist(tmp_path / "fed_emnist_train.h5", {"f0000_14": (a, [0, 61]), "f0001_41": (b, [10, 35, 36])})
    _femnist(tmp_path / "fed_emnist_test.h5", {"f0000_14": (t, [1, 2])})
    read = read_fed_emnist_h5(tmp_path / "fed_emnist_train.h5")
    assert (
        np.array_equal(read.images[:, 0], np.concatenate([a, b])) and read.users == ["f0000_14"] * 2 + ["f0001_41"] * 3
    )
    ds = load_dataset("femnist", root=tmp_path)
    assert ds.num_classes == 62 and ds.class_names[61] == "z" and ds.class_names[10] == "A"
    assert ds.train_labels.tolist() == [0, 61, 10, 35, 36] and ds.test_images.shape == (2, 1, 28, 28)


def test_a_femnist_file_too_large_to_decode_is_refused_from_its_declared_shapes(tmp_path, monkeypatch):
    _femnist(tmp_path / "fed_emnist_train.h5", {"w": (_images(4, 0), [0, 1, 2, 3])})
    monkeypatch.setenv("FEDML_SSFL_MAX_INPUT_BYTES", "4KiB")  # 4 images of 28x28 float32: 12.3 KiB declared
    with pytest.raises(DataFormatError, match=r"fed_emnist_train\.h5: the FEMNIST file .* more than the 4\.0 KiB"):
        read_fed_emnist_h5(tmp_path / "fed_emnist_train.h5")


def test_a_malformed_femnist_file_is_refused_in_one_line_naming_it(tmp_path):
    with h5py.File(tmp_path / "fed_emnist_train.h5", "w") as fh:
        fh.create_dataset("examples/w/pixels", data=np.zeros((2, 28, 28), np.float32))
    (tmp_path / "fed_emnist_test.h5").write_bytes(b"not hdf5")
    with pytest.raises(
        DataFormatError, match=r"fed_emnist_train\.h5: examples/w needs the datasets 'pixels' and 'label'"
    ):
        load_dataset("femnist", root=tmp_path)
    with pytest.raises(DataFormatError, match=r"fed_emnist_test\.h5: not a readable HDF5 file"):
        read_fed_emnist_h5(tmp_path / "fed_emnist_test.h5")
    _femnist(tmp_path / "fed_emnist_train.h5", {"w": (_images(1, 0), [62])})
    _femnist(tmp_path / "fed_emnist_test.h5", {"w": (_images(1, 0), [0])})
    with pytest.raises(DataFormatError, match="train labels reach 62; femnist has 62 classes"):
        load_dataset("femnist", root=tmp_path)
    with pytest.raises(FileNotFoundError, match="'femnist': fed_emnist_train.h5 and fed_emnist_test.h5 not found"):
        load_dataset("femnist", root=tmp_path / "none")


def test_a_run_trains_on_fedmls_mnist_cache(tmp_path):
    from fedml_ssfl.config import load_config
    from fedml_ssfl.runtime.local import run_local

    root = tmp_path / "cache"
    labels = [i % 10 for i in range(20)]
    _leaf(root / "MNIST" / "train", "a.json", {"f_0": (_images(20, 0), labels), "f_1": (_images(20, 1), labels)})
    _leaf(root / "MNIST" / "test", "a.json", {"f_0": (_images(10, 2), labels[:10])})
    cfg = load_config(
        None,
        [
            "data_args.dataset=fedml_mnist",
            f"data_args.data_cache_dir={root}",
            "data_args.num_server_labels=10",
            "data_args.num_server_val=0",
            "data_args.partition_method=iid",
            "ssfl_args.algorithm=fedavg_ssl",
            "ssfl_args.bootstrap_steps=1",
            "train_args.client_num_in_total=2",
            "train_args.client_num_per_round=2",
            "train_args.comm_round=1",
            "train_args.local_steps=1",
            "train_args.batch_size=2",
            "common_args.compare_with=[]",
            "tracking_args.progress_bar=false",
            "tracking_args.enable_tensorboard=false",
        ],
    )
    result = run_local(cfg, run_dir=tmp_path / "run")
    assert result.summary["status"] == "completed" and result.summary["dataset"] == "fedml_mnist"
