"""The masked consistency loss (Zhang et al. Eq. 6 / Eq. 3) on a hand-made batch."""

from __future__ import annotations

import math

import pytest
import torch

from fedml_ssfl.ssl import masked_consistency_loss, pseudo_labels


def test_masked_consistency_loss_by_hand():
    # 3 samples, 2 classes; weak predictions decide labels and the mask (tau = 0.9)
    weak = torch.tensor([[0.95, 0.05], [0.5, 0.5], [0.02, 0.98]])
    logits = torch.log(torch.tensor([[0.8, 0.2], [0.6, 0.4], [0.3, 0.7]]))  # strong-view predictions
    loss, pl = masked_consistency_loss(logits, weak, threshold=0.9)
    assert pl.labels.tolist() == [0, 0, 1]
    assert pl.mask.tolist() == [True, False, True]
    expected = (-math.log(0.8) + 0 + -math.log(0.7)) / 3  # masked-out sample counts as zero
    assert loss.item() == pytest.approx(expected, rel=1e-5)


def test_loss_is_zero_when_nothing_passes_and_has_no_target_gradient():
    weak = torch.full((4, 3), 1 / 3, requires_grad=True)
    logits = torch.randn(4, 3, requires_grad=True)
    loss, pl = masked_consistency_loss(logits, weak, threshold=0.95)
    assert loss.item() == 0.0 and pl.mask_rate == 0.0
    loss.backward()
    assert weak.grad is None


def test_classwise_thresholds_apply_to_the_predicted_class():
    probs = torch.tensor([[0.7, 0.3], [0.2, 0.8]])
    pl = pseudo_labels(probs, torch.tensor([0.6, 0.9]))
    assert pl.mask.tolist() == [True, False]
    assert pl.accuracy(torch.tensor([0, 1])) == 1.0


def test_label_hits_counts_only_kept_samples_whose_class_is_known():
    from fedml_ssfl.ssl.pseudo_label import label_hits

    pred = torch.tensor([0, 1, 2, 3])
    truth = torch.tensor([0, 2, -1, 3])  # a deployed silo's unlabeled sample carries -1
    assert label_hits(pred, truth) == (2, 3)
    assert label_hits(pred, truth, torch.tensor([True, True, True, False])) == (1, 2)
    pl = pseudo_labels(torch.tensor([[0.9, 0.1], [0.2, 0.8]]), 0.5)
    assert math.isnan(pl.accuracy(torch.tensor([-1, -1])))
    assert pl.accuracy(torch.tensor([0, -1])) == 1.0
