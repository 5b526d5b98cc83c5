"""FixMatch's and UDA's unlabeled losses, TSA and FedProx's proximal term, on hand-made values."""

from __future__ import annotations

import math

import pytest
import torch
from torch import nn

from fedml_ssfl.ssl import fixmatch_loss, sharpen, tsa_cross_entropy, tsa_threshold, uda_loss
from fedml_ssfl.training import proximal_term


def log_probs(*rows: list[float]) -> torch.Tensor:
    """Logits whose softmax is exactly the given probability rows."""
    return torch.tensor(rows).log()


# ---- FixMatch (Sohn et al. l_u) ---------------------------------------------------------------------
def test_fixmatch_loss_by_hand() -> None:
    weak = log_probs([0.96, 0.02, 0.02], [0.5, 0.3, 0.2], [0.01, 0.01, 0.98]).requires_grad_()
    strong = torch.tensor(
        [
            [0.0, 0.0, 0.0],  # p = 1/3 each: CE to class 0 is log 3
            [5.0, -5.0, 0.0],  # masked out (confidence 0.5 < 0.95): contributes 0
            [0.0, 0.0, math.log(2.0)],  # p = (1/4, 1/4, 1/2): CE to class 2 is log 2
        ],
        requires_grad=True,
    )
    loss, pl = fixmatch_loss(strong, weak, threshold=0.95)
    assert pl.mask.tolist() == [True, False, True]
    assert pl.labels[pl.mask].tolist() == [0, 2]
    # the mean runs over all three samples, the masked one counting as zero
    assert loss.item() == pytest.approx((math.log(3.0) + math.log(2.0)) / 3, rel=1e-6)
    loss.backward()
    assert weak.grad is None  # the target carries no gradient
    assert torch.equal(strong.grad[1], torch.zeros(3))  # nor does a masked-out sample
    assert strong.grad[0, 0] < 0 and strong.grad[2, 2] < 0  # pushed toward the pseudo-labels


def test_fixmatch_threshold_decides_what_is_kept() -> None:
    weak = log_probs([0.96, 0.02, 0.02], [0.5, 0.3, 0.2])
    strong = torch.zeros(2, 3)  # CE to any class is log 3
    default, pl = fixmatch_loss(strong, weak)  # tau = 0.95 by default
    assert pl.mask.tolist() == [True, False]
    assert default.item() == pytest.approx(math.log(3.0) / 2, rel=1e-6)
    low, pl = fixmatch_loss(strong, weak, threshold=0.5)
    assert pl.mask.tolist() == [True, True]
    assert low.item() == pytest.approx(math.log(3.0), rel=1e-6)
    none, pl = fixmatch_loss(strong, weak, threshold=0.99)
    assert not pl.mask.any() and none.item() == 0.0


# ---- UDA (Xie et al.: KL, masking, sharpening) ------------------------------------------------------
def kl(p: list[float], q: list[float]) -> float:
    return sum(a * math.log(a / b) for a, b in zip(p, q) if a > 0)


def test_uda_loss_by_hand() -> None:
    weak = log_probs([0.9, 0.1], [0.7, 0.3])
    strong = torch.zeros(2, 2, requires_grad=True)  # q = (1/2, 1/2)
    loss, pl = uda_loss(strong, weak)  # T = 0.4, beta = 0.8
    # target = softmax(z / T): p^(1/T) renormalised, 1/T = 2.5
    a, b = 0.9**2.5, 0.1**2.5
    target = [a / (a + b), b / (a + b)]
    # the second sample's sharpened target (0.7^2.5 / (0.7^2.5 + 0.3^2.5) = 0.89) clears 0.8, but the mask
    # looks at the unsharpened confidence 0.7 < 0.8, as UDA does
    assert pl.mask.tolist() == [True, False]
    assert loss.item() == pytest.approx(kl(target, [0.5, 0.5]) / 2, rel=1e-5)
    loss.backward()
    assert strong.grad[0, 0] < 0 and torch.equal(strong.grad[1], torch.zeros(2))


def test_uda_temperature_sharpens_the_target() -> None:
    weak = log_probs([0.9, 0.1])
    strong = torch.zeros(1, 2)
    assert torch.allclose(sharpen(weak, 1.0), torch.tensor([[0.9, 0.1]]), atol=1e-6)
    plain, _ = uda_loss(strong, weak, temperature=1.0)
    assert plain.item() == pytest.approx(kl([0.9, 0.1], [0.5, 0.5]), rel=1e-5)
    hard, _ = uda_loss(strong, weak, temperature=1e-3)  # a one-hot target: KL = -log q = log 2
    assert hard.item() == pytest.approx(math.log(2.0), rel=1e-5)
    sharpened, _ = uda_loss(strong, weak)
    assert plain.item() < sharpened.item() < hard.item()
    with pytest.raises(ValueError, match="temperature"):
        sharpen(weak, 0.0)


def test_uda_mask_threshold() -> None:
    weak = log_probs([0.9, 0.1], [0.7, 0.3])
    strong = torch.zeros(2, 2)
    _, pl = uda_loss(strong, weak, threshold=0.6)
    assert pl.mask.tolist() == [True, True]
    nothing, pl = uda_loss(strong, weak, threshold=0.95)
    assert not pl.mask.any() and nothing.item() == 0.0


# ---- Training Signal Annealing ------------------------------------------------------------------------
def test_tsa_thresholds_by_hand() -> None:
    assert tsa_threshold("none", 0.3, 10) == 1.0
    assert tsa_threshold("linear", 0.5, 10) == pytest.approx(0.5 * 0.9 + 0.1)
    assert tsa_threshold("log", 0.5, 10) == pytest.approx((1 - math.exp(-2.5)) * 0.9 + 0.1)
    assert tsa_threshold("exp", 0.5, 10) == pytest.approx(math.exp(-2.5) * 0.9 + 0.1)
    for schedule in ("linear", "exp"):
        assert tsa_threshold(schedule, 1.0, 4) == pytest.approx(1.0)
        assert tsa_threshold(schedule, 2.0, 4) == pytest.approx(1.0)  # progress is clipped
    assert tsa_threshold("log", 1.0, 4) == pytest.approx((1 - math.exp(-5.0)) * 0.75 + 0.25)
    assert tsa_threshold("linear", 0.0, 4) == pytest.approx(0.25)
    with pytest.raises(ValueError, match="schedule"):
        tsa_threshold("cosine", 0.5, 10)


def test_tsa_cross_entropy_drops_samples_already_learned() -> None:
    logits = log_probs([0.9, 0.1], [0.3, 0.7])
    labels = torch.tensor([0, 0])  # correct-class probabilities 0.9 and 0.3
    assert tsa_cross_entropy(logits, labels, 0.5).item() == pytest.approx(-math.log(0.3), rel=1e-6)
    both = (-math.log(0.9) - math.log(0.3)) / 2
    assert tsa_cross_entropy(logits, labels, 0.95).item() == pytest.approx(both, rel=1e-6)
    assert tsa_cross_entropy(logits, labels, 1.0).item() == pytest.approx(both, rel=1e-6)
    assert tsa_cross_entropy(logits, labels, 0.2).item() == 0.0


# ---- FedProx (Li et al. Eq. 2) ------------------------------------------------------------------------
def test_proximal_term_by_hand() -> None:
    model = nn.Sequential(nn.Linear(2, 1), nn.BatchNorm1d(1))
    with torch.no_grad():
        model[0].weight.copy_(torch.tensor([[1.0, 2.0]]))
        model[0].bias.fill_(3.0)
    model[1].weight.requires_grad_(False)  # frozen: not pulled
    model[1].running_mean.fill_(100.0)  # a buffer: not pulled
    ref = {k: v.clone() for k, v in model.state_dict().items()}
    ref["0.weight"] = torch.zeros(1, 2)
    ref["0.bias"] = torch.tensor([1.0])
    ref["1.weight"] = torch.tensor([50.0])
    ref["1.running_mean"] = torch.zeros(1)
    term = proximal_term(model, ref, mu=0.5)
    # mu/2 * (1^2 + 2^2 + (3 - 1)^2) = 0.25 * 9; BatchNorm's bias equals its reference
    assert term.item() == pytest.approx(2.25)
    term.backward()
    assert torch.allclose(model[0].weight.grad, torch.tensor([[0.5, 1.0]]))  # mu * (w - w_g)
    assert torch.allclose(model[0].bias.grad, torch.tensor([1.0]))
    assert proximal_term(model, ref, mu=0.0).item() == 0.0
    with pytest.raises(KeyError, match="0.bias"):
        proximal_term(model, {"0.weight": ref["0.weight"]}, mu=1.0)
