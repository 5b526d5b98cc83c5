"""The 2x2 max-pooling fast path: F.max_pool2d's values and strides, and models unchanged by it."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F
from torch import nn

from fedml_ssfl.models import build_model
from fedml_ssfl.models.pooling import MaxPool2x2, max_pool_2x2


@pytest.mark.parametrize("shape", [(6, 16, 28, 28), (4, 8, 7, 9), (3, 2, 5, 4)])
@pytest.mark.parametrize("layout", [torch.contiguous_format, torch.channels_last])
def test_the_strided_maximum_is_max_pool2d(shape, layout) -> None:
    """Ties (values rounded to a few levels, zeros as after a ReLU), NaN, odd trailing rows and
    columns: the same values and the same output strides (the next conv rounds by its input's layout)."""
    x = torch.relu(torch.randn(shape, generator=torch.Generator().manual_seed(0))).round(decimals=1)
    x[0, 0, 0, 1] = float("nan")
    x = x.to(memory_format=layout)
    expected, fast = F.max_pool2d(x, 2), max_pool_2x2(x)
    assert torch.equal(fast.isnan(), expected.isnan()) and bool(fast[0, 0, 0, 0].isnan())
    assert torch.equal(fast.nan_to_num(-1.0), expected.nan_to_num(-1.0))
    assert fast.stride() == expected.stride()


def test_the_module_takes_the_fast_path_only_without_gradient(monkeypatch) -> None:
    pool, x = MaxPool2x2(), torch.randn(2, 4, 6, 6)
    calls = []
    original = torch.maximum
    monkeypatch.setattr(torch, "maximum", lambda *a: calls.append(1) or original(*a))
    with torch.no_grad():
        pool(x)
    assert calls  # no gradient: the strided maximum
    calls.clear()
    pool(x.clone().requires_grad_()).sum().backward()
    pool(x[:, :1])  # one channel
    assert not calls  # F.max_pool2d


@pytest.mark.parametrize(("name", "norm"), [("cnn28", "gn"), ("cnn28", "bn"), ("emnist_cnn", "none")])
def test_models_compute_what_they_computed_with_nn_max_pool(name, norm) -> None:
    """A model's evaluation logits are those of the same model with nn.MaxPool2d (with gradient both
    call F.max_pool2d: the routing test above checks that)."""
    torch.manual_seed(0)
    model = build_model(name, num_classes=10, in_channels=1, image_size=28, norm=norm).eval()
    plain = build_model(name, num_classes=10, in_channels=1, image_size=28, norm=norm).eval()
    plain.load_state_dict(model.state_dict())
    for parent in plain.modules():
        for child_name, child in parent.named_children():
            if isinstance(child, MaxPool2x2):
                setattr(parent, child_name, nn.MaxPool2d(2))
    assert any(isinstance(m, MaxPool2x2) for m in model.modules())
    assert not any(isinstance(m, MaxPool2x2) for m in plain.modules())
    x = torch.rand(5, 1, 28, 28, generator=torch.Generator().manual_seed(1))
    with torch.no_grad():
        assert torch.equal(model(x), plain(x))
    with torch.inference_mode():
        assert torch.equal(model(x), plain(x))


def test_transforms_and_small_sides_take_max_pool2d() -> None:
    """Under vmap without gradient (batched tensors refuse layout queries), with forward-mode tangents
    (ties would split them) and for a side below the window (F.max_pool2d's error), the module gives
    what F.max_pool2d gives."""
    from torch.autograd import forward_ad
    from torch.func import vmap

    pool = MaxPool2x2()
    x = torch.relu(torch.randn(3, 2, 4, 6, 6, generator=torch.Generator().manual_seed(0)))
    x = x.round(decimals=1)  # ties
    with torch.no_grad():
        assert torch.equal(vmap(pool)(x), vmap(lambda t: F.max_pool2d(t, 2))(x))
        assert torch.equal(vmap(pool)(x.transpose(2, 3)), vmap(lambda t: F.max_pool2d(t, 2))(x.transpose(2, 3)))
    tangent = torch.randn(x[0].shape, generator=torch.Generator().manual_seed(1))
    with torch.no_grad(), forward_ad.dual_level():
        ours = forward_ad.unpack_dual(pool(forward_ad.make_dual(x[0], tangent))).tangent
        theirs = forward_ad.unpack_dual(F.max_pool2d(forward_ad.make_dual(x[0], tangent), 2)).tangent
    assert torch.equal(ours, theirs)
    with torch.no_grad(), pytest.raises(RuntimeError):
        pool(torch.randn(2, 4, 1, 6))
