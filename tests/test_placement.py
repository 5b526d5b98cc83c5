"""``device_args.data_on_device`` (fedml_ssfl/data/placement.py): the images kept on the training device.

The GPU path's code run on CPU: the placement itself onto PyTorch's ``meta`` device (where tensors have
shapes and dtypes but no storage), the memory check with the free bytes a GPU would report, the key in the
config (not in the fingerprint), and runs with the key equal to runs without it, simulated and on a
deployed silo.
"""

from __future__ import annotations

import pytest
import torch

from fedml_ssfl import experiment
from fedml_ssfl.config import ConfigError, load_config
from fedml_ssfl.data import placement
from fedml_ssfl.data.placement import check_fits, place_dataset, place_images
from fedml_ssfl.data.silos import SiloMeta
from fedml_ssfl.experiment import build_experiment, build_silo_experiment, export_deployment
from fedml_ssfl.runtime.local import run_round
from tests.conftest import assert_same_state

META = torch.device("meta")


def test_a_placed_dataset_is_a_copy_with_its_images_on_the_device(small_config):
    ds = build_experiment(small_config()).dataset
    placed = place_dataset(ds, META)
    for name in ("train_images", "test_images"):
        before, after = getattr(ds, name), getattr(placed, name)
        assert after.device == META and after.shape == before.shape and after.dtype == torch.uint8, name
        assert before.device.type == "cpu", f"{name}: the process's loaded dataset was changed"
    assert placed.train_labels is ds.train_labels and placed.test_labels is ds.test_labels  # labels stay
    assert (placed.name, placed.num_classes, placed.mean, placed.std, placed.flip) == (
        ds.name,
        ds.num_classes,
        ds.mean,
        ds.std,
        ds.flip,
    )
    batch = placed.train_images[torch.tensor([3, 0, 7])]  # CPU indices, as the batch streams draw them
    assert batch.device == META and batch.shape == (3, *ds.train_images.shape[1:])
    assert place_dataset(ds, torch.device("cpu")) is ds  # already there: nothing moves
    assert place_images(ds.train_images, torch.device("cpu")) is ds.train_images


def test_images_larger_than_half_the_free_device_memory_are_refused(small_config, monkeypatch):
    check_fits(50, 100, META)  # half: fits
    check_fits(10**12, None, META)  # memory not counted (CPU): fits
    with pytest.raises(ConfigError, match=r"device_args.data_on_device: .* set it to false") as err:
        check_fits(51, 100, META)
    assert "\n" not in str(err.value)
    ds = build_experiment(small_config()).dataset
    monkeypatch.setattr(placement, "free_device_bytes", lambda device: 1000)  # a GPU with 1000 bytes free
    with pytest.raises(ConfigError, match="device_args.data_on_device"):
        place_dataset(ds, META)
    with pytest.raises(ConfigError, match="device_args.data_on_device"):
        place_images(ds.train_images, META)


def test_the_key_is_a_boolean_and_left_out_of_the_fingerprint(small_config):
    cfg = small_config()
    assert cfg.device_args.data_on_device is False
    on = small_config("device_args.data_on_device=true")
    assert on.device_args.data_on_device is True and on.fingerprint() == cfg.fingerprint()
    with pytest.raises(ConfigError, match="device_args.data_on_device"):
        small_config("device_args.data_on_device=maybe")


@pytest.mark.parametrize("algorithm", ["fedavg_ssl", "semifl"])
def test_a_run_with_its_data_on_the_device_equals_one_without(small_config, monkeypatch, algorithm):
    placed: list[torch.device] = []
    real = experiment.place_dataset

    def spy(dataset, device):
        placed.append(device)
        return real(dataset, device)

    monkeypatch.setattr(experiment, "place_dataset", spy)
    # SemiFL: an untrained model is never 0.95-sure, so its clients would not train
    extra = ["ssfl_args.threshold=0.0", "ssfl_args.local_epochs=null", "ssfl_args.server_steps=2"]
    extra = extra if algorithm == "semifl" else []
    runs = []
    for on in ("false", "true"):
        exp = build_experiment(
            small_config(f"ssfl_args.algorithm={algorithm}", *extra, f"device_args.data_on_device={on}")
        )
        exp.algorithm.setup()
        states = {k: {} for k in range(4)}
        rows = [run_round(exp, r, states) for r in range(2)]
        for row in rows:
            row.pop("seconds")
        runs.append((exp.algorithm.state_dict(), states, rows))
    assert placed == [torch.device("cpu")]  # only the run with the key placed its data
    assert_same_state(runs[0][0], runs[1][0])
    assert_same_state(runs[0][1], runs[1][1])
    assert runs[0][2] == runs[1][2]


def test_a_deployed_silo_places_its_own_images(small_config, tmp_path, monkeypatch):
    sim = small_config()
    config = export_deployment(sim, tmp_path / "data")
    cfg = load_config(config, ["device_args.data_on_device=true"])
    meta = SiloMeta.of(build_experiment(sim).dataset)
    moved: list[torch.Tensor] = []
    monkeypatch.setattr(experiment, "place_images", lambda images, device: moved.append(images) or images.to(META))
    silo = build_silo_experiment(cfg, meta, rank=1)
    assert len(moved) == 1 and silo.images.device == META and silo.images.shape == moved[0].shape
    assert silo.client_data(0).images is silo.images
