"""Server/client splits and Zhang et al.'s non-iid level R (Eq. 1, Appendix A.2)."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest
import torch

from fedml_ssfl.data import Split, build_split, non_iid_level
from fedml_ssfl.data.partition import largest_remainder, r_targets
from fedml_ssfl.data.partition_methods import PartitionOptions
from fedml_ssfl.data.partition_report import partition_heatmap, partition_report, save_partition_heatmap


def balanced_labels(per_class: int = 200, num_classes: int = 10) -> torch.Tensor:
    return torch.arange(num_classes).repeat_interleave(per_class)


def imbalanced_labels() -> torch.Tensor:
    counts = [300, 250, 200, 180, 160, 140, 120, 100, 90, 60]
    return torch.cat([torch.full((n,), c) for c, n in enumerate(counts)])


def r_options(r: float, **kwargs) -> PartitionOptions:
    return PartitionOptions(partition_method="r", non_iid_r=r, **kwargs)


def dirichlet(alpha: float, **kwargs) -> PartitionOptions:
    return PartitionOptions(partition_method="dirichlet", partition_alpha=alpha, **kwargs)


def all_sets(split: Split) -> list[torch.Tensor]:
    return [split.server_labeled, split.server_val, *split.client_unlabeled, *split.client_labeled]


def assert_disjoint(split: Split) -> np.ndarray:
    joined = torch.cat(all_sets(split)).numpy()
    assert len(np.unique(joined)) == len(joined)
    return joined


# --------------------------------------------------------------------------------------------
# non_iid_level
# --------------------------------------------------------------------------------------------


def test_r_zero_for_identical_distributions() -> None:
    hist = np.array([[5, 5, 10], [1, 1, 2], [50, 50, 100]])
    assert non_iid_level(hist) == pytest.approx(0.0)


def test_r_one_for_one_class_each() -> None:
    assert non_iid_level(np.eye(10) * 37) == pytest.approx(1.0)


def test_r_hand_computed() -> None:
    # TV([1,0],[0.5,0.5]) = 0.5, TV([1,0],[0,1]) = 1, TV([0.5,0.5],[0,1]) = 0.5 -> mean 2/3
    hist = np.array([[4, 0], [2, 2], [0, 3]])
    assert non_iid_level(hist) == pytest.approx(2.0 / 3.0)


def test_r_single_client_and_empty_rows() -> None:
    assert non_iid_level(np.array([[3, 4]])) == 0.0
    assert non_iid_level(np.array([[3, 0], [0, 0], [0, 2]])) == pytest.approx(1.0)


def test_largest_remainder_sums() -> None:
    counts = largest_remainder(np.array([1.5, 2.5, 3.0]), 7)
    assert counts.sum() == 7 and counts.tolist() == [2, 2, 3]


# --------------------------------------------------------------------------------------------
# method "r"
# --------------------------------------------------------------------------------------------


@pytest.mark.parametrize("r", [0.0, 0.4, 0.8, 1.0])
def test_measured_r_matches_requested(r: float) -> None:
    labels = balanced_labels(per_class=500)
    split = build_split(labels, 10, r_options(r, num_server_labels=100), num_clients=10, seed=0)
    assert split.requested_r == r
    assert abs(split.measured_r(labels) - r) < 0.01
    joined = assert_disjoint(split)
    assert len(joined) == len(labels)  # K = d: everything is assigned


def test_r_targets_follow_appendix_a2() -> None:
    n = np.array([100.0, 50.0])
    t = r_targets(n, 2, 0.4)
    q = n / n.sum()
    # client 0 (main class 0): n_0 R + n_0 q_0 (1-R) of class 0; n_1 q_0 (1-R) of class 1
    assert t[0, 0] == pytest.approx(100 * 0.4 + 100 * q[0] * 0.6)
    assert t[0, 1] == pytest.approx(50 * q[0] * 0.6)
    assert t.sum(axis=0) == pytest.approx(n)


def test_r_more_clients_than_classes() -> None:
    labels = balanced_labels()
    split = build_split(labels, 10, r_options(0.8), num_clients=20, seed=1)
    # pairs sharing a main class are identical: R * (fraction of pairs with different main classes)
    frac_diff = 1.0 - 10 / (20 * 19 / 2)
    assert abs(split.measured_r(labels) - 0.8 * frac_diff) < 0.02
    assert len(assert_disjoint(split)) == len(labels)


def test_r_fewer_clients_than_classes() -> None:
    labels = balanced_labels()
    split = build_split(labels, 10, r_options(0.4, num_server_labels=100), num_clients=5, seed=1)
    # only the main-class share R * n_j of the 5 classes nobody has as main class is left out
    assigned = sum(len(u) for u in split.client_unlabeled)
    assert assigned == 10 * 190 - 5 * round(0.4 * 190)
    hist = split.class_histograms(labels)
    assert (hist.argmax(axis=1) == np.arange(5)).all()
    assert 0.0 < split.measured_r(labels) < 0.4
    assert_disjoint(split)


def test_r_out_of_range() -> None:
    with pytest.raises(ValueError, match="data_args.non_iid_r"):
        build_split(balanced_labels(), 10, r_options(1.5), num_clients=10, seed=0)


# --------------------------------------------------------------------------------------------
# sizes, disjointness, balance
# --------------------------------------------------------------------------------------------


@pytest.mark.parametrize("method", ["iid", "r", "dirichlet", "shards"])
def test_sizes_add_up(method: str) -> None:
    labels = imbalanced_labels()
    options = PartitionOptions(partition_method=method, num_server_labels=53, num_server_val=20)
    split = build_split(labels, 10, options, num_clients=10, seed=2)
    joined = assert_disjoint(split)
    assert len(joined) == len(labels)
    assert split.num_clients == 10 and len(split.client_labeled) == 10
    assert all(len(t) == 0 and t.dtype == torch.int64 for t in split.client_labeled)
    counts = torch.bincount(labels[split.server_labeled], minlength=10).tolist()
    assert counts == [6, 6, 6, 5, 5, 5, 5, 5, 5, 5]
    assert torch.bincount(labels[split.server_val], minlength=10).tolist() == [2] * 10
    assert split.class_histograms(labels).sum() == len(labels) - 73


def test_iid_is_even() -> None:
    split = build_split(balanced_labels(), 10, PartitionOptions(num_server_labels=50), num_clients=7, seed=0)
    sizes = [len(u) for u in split.client_unlabeled]
    assert max(sizes) - min(sizes) <= 1
    assert split.measured_r(balanced_labels()) < 0.2


def test_shards_respect_classes_per_client() -> None:
    labels = imbalanced_labels()
    for cpc in (1, 2, 3):
        options = PartitionOptions(partition_method="shards", classes_per_client=cpc)
        split = build_split(labels, 10, options, num_clients=13, seed=5)
        hist = split.class_histograms(labels)
        assert ((hist > 0).sum(axis=1) <= cpc).all()
        assert len(assert_disjoint(split)) == len(labels)


def test_dirichlet_alpha_controls_skew() -> None:
    labels = balanced_labels()
    skewed = build_split(labels, 10, dirichlet(0.05), num_clients=10, seed=0)
    flat = build_split(labels, 10, dirichlet(100.0), num_clients=10, seed=0)
    assert skewed.measured_r(labels) > flat.measured_r(labels) + 0.3
    assert min(len(u) for u in skewed.client_unlabeled) >= 1


def test_dirichlet_fills_empty_clients() -> None:
    labels = balanced_labels(per_class=10, num_classes=2)
    split = build_split(labels, 2, dirichlet(0.01, num_server_labels=2), num_clients=12, seed=3)
    assert min(len(u) for u in split.client_unlabeled) >= 1


def test_labels_at_client() -> None:
    labels = balanced_labels()
    options = dirichlet(0.3, label_scenario="client", num_server_labels=0, labels_per_class_client=5)
    split = build_split(labels, 10, options, num_clients=8, seed=4)
    assert len(split.server_labeled) == 0
    assert len(assert_disjoint(split)) == len(labels)
    lab = split.class_histograms(labels, "labeled")
    allh = split.class_histograms(labels, "all")
    assert (lab <= 5).all()
    assert (lab == np.minimum(allh, 5)).all()  # every class a client holds gets its labels
    assert (split.class_histograms(labels, "unlabeled") + lab == allh).all()


def test_same_seed_same_split() -> None:
    labels = imbalanced_labels()
    options = dirichlet(0.5, num_server_val=10)
    a, b = (build_split(labels, 10, options, num_clients=6, seed=9) for _ in range(2))
    c = build_split(labels, 10, options, num_clients=6, seed=10)
    assert all(torch.equal(x, y) for x, y in zip(all_sets(a), all_sets(b)))
    assert not all(torch.equal(x, y) for x, y in zip(all_sets(a), all_sets(c)))


# --------------------------------------------------------------------------------------------
# errors
# --------------------------------------------------------------------------------------------


def test_error_server_labels_too_many() -> None:
    with pytest.raises(ValueError, match=r"data_args.num_server_labels.*2000"):
        build_split(
            balanced_labels(), 10, PartitionOptions(num_server_labels=1990, num_server_val=20), num_clients=2, seed=0
        )


def test_error_class_too_small() -> None:
    with pytest.raises(ValueError, match="class 9 has only 60"):
        build_split(imbalanced_labels(), 10, PartitionOptions(num_server_labels=700), num_clients=2, seed=0)


@pytest.mark.parametrize(
    ("kwargs", "key"),
    [
        ({"partition_method": "random"}, "data_args.partition_method"),
        ({"label_scenario": "both"}, "data_args.label_scenario"),
        ({"num_clients": 0}, "client_num_in_total"),
        ({"num_server_labels": 0}, "data_args.num_server_labels"),
    ],
)
def test_errors_name_the_key(kwargs: dict, key: str) -> None:
    num_clients = kwargs.pop("num_clients", 4)
    with pytest.raises(ValueError, match=key):
        build_split(balanced_labels(), 10, PartitionOptions(**kwargs), num_clients=num_clients, seed=0)


# --------------------------------------------------------------------------------------------
# report
# --------------------------------------------------------------------------------------------


def test_report_and_heatmap(tmp_path: Path) -> None:
    labels = balanced_labels()
    split = build_split(labels, 10, r_options(0.4, num_server_labels=100), num_clients=10, seed=0)
    text = partition_report(split, labels, [f"class{i}" for i in range(10)])
    assert "server labeled: 100" in text and "requested: 0.4000" in text and "measured" in text
    assert len(text.splitlines()) >= 10 + 6
    path = save_partition_heatmap(split, labels, tmp_path / "plots" / "split.png", title="R=0.4")
    assert path.is_file() and path.read_bytes()[:4] == b"\x89PNG"


def heatmap_panels(fig) -> list:
    """The heat-map's panels (the axes holding an image), laid out as saving would."""
    from matplotlib.backends.backend_agg import FigureCanvasAgg

    FigureCanvasAgg(fig).draw()
    return [ax for ax in fig.axes if ax.images]


def test_heatmap_reads_an_even_split_as_even(tmp_path: Path) -> None:
    """Issue 30: an IID split's colour scale ran 55-65 (looking skewed), the client axis was ticked at
    -0.5, 0.0, 0.5 and classes were numbers."""
    labels = balanced_labels()
    names = [f"class {c}" for c in range(10)]
    iid = PartitionOptions(partition_method="iid", num_server_labels=100)
    split = build_split(labels, 10, iid, num_clients=7, seed=0)
    fig = partition_heatmap(split, labels, "mnist5k_semifl: iid split of mnist5k", names)
    (ax,) = heatmap_panels(fig)
    (image,) = ax.images
    hist = split.class_histograms(labels, "all")
    assert image.get_clim() == (0, hist.max())  # the scale starts at 0
    assert [float(t) for t in ax.get_yticks()] == [float(k) for k in range(7)]  # one integer tick per client
    assert [t.get_text() for t in ax.get_xticklabels()] == names
    assert fig.get_suptitle().startswith("mnist5k_semifl: iid split of mnist5k\nmeasured non-IID level R = ")
    counts = [int(t.get_text()) for t in ax.texts]  # a small grid prints each cell's count
    assert counts == [int(v) for v in hist.flatten()]
    many = build_split(balanced_labels(40, 40), 40, iid, num_clients=60, seed=0)  # too many to tick each
    (big,) = heatmap_panels(partition_heatmap(many, balanced_labels(40, 40)))
    assert not big.texts
    for axis in (big.get_xticks(), big.get_yticks()):
        assert 1 < len(axis) <= 12 and all(float(t).is_integer() for t in axis), axis


def test_heatmap_of_labels_at_client_has_two_panels_each_from_zero() -> None:
    labels = balanced_labels()
    opts = PartitionOptions(
        partition_method="iid", label_scenario="client", num_server_labels=0, labels_per_class_client=3
    )
    split = build_split(labels, 10, opts, num_clients=5, seed=0)
    panels = heatmap_panels(partition_heatmap(split, labels, "run: iid split"))
    assert [ax.get_title() for ax in panels] == ["unlabeled samples", "labeled samples"]
    assert all(ax.images[0].get_clim()[0] == 0 for ax in panels)
    assert panels[1].images[0].get_clim()[1] == 3  # 3 labels per class and client
