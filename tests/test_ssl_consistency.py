"""Soft consistency losses and the sigmoid ramp-up on hand-made values."""

from __future__ import annotations

import math

import pytest
import torch

from fedml_ssfl.ssl import kl_consistency, sigmoid_rampup, softmax_mse


def test_kl_consistency_by_hand_with_a_mask():
    p = torch.tensor([[0.9, 0.1], [0.5, 0.5]])
    q = torch.tensor([[0.6, 0.4], [0.2, 0.8]])
    kl0 = 0.9 * math.log(0.9 / 0.6) + 0.1 * math.log(0.1 / 0.4)
    kl1 = 0.5 * math.log(0.5 / 0.2) + 0.5 * math.log(0.5 / 0.8)
    assert float(kl_consistency(torch.log(q), p)) == pytest.approx((kl0 + kl1) / 2, rel=1e-5)
    masked = kl_consistency(torch.log(q), p, mask=torch.tensor([True, False]))
    assert float(masked) == pytest.approx(kl0 / 2, rel=1e-5)  # the mean runs over the whole batch


def test_kl_consistency_is_zero_at_the_target_and_sends_no_gradient_to_it():
    p = torch.tensor([[0.7, 0.2, 0.1]], requires_grad=True)
    logits = torch.log(p.detach()).clone().requires_grad_(True)
    loss = kl_consistency(logits, p)
    assert float(loss.detach()) == pytest.approx(0.0, abs=1e-7)
    loss.backward()
    assert p.grad is None


def test_softmax_mse_by_hand():
    q = torch.tensor([[0.6, 0.4], [0.2, 0.8]])
    p = torch.tensor([[1.0, 0.0], [0.5, 0.5]])
    expected = ((0.4**2 + 0.4**2) + (0.3**2 + 0.3**2)) / 2
    assert float(softmax_mse(torch.log(q), p)) == pytest.approx(expected, rel=1e-5)


def test_losses_refuse_mismatched_shapes():
    with pytest.raises(ValueError, match="kl_consistency"):
        kl_consistency(torch.zeros(2, 3), torch.zeros(2, 2))
    with pytest.raises(ValueError, match="softmax_mse"):
        softmax_mse(torch.zeros(3), torch.zeros(3))


def test_sigmoid_rampup_ends_and_middle():
    assert sigmoid_rampup(0, 10) == pytest.approx(math.exp(-5))
    assert sigmoid_rampup(5, 10) == pytest.approx(math.exp(-1.25))
    assert sigmoid_rampup(10, 10) == 1.0 and sigmoid_rampup(50, 10) == 1.0
    assert sigmoid_rampup(3, 0) == 1.0
