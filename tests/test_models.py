"""Tests for the model registry, normalisation helper and registered models."""

from __future__ import annotations

import pytest
import torch
from torch import nn

from fedml_ssfl.models import (
    available_models,
    build_model,
    classifier_prefix,
    count_parameters,
    make_norm,
    model_spec,
    register_model,
)
from fedml_ssfl.models import registry as registry_mod

# Per-model test inputs: (in_channels, image_size, num_classes, sgd_steps, lr). ResNet-18 runs
# on 16x16 images (it accepts any side >= 8) and few steps to keep the suite fast on CPU; its
# GroupNorm variant diverges on 8 samples with lr >= 0.01, hence the small lr.
CASES: dict[str, tuple[int, int, int, int, float]] = {
    "resnet18": (3, 16, 10, 3, 0.003),
    "cnn28": (1, 28, 10, 15, 0.05),
    "emnist_cnn": (1, 28, 62, 15, 0.01),
    # FedMatch / FedSiam models on small inputs (both accept any side >= 8): cheap on CPU
    "resnet9": (3, 8, 10, 3, 0.002),
    "fedsiam_cifar_cnn": (3, 8, 10, 20, 0.03),
    "fedsiam_mnist_cnn": (1, 28, 10, 15, 0.05),
    "lr": (1, 8, 10, 15, 0.05),  # FedML's logistic regression
}
GENERIC_CASE = (10, 1, 0.01)
"""(num_classes, sgd_steps, lr) for models registered elsewhere (e.g. the WRNs), which run at
their smallest accepted input size."""
BATCH = 8

MODEL_NORMS = [(name, norm) for name in available_models() for norm in model_spec(name).norms]


def _case(name: str) -> tuple[int, int, int, int, float]:
    """Test inputs for ``name``; a model without an entry in CASES gets its smallest input."""
    if name in CASES:
        return CASES[name]
    spec = model_spec(name)
    in_ch = 3 if spec.in_channels is None or 3 in spec.in_channels else spec.in_channels[0]
    size = min(spec.image_sizes) if spec.image_sizes is not None else max(spec.min_image_size, 8)
    return (in_ch, size, *GENERIC_CASE)


def _build(name: str, norm: str, seed: int = 0) -> nn.Module:
    in_ch, size, classes, _, _ = _case(name)
    torch.manual_seed(seed)
    return build_model(name, num_classes=classes, in_channels=in_ch, image_size=size, norm=norm)


def _batch(name: str) -> tuple[torch.Tensor, torch.Tensor]:
    in_ch, size, classes, _, _ = _case(name)
    g = torch.Generator().manual_seed(1234)
    x = torch.randn(BATCH, in_ch, size, size, generator=g)
    y = torch.randint(0, classes, (BATCH,), generator=g)
    return x, y


def test_available_models() -> None:
    assert available_models() == sorted(available_models())
    assert {"resnet18", "cnn28", "emnist_cnn"} <= set(available_models())


def test_model_specs() -> None:
    assert model_spec("resnet18").norms == ("bn", "gn")
    assert model_spec("cnn28").norms == ("bn", "gn", "none")
    assert model_spec("emnist_cnn").norms == ("none",)
    assert model_spec("emnist_cnn").image_sizes == (28,)
    assert model_spec("resnet18").image_sizes is None
    for name in available_models():
        assert model_spec(name).description


@pytest.mark.parametrize(("name", "norm"), MODEL_NORMS)
def test_model_forward_train_roundtrip(name: str, norm: str) -> None:
    in_ch, size, classes, steps, lr = _case(name)
    model = _build(name, norm)
    x, y = _batch(name)

    # Output shape and classifier layer.
    model.eval()
    with torch.no_grad():
        out = model(x)
    assert out.shape == (BATCH, classes)
    assert out.dtype == torch.float32
    prefix = classifier_prefix(model, in_channels=in_ch, image_size=size)
    assert prefix == ("linear" if name == "lr" else "fc")
    head = model.get_submodule(prefix)
    assert isinstance(head, nn.Linear) and head.out_features == classes
    assert sorted(k for k in model.state_dict() if k.startswith(prefix + ".")) == [f"{prefix}.bias", f"{prefix}.weight"]

    # A few SGD steps on a fixed batch lower the loss (measured in train mode with a fixed
    # dropout seed, so before/after see the same masks).
    def loss_now() -> float:
        torch.manual_seed(99)
        with torch.no_grad():
            return nn.functional.cross_entropy(model(x), y).item()

    model.train()
    before = loss_now()
    opt = torch.optim.SGD(model.parameters(), lr=lr, momentum=0.9)
    torch.manual_seed(7)
    for _ in range(steps):
        opt.zero_grad()
        nn.functional.cross_entropy(model(x), y).backward()
        opt.step()
    after = loss_now()
    assert after < 0.9 * before, (before, after)

    # state_dict round-trip into a fresh, differently initialised model.
    model.eval()
    fresh = _build(name, norm, seed=1)
    fresh.load_state_dict(model.state_dict())
    fresh.eval()
    with torch.no_grad():
        assert torch.equal(model(x), fresh(x))


@pytest.mark.parametrize("name", ["cnn28", "emnist_cnn"])
def test_deterministic_init(name: str) -> None:
    norm = model_spec(name).norms[0]
    a, b = _build(name, norm, seed=3), _build(name, norm, seed=3)
    for (ka, va), (kb, vb) in zip(a.state_dict().items(), b.state_dict().items()):
        assert ka == kb
        assert torch.equal(va, vb)


@pytest.mark.parametrize("norm", ["bn", "gn"])
def test_resnet18_parameter_count(norm: str) -> None:
    model = build_model("resnet18", num_classes=10, in_channels=3, image_size=32, norm=norm)
    assert count_parameters(model) == 11_173_962


def test_resnet18_full_size_forward() -> None:
    model = build_model("resnet18", num_classes=10, in_channels=3, image_size=32, norm="gn").eval()
    with torch.no_grad():
        assert model(torch.randn(2, 3, 32, 32)).shape == (2, 10)
    norms = [m for m in model.modules() if isinstance(m, nn.GroupNorm)]
    assert norms and all(m.num_groups == 32 for m in norms)
    assert not any(isinstance(m, nn.BatchNorm2d) for m in model.modules())


@pytest.mark.parametrize(("classes", "expected"), [(62, 1_206_590), (47, 1_204_655)])
def test_emnist_cnn_parameter_count(classes: int, expected: int) -> None:
    model = build_model("emnist_cnn", num_classes=classes, in_channels=1, image_size=28, norm="none")
    assert count_parameters(model) == expected
    assert not any(isinstance(m, (nn.BatchNorm2d, nn.GroupNorm)) for m in model.modules())


@pytest.mark.parametrize(("norm", "expected"), [("bn", 24_058), ("gn", 24_058), ("none", 23_946)])
def test_cnn28_parameter_count(norm: str, expected: int) -> None:
    model = build_model("cnn28", num_classes=10, in_channels=1, image_size=28, norm=norm)
    assert count_parameters(model) == expected


def test_cnn28_other_sizes_and_rgb() -> None:
    model = build_model("cnn28", num_classes=5, in_channels=3, image_size=32, norm="gn").eval()
    with torch.no_grad():
        assert model(torch.randn(2, 3, 32, 32)).shape == (2, 5)
        assert model(torch.randn(2, 3, 8, 8)).shape == (2, 5)
    gns = [m for m in model.modules() if isinstance(m, nn.GroupNorm)]
    assert len(gns) == 3 and all(m.num_groups == 8 for m in gns)


def test_count_parameters_trainable_only() -> None:
    model = build_model("cnn28", num_classes=10, in_channels=1, image_size=28, norm="bn")
    total = count_parameters(model)
    model.fc.weight.requires_grad_(False)
    assert count_parameters(model) == total - model.fc.weight.numel()


def test_unknown_model_suggests_closest() -> None:
    with pytest.raises(ValueError, match="resnet17") as info:
        build_model("resnet17", num_classes=10, in_channels=3, image_size=32)
    msg = str(info.value)
    assert "Did you mean 'resnet18'?" in msg
    for name in available_models():
        assert name in msg
    with pytest.raises(ValueError, match="Did you mean 'emnist_cnn'"):
        model_spec("emnist-cnn")


def test_unsupported_norm_names_allowed_values() -> None:
    with pytest.raises(ValueError, match=r"model_args\.norm='bn'.*emnist_cnn.*'none'"):
        build_model("emnist_cnn", num_classes=62, in_channels=1, image_size=28, norm="bn")
    with pytest.raises(ValueError, match=r"model_args\.norm='none'.*'bn', 'gn'"):
        build_model("resnet18", num_classes=10, in_channels=3, image_size=32, norm="none")


def test_unsupported_image_size_lists_supported() -> None:
    with pytest.raises(ValueError, match=r"image_size=32.*supports image sizes: 28"):
        build_model("emnist_cnn", num_classes=62, in_channels=1, image_size=32, norm="none")
    with pytest.raises(ValueError, match=r"image_size=4.*any >= 8"):
        build_model("cnn28", num_classes=10, in_channels=1, image_size=4, norm="gn")


def test_invalid_counts_rejected() -> None:
    with pytest.raises(ValueError, match="num_classes"):
        build_model("cnn28", num_classes=0, in_channels=1, image_size=28)
    with pytest.raises(ValueError, match="in_channels"):
        build_model("cnn28", num_classes=10, in_channels=0, image_size=28)


def test_in_channels_restriction(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(registry_mod, "_REGISTRY", dict(registry_mod._REGISTRY))

    @register_model("tmp_rgb_only", norms=("none",), in_channels=(3,), description="test model")
    def _tmp(*, num_classes: int, in_channels: int, image_size: int, norm: str) -> nn.Module:
        net = nn.Sequential(nn.AdaptiveAvgPool2d(1), nn.Flatten())
        net.fc = nn.Linear(in_channels, num_classes)
        return net

    assert "tmp_rgb_only" in available_models()
    assert model_spec("tmp_rgb_only").description == "test model"
    with pytest.raises(ValueError, match=r"in_channels=1.*supports in_channels in 3"):
        build_model("tmp_rgb_only", num_classes=2, in_channels=1, image_size=8, norm="none")
    assert build_model("tmp_rgb_only", num_classes=2, in_channels=3, image_size=8, norm="none").fc


def test_duplicate_registration_refused(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(registry_mod, "_REGISTRY", dict(registry_mod._REGISTRY))
    before = model_spec("cnn28")
    with pytest.raises(ValueError, match="already registered"):

        @register_model("cnn28")
        def _dup(*, num_classes: int, in_channels: int, image_size: int, norm: str) -> nn.Module:
            return nn.Linear(1, 1)

    assert model_spec("cnn28") is before


def test_the_head_is_found_whatever_its_name(monkeypatch: pytest.MonkeyPatch) -> None:
    """No naming rule: the head is the last layer with parameters producing the logits (a forward pass)."""
    monkeypatch.setattr(registry_mod, "_REGISTRY", dict(registry_mod._REGISTRY))

    class HeadFirst(nn.Module):  # the head is registered before the body, and named "out"
        def __init__(self, num_classes: int, in_channels: int) -> None:
            super().__init__()
            self.out = nn.Sequential(nn.ReLU(), nn.Linear(8, num_classes))
            self.body = nn.Sequential(nn.Conv2d(in_channels, 8, 3), nn.AdaptiveAvgPool2d(1), nn.Flatten())
            self.scale = nn.Linear(num_classes, num_classes)  # defined last, never run

        def forward(self, x):
            return self.out(self.body(x))

    @register_model("tmp_head_first", norms=("none",))
    def _head_first(*, num_classes: int, in_channels: int, image_size: int, norm: str) -> nn.Module:
        """A model whose head is neither named fc nor defined last."""
        return HeadFirst(num_classes, in_channels)

    assert model_spec("tmp_head_first").description == "A model whose head is neither named fc nor defined last."
    net = build_model("tmp_head_first", num_classes=4, in_channels=3, image_size=8, norm="none")
    assert classifier_prefix(net, in_channels=3, image_size=8) == "out.1"
    assert (
        classifier_prefix(
            build_model("lr", num_classes=3, in_channels=1, image_size=8, norm="none"), in_channels=1, image_size=8
        )
        == "linear"
    )


def test_a_model_that_returns_no_logits_is_refused_naming_the_fix(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(registry_mod, "_REGISTRY", dict(registry_mod._REGISTRY))

    @register_model("tmp_features", norms=("none",))
    def _features(*, num_classes: int, in_channels: int, image_size: int, norm: str) -> nn.Module:
        return nn.Sequential(nn.Conv2d(in_channels, 5, 3), nn.Flatten())  # (N, 5 * 6 * 6): not logits

    @register_model("tmp_no_forward", norms=("none",))
    def _no_forward(*, num_classes: int, in_channels: int, image_size: int, norm: str) -> nn.Module:
        net = nn.Module()
        net.fc = nn.Linear(in_channels, num_classes)  # a layer named fc is no longer enough: it must run
        return net

    with pytest.raises(TypeError, match=r"model 'tmp_features' returns \(2, 180\).*logits \(2, 2\)"):
        build_model("tmp_features", num_classes=2, in_channels=3, image_size=8, norm="none")
    with pytest.raises(TypeError, match=r"model 'tmp_no_forward' fails on a batch of images shaped like the data"):
        build_model("tmp_no_forward", num_classes=2, in_channels=3, image_size=8, norm="none")
    with pytest.raises(ValueError, match="no layer with parameters"):
        classifier_prefix(nn.Flatten(), in_channels=1, image_size=2)


def test_make_norm() -> None:
    bn = make_norm("bn", 16)
    assert isinstance(bn, nn.BatchNorm2d) and bn.num_features == 16
    gn = make_norm("gn", 64)
    assert isinstance(gn, nn.GroupNorm) and gn.num_groups == 32 and gn.num_channels == 64
    small = make_norm("gn", 16)
    assert isinstance(small, nn.GroupNorm) and small.num_groups == 16
    assert make_norm("gn", 32, groups=8).num_groups == 8
    assert isinstance(make_norm("none", 8), nn.Identity)
    with pytest.raises(ValueError, match="divisible"):
        make_norm("gn", 48)
    with pytest.raises(ValueError, match="unknown norm"):
        make_norm("layer", 8)


# ---------------------------------------------------------------------------------------------
# FedMatch's ResNet-9 and FedSiam's Table 1 models: exact parameter counts


@pytest.mark.parametrize(
    ("norm", "channels", "expected"), [("none", 3, 6_570_890), ("gn", 3, 6_573_130), ("none", 1, 6_569_738)]
)
def test_resnet9_parameter_count(norm: str, channels: int, expected: int) -> None:
    model = build_model("resnet9", num_classes=10, in_channels=channels, image_size=32, norm=norm)
    assert count_parameters(model) == expected  # 576 C + 6,561,792 + (2,240 | 4,480) + 513 K
    assert not any(isinstance(m, nn.BatchNorm2d) for m in model.modules())
    gns = [m for m in model.modules() if isinstance(m, nn.GroupNorm)]
    assert len(gns) == (8 if norm == "gn" else 0) and all(m.num_groups == 32 for m in gns)
    convs = [m for m in model.modules() if isinstance(m, nn.Conv2d)]
    assert [m.out_channels for m in convs] == [64, 128, 128, 128, 256, 512, 512, 512]
    assert all((m.bias is not None) == (norm == "none") for m in convs)


def test_resnet9_table3_shapes_and_variance_scaling_init() -> None:
    torch.manual_seed(0)
    model = build_model("resnet9", num_classes=10, in_channels=3, image_size=32, norm="none").eval()
    x = torch.randn(2, 3, 32, 32)
    with torch.no_grad():
        assert model.layer1(model.prep(x)).shape == (2, 128, 16, 16)
        assert model.res3(model.layer3(model.layer2(model.res1(model.layer1(model.prep(x)))))).shape == (2, 512, 4, 4)
        assert model(x).shape == (2, 10) and model(torch.randn(2, 3, 8, 8)).shape == (2, 10)
    w = model.layer3[0][0].weight  # fan-in 256 * 9
    std = (1.0 / (256 * 9)) ** 0.5
    assert abs(w.std().item() / std - 1.0) < 0.03  # TF VarianceScaling keeps the variance 1 / fan_in
    assert w.abs().max().item() <= 2 * std / 0.87962566103423978 + 1e-6  # truncated at two (uncorrected) std
    assert all((m.bias == 0).all() for m in model.modules() if isinstance(m, nn.Conv2d))
    with pytest.raises(ValueError, match="any >= 8"):
        build_model("resnet9", num_classes=10, in_channels=3, image_size=4, norm="none")
    with pytest.raises(ValueError, match="model_args.norm='bn'"):
        build_model("resnet9", num_classes=10, in_channels=3, image_size=32, norm="bn")


def test_fedsiam_mnist_cnn_has_21840_parameters() -> None:
    model = build_model("fedsiam_mnist_cnn", num_classes=10, in_channels=1, image_size=28, norm="none")
    assert count_parameters(model) == 21_840  # Long et al. Table 1
    assert [tuple(m.weight.shape) for m in (model.conv1, model.conv2, model.dense, model.fc)] == [
        (10, 1, 5, 5),
        (20, 10, 5, 5),
        (50, 320),
        (10, 50),
    ]
    with pytest.raises(ValueError, match="supports image sizes: 28"):
        build_model("fedsiam_mnist_cnn", num_classes=10, in_channels=1, image_size=32, norm="none")


@pytest.mark.parametrize(("norm", "expected"), [("bn", 5_852_170), ("gn", 5_852_170), ("none", 5_851_338)])
def test_fedsiam_cifar_cnn_parameter_count(norm: str, expected: int) -> None:
    model = build_model("fedsiam_cifar_cnn", num_classes=10, in_channels=3, image_size=32, norm=norm).eval()
    assert count_parameters(model) == expected  # bn: Long et al. Table 1's 5,852,170
    convs = [m for m in model.modules() if isinstance(m, nn.Conv2d)]
    assert [m.out_channels for m in convs] == [32, 64, 128, 128, 256, 256] and all(m.bias is not None for m in convs)
    linears = [(m.in_features, m.out_features) for m in model.modules() if isinstance(m, nn.Linear)]
    assert linears == [(4096, 1024), (1024, 512), (512, 10)]
    kind = {"bn": nn.BatchNorm2d, "gn": nn.GroupNorm, "none": nn.Identity}[norm]
    assert all(isinstance(getattr(model, f"norm{i}"), kind) for i in (1, 3, 5))
    with torch.no_grad():
        assert model(torch.randn(2, 3, 32, 32)).shape == (2, 10)


def test_fedsiam_cifar_cnn_other_sizes() -> None:
    small = build_model("fedsiam_cifar_cnn", num_classes=10, in_channels=3, image_size=8, norm="bn")
    assert small.dense1.in_features == 256 and count_parameters(small) == 1_920_010
    svhn_gray = build_model("fedsiam_cifar_cnn", num_classes=10, in_channels=1, image_size=28, norm="bn").eval()
    with torch.no_grad():
        assert svhn_gray(torch.randn(2, 1, 28, 28)).shape == (2, 10)
