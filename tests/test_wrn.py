"""Wide ResNets in the model registry: parameter counts, layout, forward pass."""

from __future__ import annotations

import copy

import pytest
import torch
from torch import nn

from fedml_ssfl.models import available_models, build_model, classifier_prefix, count_parameters, model_spec
from fedml_ssfl.models.wrn import WideBlock, WideResNet


def wrn_parameter_formula(in_channels: int, num_classes: int, widen: int, depth: int = 28) -> int:
    """The closed form of the module docstring, computed independently of the model code."""
    n = (depth - 4) // 6
    w = [16, 16 * widen, 32 * widen, 64 * widen]
    total = 9 * in_channels * w[0]
    for g in range(1, 4):
        a, b = w[g - 1], w[g]
        first = 2 * a + 9 * a * b + 2 * b + 9 * b * b + (a * b if a != b else 0)
        total += first + (n - 1) * (4 * b + 18 * b * b)
    return total + 2 * w[3] + (w[3] + 1) * num_classes


def test_registered() -> None:
    assert {"wrn28_2", "wrn28_8"} <= set(available_models())
    for name in ("wrn28_2", "wrn28_8"):
        assert model_spec(name).norms == ("bn", "gn")
        assert model_spec(name).accepts_image_size(32) and model_spec(name).accepts_image_size(28)


@pytest.mark.parametrize(
    ("name", "channels", "classes", "expected"),
    [
        ("wrn28_2", 3, 10, 1_467_610),  # CIFAR-10 / SVHN: the 1.5M of FixMatch and SemiFL
        ("wrn28_8", 3, 100, 23_401_012),  # CIFAR-100: the 23.4M of FixMatch and SemiFL
    ],
)
def test_parameter_counts(name: str, channels: int, classes: int, expected: int) -> None:
    model = build_model(name, num_classes=classes, in_channels=channels, image_size=32, norm="bn")
    assert count_parameters(model) == expected
    widen = int(name.split("_")[1])
    assert wrn_parameter_formula(channels, classes, widen) == expected


@pytest.mark.parametrize(("widen", "channels", "classes"), [(2, 1, 10), (2, 3, 100), (4, 3, 10), (1, 3, 10)])
def test_parameter_formula_matches_other_shapes(widen: int, channels: int, classes: int) -> None:
    model = WideResNet(num_classes=classes, in_channels=channels, depth=28, widen=widen, norm="gn")
    assert count_parameters(model) == wrn_parameter_formula(channels, classes, widen)


def test_layout_and_norms() -> None:
    bn = build_model("wrn28_2", num_classes=10, in_channels=3, image_size=32, norm="bn")
    assert classifier_prefix(bn, in_channels=3, image_size=32) == "fc"
    assert sorted(k for k in bn.state_dict() if k.startswith("fc")) == ["fc.bias", "fc.weight"]
    assert [len(getattr(bn, f"block{i}")) for i in (1, 2, 3)] == [4, 4, 4]  # (28 - 4) / 6
    convs = [m for m in bn.modules() if isinstance(m, nn.Conv2d) and m.kernel_size == (3, 3)]
    assert len(convs) == 25  # the stem and two per block (12 blocks); three 1x1 shortcuts besides
    assert sum(isinstance(m, nn.BatchNorm2d) for m in bn.modules()) == 25
    gn = build_model("wrn28_2", num_classes=10, in_channels=3, image_size=32, norm="gn")
    groups = [m for m in gn.modules() if isinstance(m, nn.GroupNorm)]
    assert len(groups) == 25 and all(m.num_groups == 16 for m in groups)
    assert not any(isinstance(m, nn.BatchNorm2d) for m in gn.modules())
    with pytest.raises(ValueError, match="model_args.norm"):
        build_model("wrn28_2", num_classes=10, in_channels=3, image_size=32, norm="none")
    with pytest.raises(ValueError, match="6n \\+ 4"):
        WideResNet(num_classes=10, depth=27)


@pytest.mark.parametrize("norm", ["bn", "gn"])
def test_forward_and_learning_step(norm: str) -> None:
    torch.manual_seed(0)
    model = build_model("wrn28_2", num_classes=5, in_channels=3, image_size=8, norm=norm)
    x = torch.randn(6, 3, 8, 8)
    y = torch.arange(6) % 5
    model.eval()
    with torch.no_grad():
        assert model(x).shape == (6, 5)
    model.train()
    opt = torch.optim.SGD(model.parameters(), lr=0.05, momentum=0.9)
    before = nn.functional.cross_entropy(model(x), y).item()
    for _ in range(6):
        opt.zero_grad()
        nn.functional.cross_entropy(model(x), y).backward()
        opt.step()
    with torch.no_grad():
        after = nn.functional.cross_entropy(model(x), y).item()
    assert after < 0.9 * before
    # strided groups: 8x8 -> 8 -> 4 -> 2 before pooling; grayscale input also works
    gray = build_model("wrn28_2", num_classes=3, in_channels=1, image_size=28, norm=norm).eval()
    with torch.no_grad():
        assert gray(torch.randn(2, 1, 28, 28)).shape == (2, 3)


@pytest.mark.parametrize("norm", ["bn", "gn"])
def test_in_place_relu_computes_the_same_values_and_gradients(norm: str) -> None:
    """The blocks' ReLUs work in place: outputs (train and eval) and gradients bit for bit those of
    out-of-place ReLUs, in NCHW and channels_last."""
    torch.manual_seed(0)
    fast = WideResNet(num_classes=10, depth=10, widen=2, norm=norm)
    blocks = [m for m in fast.modules() if isinstance(m, WideBlock)]
    assert blocks and all(b.relu.inplace for b in blocks)
    x = torch.randn(6, 3, 16, 16)
    y = torch.randint(0, 10, (6,))
    for layout in (torch.contiguous_format, torch.channels_last):
        fast.zero_grad(set_to_none=True)
        slow = copy.deepcopy(fast)
        for b in slow.modules():
            if isinstance(b, WideBlock):
                b.relu = nn.ReLU(inplace=False)
        a, b = fast.to(memory_format=layout), slow.to(memory_format=layout)
        a.train(), b.train()
        xa, xb = x.clone(memory_format=layout), x.clone(memory_format=layout)
        out_a, out_b = a(xa), b(xb)
        assert torch.equal(out_a, out_b)
        nn.functional.cross_entropy(out_a, y).backward()
        nn.functional.cross_entropy(out_b, y).backward()
        for (name, pa), pb in zip(a.named_parameters(), b.parameters()):
            assert torch.equal(pa.grad, pb.grad), name
        assert torch.equal(xa, xb)  # the input is left as it was
        for key, value in a.state_dict().items():  # BatchNorm's running statistics too
            assert torch.equal(value, b.state_dict()[key]), key
        a.eval(), b.eval()
        with torch.no_grad():
            assert torch.equal(a(x), b(x))


def test_without_a_norm_layer_the_first_relu_keeps_the_block_input() -> None:
    """norm "none" (not registered for WRN, but the class takes it): in place would overwrite ``x``,
    which the identity shortcut adds back."""
    block = WideBlock(8, 8, 1, "none")
    assert not block.relu.inplace
    x = torch.randn(2, 8, 6, 6)
    before = x.clone()
    block(x)
    assert torch.equal(x, before)
