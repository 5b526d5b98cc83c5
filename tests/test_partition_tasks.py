"""FedMatch's and FedSiam's partitions: batch_iid, batch_noniid, noniid_1/2/3, label ratios, their errors."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest
import torch

from fedml_ssfl.config import CHOICES, ConfigError, validate
from fedml_ssfl.data import Split, build_split
from fedml_ssfl.data.partition import METHODS, imbalance_profile, imbalance_weights, round_half_up
from fedml_ssfl.data.partition_methods import PartitionOptions
from fedml_ssfl.data.partition_report import partition_report, save_partition_heatmap
from tests.test_partition import all_sets, assert_disjoint


def balanced_labels(per_class: int = 300, num_classes: int = 10) -> torch.Tensor:
    return torch.arange(num_classes).repeat_interleave(per_class)


def classes_of(labels: torch.Tensor, idx: torch.Tensor) -> set[int]:
    return set(labels[idx].tolist())


LABELS = balanced_labels()
NEW_CASES = [
    ("batch_iid", "client", {}),
    ("batch_iid", "server", {}),
    ("batch_noniid", "client", {}),
    ("batch_noniid", "server", {}),
    ("streaming_noniid", "client", {}),
    ("streaming_noniid", "server", {}),
    ("noniid_1", "client", {"client_label_ratio": 0.1}),
    ("noniid_1", "client", {}),
    ("noniid_1", "server", {}),
    ("noniid_2", "client", {"client_label_ratio": 0.15}),
    ("noniid_2", "client", {}),
    ("noniid_3", "client", {}),
    ("iid", "client", {"client_label_ratio": 0.2}),
]


def make(method: str, scenario: str, seed: int = 0, num_clients: int = 20, labels=LABELS, **kwargs) -> Split:
    server = 100 if scenario == "server" else 0
    options = PartitionOptions(
        partition_method=method, label_scenario=scenario, num_server_labels=server, num_server_val=50, **kwargs
    )
    return build_split(labels, 10, options, num_clients=num_clients, seed=seed)


# --------------------------------------------------------------------------------------------
# every new method: disjoint, everything assigned, reproducible
# --------------------------------------------------------------------------------------------


@pytest.mark.parametrize(("method", "scenario", "kwargs"), NEW_CASES)
def test_disjoint_complete_and_reproducible(method: str, scenario: str, kwargs: dict) -> None:
    split = make(method, scenario, **kwargs)
    assert split.method == method and split.scenario == scenario and split.num_clients == 20
    joined = assert_disjoint(split)
    assert len(joined) == len(LABELS)  # K = 20 is a multiple of d: nothing is left unassigned
    assert len(split.server_val) == 50
    assert len(split.server_labeled) == (100 if scenario == "server" else 0)
    if scenario == "server":
        assert all(len(t) == 0 for t in split.client_labeled)
    else:
        assert all(len(t) > 0 for t in split.client_labeled)
    again, other = make(method, scenario, **kwargs), make(method, scenario, seed=1, **kwargs)
    assert all(torch.equal(a, b) for a, b in zip(all_sets(split), all_sets(again)))
    assert not all(torch.equal(a, b) for a, b in zip(all_sets(split), all_sets(other)))
    if split.streaming:
        assert all(torch.equal(a, b) for a, b in zip(split.client_stages, again.client_stages))


def test_config_choices_list_every_partition_method() -> None:
    assert CHOICES["data_args.partition_method"] == METHODS


def test_batch_iid_is_iid_under_fedmatch_name() -> None:
    a, b = make("batch_iid", "client"), make("iid", "client")
    assert all(torch.equal(x, y) for x, y in zip(all_sets(a), all_sets(b)))
    assert (a.class_histograms(LABELS, "labeled") == 5).all()  # FedMatch: 5 labels per class per client


# --------------------------------------------------------------------------------------------
# batch_noniid (FedMatch's class-imbalanced clients)
# --------------------------------------------------------------------------------------------


def test_imbalance_profile_is_the_fedmatch_authors_table() -> None:
    # rows 0 and 5 of ten_types_of_class_imbalanced_dist in the FedMatch authors' data generator
    assert imbalance_profile(10) == pytest.approx([0.50, 0.15, 0.03, 0.03, 0.03, 0.02, 0.03, 0.03, 0.03, 0.15])
    assert imbalance_weights(6, 10)[5] == pytest.approx([0.02, 0.03, 0.03, 0.03, 0.15, 0.50, 0.15, 0.03, 0.03, 0.03])
    w = imbalance_weights(10, 10, 0.5)
    assert w.sum(axis=1) == pytest.approx(np.ones(10)) and w.sum(axis=0) == pytest.approx(np.ones(10))
    assert imbalance_weights(3, 10, 0.0) == pytest.approx(np.full((3, 10), 0.1))
    for d in (2, 3, 4, 7):
        p = imbalance_profile(d)
        assert p.sum() == pytest.approx(1.0) and p.argmax() == 0 and (p > 0).all()


def test_batch_noniid_is_strongly_imbalanced_with_every_class_present() -> None:
    split = make("batch_noniid", "client")
    hist = split.class_histograms(LABELS, "unlabeled")
    assert (hist > 0).all()  # every client holds every class
    ratio = hist.max(axis=1) / hist.min(axis=1)
    assert ratio.min() >= 15  # the profile's 0.50 / 0.02 = 25, up to rounding
    assert (hist.argmax(axis=1) == np.arange(20) % 10).all()  # main class k mod d
    # K a multiple of d, balanced classes: every client's proportions are its profile row (to rounding)
    expected = imbalance_weights(20, 10) * hist.sum(axis=1, keepdims=True)
    assert np.abs(hist - expected).max() <= 1.5
    # the labeled set stays balanced, as in the authors' code
    assert (split.class_histograms(LABELS, "labeled") == 5).all()


def test_imbalance_strength_controls_the_skew() -> None:
    levels = [make("batch_noniid", "server", imbalance_strength=s).measured_r(LABELS) for s in (0.0, 0.5, 1.0)]
    assert levels[0] < 0.1 < levels[1] < levels[2]
    flat = make("batch_noniid", "server", imbalance_strength=0.0).class_histograms(LABELS, "unlabeled")
    assert flat.max(axis=1).max() - flat.min(axis=1).min() <= 2


# --------------------------------------------------------------------------------------------
# FedSiam Non-IID-I / II / III and the label ratio gamma
# --------------------------------------------------------------------------------------------


@pytest.mark.parametrize("scenario", ["client", "server"])
def test_noniid_1_two_distinct_classes_for_labeled_and_unlabeled(scenario: str) -> None:
    kwargs = {"client_label_ratio": 0.1} if scenario == "client" else {}
    split = make("noniid_1", scenario, **kwargs)
    for k in range(split.num_clients):
        unl, lab = classes_of(LABELS, split.client_unlabeled[k]), classes_of(LABELS, split.client_labeled[k])
        assert len(unl) == 2 and lab <= unl
        if scenario == "client":
            assert lab == unl
            n = len(split.client_unlabeled[k]) + len(split.client_labeled[k])
            assert len(split.client_labeled[k]) == round_half_up(0.1 * n)
    holders = (split.class_histograms(LABELS) > 0).sum(axis=0)
    assert (holders == 4).all()  # 20 clients x 2 classes: every class held by 4 clients


def test_noniid_1_more_classes_per_client() -> None:
    split = make("noniid_1", "client", classes_per_client=3)
    assert ((split.class_histograms(LABELS) > 0).sum(axis=1) == 3).all()


@pytest.mark.parametrize("ratio", [0.1, 0.0])
def test_noniid_2_labeled_from_two_classes_unlabeled_from_all(ratio: float) -> None:
    split = make("noniid_2", "client", client_label_ratio=ratio, labels_per_class_client=4)
    lab = split.class_histograms(LABELS, "labeled")
    unl = split.class_histograms(LABELS, "unlabeled")
    assert ((lab > 0).sum(axis=1) == 2).all()
    assert (unl > 0).all()  # every client's unlabeled data covers all 10 classes
    assert unl.max(axis=0).max() - unl.min(axis=0).min() <= 2  # dealt evenly
    if ratio > 0:
        per_client = round_half_up(0.1 * (len(LABELS) - 50) / 20)  # gamma * |D| / K
        assert (lab.sum(axis=1) == per_client).all()
    else:
        assert set(lab[lab > 0].tolist()) == {4}


@pytest.mark.parametrize(("num_clients", "rich"), [(100, 10), (20, 2)])
def test_noniid_3_exact_label_counts_for_rich_and_poor_clients(num_clients: int, rich: int) -> None:
    split = make("noniid_3", "client", num_clients=num_clients)
    lab = np.array([len(t) for t in split.client_labeled])
    total = lab + np.array([len(t) for t in split.client_unlabeled])
    is_rich = lab == np.array([round_half_up(0.55 * n) for n in total])
    is_poor = lab == np.array([round_half_up(0.05 * n) for n in total])
    assert is_rich.sum() == rich and is_poor.sum() == num_clients - rich and not (is_rich & is_poor).any()
    allh = split.class_histograms(LABELS)
    assert (allh > 0).all()  # every client holds every class (stratified iid)
    assert allh.sum(axis=1).max() - allh.sum(axis=1).min() <= 1
    if num_clients == 20:  # a rich client's 83 labels cover every class (stratified by class)
        assert (split.class_histograms(LABELS, "labeled")[is_rich] > 0).all()


def test_noniid_3_keys_change_the_counts() -> None:
    split = make("noniid_3", "client", rich_client_fraction=0.25, rich_label_ratio=0.4, poor_label_ratio=0.1)
    lab = np.array([len(t) for t in split.client_labeled])
    total = lab + np.array([len(t) for t in split.client_unlabeled])
    assert (lab == np.array([round_half_up(0.4 * n) for n in total])).sum() == 5


def test_client_label_ratio_stratified_by_class() -> None:
    split = make("dirichlet", "client", client_label_ratio=0.2, partition_alpha=0.5)
    lab = split.class_histograms(LABELS, "labeled")
    allh = split.class_histograms(LABELS)
    assert (lab.sum(axis=1) == np.array([round_half_up(0.2 * n) for n in allh.sum(axis=1)])).all()
    assert (np.abs(lab - 0.2 * allh) < 1.0).all()  # per-class quotas: proportional, largest remainder


# --------------------------------------------------------------------------------------------
# errors name the key
# --------------------------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("kwargs", "key"),
    [
        ({"partition_method": "noniid_2", "label_scenario": "server"}, "data_args.label_scenario: client"),
        ({"partition_method": "noniid_3", "label_scenario": "server"}, "data_args.label_scenario: client"),
        (
            {"partition_method": "iid", "label_scenario": "server", "client_label_ratio": 0.1},
            "data_args.client_label_ratio",
        ),
        ({"partition_method": "batch_noniid", "client_label_ratio": 0.1}, "data_args.client_label_ratio"),
        ({"partition_method": "noniid_3", "client_label_ratio": 0.1}, "data_args.client_label_ratio"),
        ({"partition_method": "noniid_1", "classes_per_client": 11}, "data_args.classes_per_client"),
        ({"partition_method": "streaming_noniid", "num_stages": 0}, "data_args.num_stages"),
        ({"partition_method": "streaming_noniid", "rounds_per_stage": 0}, "data_args.rounds_per_stage"),
        ({"partition_method": "batch_noniid", "imbalance_strength": 1.5}, "data_args.imbalance_strength"),
        ({"partition_method": "noniid_3", "rich_label_ratio": 2.0}, "data_args.rich_label_ratio"),
        ({"partition_method": "batch_noniid", "labels_per_class_client": 20}, "data_args.labels_per_class_client"),
        ({"partition_method": "noniid_2", "labels_per_class_client": 60}, "data_args.labels_per_class_client"),
    ],
)
def test_build_split_errors_name_the_key(kwargs: dict, key: str) -> None:
    options = PartitionOptions(**{"label_scenario": "client", "num_server_labels": 100, **kwargs})
    with pytest.raises(ValueError, match=key):
        build_split(balanced_labels(per_class=200), 10, options, num_clients=20, seed=0)


@pytest.mark.parametrize(
    ("data", "pattern"),
    [
        ({"partition_method": "noniid_2"}, r"noniid_2.*data_args\.label_scenario: client"),
        ({"partition_method": "noniid_3"}, r"noniid_3.*data_args\.label_scenario: client"),
        ({"client_label_ratio": 0.1}, r"data_args\.client_label_ratio.*label_scenario: client"),
        (
            {"label_scenario": "client", "partition_method": "batch_noniid", "client_label_ratio": 0.1},
            r"data_args\.client_label_ratio.*labels_per_class_client",
        ),
        ({"num_stages": 0}, r"data_args\.num_stages: 0 is out of range"),
        ({"rounds_per_stage": 0}, r"data_args\.rounds_per_stage: 0 is out of range"),
        ({"imbalance_strength": -0.1}, r"data_args\.imbalance_strength"),
        ({"client_label_ratio": 1.5}, r"data_args\.client_label_ratio: 1\.5 is out of range"),
        ({"partition_method": "noniid_4"}, r"partition_method.*noniid_1, noniid_2, noniid_3"),
    ],
)
def test_config_errors_name_the_key(data: dict, pattern: str) -> None:
    raw = {"data_args": data, "ssfl_args": {"algorithm": "fedavg_sl"}}
    with pytest.raises(ConfigError, match=pattern):
        validate(raw)


def test_config_accepts_the_paper_settings() -> None:
    for data in (
        {"label_scenario": "client", "num_server_labels": 0, "partition_method": "batch_noniid"},
        {"label_scenario": "client", "num_server_labels": 0, "partition_method": "streaming_noniid"},
        {"label_scenario": "client", "partition_method": "noniid_2", "client_label_ratio": 0.1},
        {"label_scenario": "client", "partition_method": "noniid_3"},
        {"label_scenario": "server", "partition_method": "noniid_1", "num_server_labels": 500},
    ):
        cfg = validate({"data_args": data, "ssfl_args": {"algorithm": "fedavg_sl"}})
        assert cfg.data_args.partition_method == data["partition_method"]


# --------------------------------------------------------------------------------------------
# report and CLI
# --------------------------------------------------------------------------------------------


def test_report_and_two_panel_heatmap_for_labels_at_client(tmp_path: Path) -> None:
    split = make("streaming_noniid", "client", num_stages=4, rounds_per_stage=3)
    text = partition_report(split, LABELS, [f"c{i}" for i in range(10)])
    assert "streaming: 4 stages" in text and "round s * 3" in text and "all out from round 9" in text
    assert "labeled samples only:" in text and "client labeled fraction" in text
    assert len(text.splitlines()) >= 2 * (20 + 2) + 6
    path = save_partition_heatmap(split, LABELS, tmp_path / "h.png", title="streaming")
    assert path.read_bytes()[:4] == b"\x89PNG"


def test_partition_command_shows_a_new_method(tmp_path, capsys) -> None:
    from fedml_ssfl.cli import main

    cfg = tmp_path / "c.yaml"
    cfg.write_text(
        "ssfl_args: {algorithm: fedavg_sl}\n"
        "common_args: {compare_with: []}\n"
        "data_args: {dataset: digits, label_scenario: client, num_server_labels: 0, partition_method: noniid_2,\n"
        "            client_label_ratio: 0.1}\n"
    )
    assert main(["partition", str(cfg), "--out", str(tmp_path / "p.png")]) == 0
    out = capsys.readouterr().out
    assert "method=noniid_2 scenario=client" in out and "labeled samples only:" in out
    assert (tmp_path / "p.png").stat().st_size > 1000


# --------------------------------------------------------------------------------------------
# the table of methods and the options object
# --------------------------------------------------------------------------------------------


def test_partition_options_are_the_data_args_keys_with_their_defaults() -> None:
    from dataclasses import fields

    from fedml_ssfl.config import DataArgs, partition_options

    data_args = DataArgs()
    assert partition_options(data_args) == PartitionOptions()
    for f in fields(PartitionOptions):
        assert getattr(data_args, f.name) == f.default, f.name


def test_every_row_has_its_function_and_options() -> None:
    from dataclasses import fields

    from fedml_ssfl.data.partition import PARTITION_METHODS, implements
    from fedml_ssfl.data.partition_methods import METHOD_TABLE

    assert tuple(PARTITION_METHODS) == METHODS == tuple(m.name for m in METHOD_TABLE)
    for name, method in PARTITION_METHODS.items():
        assert method.info.name == name and callable(method.function) and method.info.description
        assert set(method.info.scenarios) <= {"server", "client"}
        assert {f.name for f in fields(method.info.options)} <= {f.name for f in fields(PartitionOptions)}
    assert [n for n, m in PARTITION_METHODS.items() if m.info.streaming] == ["streaming_noniid"]
    with pytest.raises(ValueError, match="data_args.partition_method: unknown method 'nope'"):
        implements("nope")(lambda data, options: ([], []))


def test_partition_layer_does_not_import_the_config() -> None:
    import subprocess
    import sys

    code = "import sys, fedml_ssfl.data.partition; sys.exit('fedml_ssfl.config' in sys.modules)"
    assert subprocess.run([sys.executable, "-c", code], timeout=120).returncode == 0
