"""Which view gives the pseudo-label and which takes the loss, through each algorithm's real step.

Every algorithm here trains on views of one batch: one view's prediction becomes the target, another
view's prediction is trained towards it. Hand-made logits only test the loss functions; these tests run
each client's real update (its own batch building, its own forward passes, its own optimiser) on a
:class:`~tests.known_net.KnownNet`, whose prediction on a sample depends on the view it sees, and on
input views that carry their tag (:func:`~tests.known_net.tag_views`). The recorded forward passes say
which views went in together, which rows took a gradient, and the target of each such row (the most
negative entry of a cross-entropy's gradient): so the tests read, per sample, from which view its
pseudo-label came and on which view the loss was taken.

KnownNet's class of sample ``i``: ``i % C`` on the plain image (its true label), ``i + 1`` on the weak
view, ``i + 2`` on the strong view (mod C), with confidence 0.99995, and in eval mode shifted by the
recorder's ``eval_shift``.
"""

from __future__ import annotations

import pytest
import torch

from fedml_ssfl.algorithms.base import ClientContext
from fedml_ssfl.algorithms.fedmatch import HELPER
from fedml_ssfl.experiment import build_experiment
from fedml_ssfl.sparse import sparsify
from tests.known_net import PLAIN, SHIFT, STRONG, WEAK, Recorder, coded_data, tag_views, targets, took_loss

C = 10
CTX = ClientContext(round_idx=0, device=torch.device("cpu"), seed=0)
LABELS_AT_CLIENT = ["data_args.label_scenario=client", "data_args.num_server_labels=0"]


def build(small_config, monkeypatch, *overrides, recorder: Recorder | None = None):
    """The algorithm of ``overrides`` on a KnownNet, with tagged views; returns (algorithm, recorder)."""
    tag_views(monkeypatch)
    exp = build_experiment(small_config("train_args.batch_size=8", "train_args.local_steps=2", *overrides))
    rec = recorder or Recorder(num_classes=C)
    exp.algorithm.model_fn = rec.factory()
    exp.algorithm.setup()
    rec.clear()
    return exp.algorithm, rec


def cls(ids: torch.Tensor, view: int, shift: int = 0) -> torch.Tensor:
    """KnownNet's class of samples ``ids`` under ``view`` (``shift``: the eval-mode shift)."""
    return (ids + SHIFT[view] + shift) % C


def rows(call, view: int) -> torch.Tensor:
    return call.views == view


# ---- Zhang et al.: CRL (Eq. 6) and self-training (Eq. 3) -------------------------------------------
def test_crl_labels_each_sample_by_its_weak_view_and_trains_its_strong_view(small_config, monkeypatch):
    algo, rec = build(small_config, monkeypatch, "ssfl_args.algorithm=fedavg_ssl")
    algo.client_update(algo.message_for(0, 0), coded_data(0, 30), {}, CTX)
    calls = rec.trained()
    assert len(calls) == 2 == len(rec.calls)  # one forward pass a step, both views in it
    for call in calls:
        weak, strong = rows(call, WEAK), rows(call, STRONG)
        assert weak.sum() == strong.sum() == 8 and (weak | strong).all()
        assert torch.equal(call.ids[weak], call.ids[strong])  # the two halves are the same samples
        assert not took_loss(call.grad[weak]).any() and took_loss(call.grad[strong]).all()
        # each strong view is trained towards the weak view's class of the same sample
        assert torch.equal(targets(call.grad[strong]), cls(call.ids[strong], WEAK))


def test_self_training_labels_by_the_eval_mode_weak_view_and_trains_the_same_view(small_config, monkeypatch):
    rec = Recorder(num_classes=C, eval_shift=5)
    algo, rec = build(
        small_config, monkeypatch, "ssfl_args.algorithm=fedavg_ssl", "ssfl_args.user_loss=self_training", recorder=rec
    )
    algo.client_update(algo.message_for(0, 0), coded_data(0, 30), {}, CTX)
    assert len(rec.calls) == 4
    for label_pass, train_pass in zip(rec.calls[::2], rec.calls[1::2]):
        assert not label_pass.training and label_pass.grad is None and (label_pass.views == WEAK).all()
        assert train_pass.training and (train_pass.views == WEAK).all() and took_loss(train_pass.grad).all()
        assert torch.equal(train_pass.ids, label_pass.ids) and torch.equal(train_pass.x, label_pass.x)
        assert torch.equal(targets(train_pass.grad), cls(train_pass.ids, WEAK, shift=5))


# ---- FedMatch's baselines and the local ones: FixMatch and UDA ---------------------------------------
SSL_CASES = {
    "fedavg_fixmatch": ("plain", []),
    "fedprox_fixmatch": ("weak", []),
    "fedavg_uda": ("weak", []),
    "fedprox_uda": ("plain", ["ssfl_args.tsa=none"]),  # TSA would drop labeled samples KnownNet already knows
    "local_fixmatch": ("plain", []),
    "local_uda": ("weak", []),
}


@pytest.mark.parametrize("name", list(SSL_CASES))
def test_fixmatch_and_uda_label_by_the_weak_view_and_train_the_strong_view(small_config, monkeypatch, name):
    weak_view, extra = SSL_CASES[name]
    view = PLAIN if weak_view == "plain" else WEAK
    algo, rec = build(
        small_config,
        monkeypatch,
        f"ssfl_args.algorithm={name}",
        *LABELS_AT_CLIENT,
        "data_args.labels_per_class_client=2",
        f"ssfl_args.weak_view={weak_view}",
        "ssfl_args.unlabeled_batch_size=6",
        *extra,
    )
    data = coded_data(0, 30, 12)
    algo.client_update(algo.message_for(0, 0), data, {}, CTX)
    calls = rec.trained()
    assert len(calls) == 2 == len(rec.calls)  # labeled, weak and strong views in one forward pass
    labeled = set(data.labeled_idx.tolist())
    for call in calls:
        x, u_weak, u_strong = call.grad[:8], call.grad[8:14], call.grad[14:]
        ids = call.ids
        assert set(ids[:8].tolist()) <= labeled and not set(ids[8:].tolist()) & labeled
        assert (call.views[:14] == view).all() and (call.views[14:] == STRONG).all()
        assert torch.equal(ids[8:14], ids[14:])  # the weak and strong halves are the same samples
        assert torch.equal(targets(x), data.labels[ids[:8]])  # l_s: the labeled view on its labels
        assert not took_loss(u_weak).any()  # the target is taken without gradient
        assert torch.equal(targets(u_strong), cls(ids[14:], view))  # l_u: A(u) towards the weak view's class


# ---- FedMatch: the agreement label from u, its cross-entropy on pi(u), the helpers on u -------------
@pytest.mark.parametrize("scenario", ["client", "server"])
def test_fedmatch_labels_by_the_plain_view_trains_the_strong_view_and_asks_helpers_on_the_plain_view(
    small_config, monkeypatch, scenario
):
    extra = [*LABELS_AT_CLIENT, "data_args.labels_per_class_client=2"] if scenario == "client" else []
    rec = Recorder(num_classes=C, eval_shift=3)  # the helper (eval mode) disagrees with the local model
    algo, rec = build(
        small_config,
        monkeypatch,
        "ssfl_args.algorithm=fedmatch",
        "ssfl_args.unlabeled_batch_size=6",
        *extra,
        recorder=rec,
    )
    msg = algo.message_for(0, 0)
    msg.weights[HELPER.format(0) + "bias"] = sparsify(torch.zeros(C), 0.0)  # one helper: psi_h = the client's psi
    msg.extras["num_helpers"] = 1
    data = coded_data(0, 30, 12)
    algo.client_update(msg, data, {}, CTX)
    trained = rec.trained()
    sigma_calls = [c for c in trained if (c.views == WEAK).all()]
    psi_calls = [c for c in trained if not (c.views == WEAK).all()]
    helper_calls = [c for c in rec.calls if not c.training]
    assert len(psi_calls) == len(helper_calls) == 2 and len(sigma_calls) == (2 if scenario == "client" else 0)
    for call in sigma_calls:  # Eq. 4: alpha(x) of the labeled batch towards its labels
        assert torch.equal(targets(call.grad), data.labels[call.ids])
    for call, helper in zip(psi_calls, helper_calls):
        plain, strong = call.grad[:6], call.grad[6:]
        assert (call.views[:6] == PLAIN).all() and (call.views[6:] == STRONG).all()
        assert torch.equal(call.ids[:6], call.ids[6:])
        # Eq. 2/3: the agreement label from u (a one-to-one vote: the local model's class), its CE on pi(u)
        assert torch.equal(targets(strong), cls(call.ids[6:], PLAIN))
        # Eq. 1: KL(p_h(u) || p_local(u)) pulls the local prediction on u towards the helper's on u
        assert (helper.views == PLAIN).all() and torch.equal(helper.ids, call.ids[:6]) and helper.grad is None
        assert torch.equal(targets(plain), cls(call.ids[:6], PLAIN, shift=3))


# ---- FedSiam: the online net on x + eta, the target net on x + eta', L on the labeled rows ------------
def test_fedsiam_online_and_target_see_independent_views_of_the_same_samples(small_config, monkeypatch):
    algo, rec = build(
        small_config,
        monkeypatch,
        "ssfl_args.algorithm=fedsiam",
        *LABELS_AT_CLIENT,
        "data_args.labels_per_class_client=2",
        "ssfl_args.variant=mt",
    )
    data = coded_data(0, 30, 12)
    algo.client_update(algo.message_for(0, 0), data, {}, CTX)
    online = rec.trained()
    target = [c for c in rec.calls if c.grad is None]
    assert len(online) == len(target) == 2 and all(c.net is not online[0].net for c in target)
    labeled = set(data.labeled_idx.tolist())
    for on, tg in zip(online, target):
        assert (on.views == WEAK).all() and (tg.views == WEAK).all()
        assert torch.equal(on.ids, tg.ids)  # J compares the two nets on the same samples, row by row
        assert (on.x[:, 0, 7, 7] != tg.x[:, 0, 7, 7]).all()  # eta' is another draw than eta
        assert set(on.ids[:8].tolist()) <= labeled and not set(on.ids[8:].tolist()) & labeled
        # L (Eq. 6) on the labeled rows only (J is flat here: both nets agree on every weak view)
        assert torch.equal(targets(on.grad[:8]), data.labels[on.ids[:8]]) and not took_loss(on.grad[8:]).any()


# ---- FedSEAL: y+ from the ensemble of the received model on x, CE on A(x), negatives on x -------------
def test_fedseal_trains_positives_on_the_strong_view_and_negatives_on_the_plain_view(small_config, monkeypatch):
    algo, rec = build(
        small_config,
        monkeypatch,
        "ssfl_args.algorithm=fedseal",
        "data_args.num_server_val=20",
        "ssfl_args.bootstrap_steps=0",
        "ssfl_args.server_steps=0",
    )
    msg = algo.message_for(0, 0)
    msg.extras["thresholds"] = torch.tensor([0.5, 1.0] * (C // 2))  # odd classes never pass: negatives
    data = coded_data(0, 30)
    algo.client_update(msg, data, {}, CTX)
    ensemble = [c for c in rec.calls if not c.training]
    assert len(ensemble) == 1 and (ensemble[0].views == PLAIN).all() and ensemble[0].grad is None
    trained = rec.trained()
    positive = [c for c in trained if (c.views == STRONG).all()]
    negative = [c for c in trained if (c.views == PLAIN).all()]
    assert len(positive) == len(negative) == 2 and len(trained) == 4  # two passes a step
    for call in positive:  # y+ = the received model's class of x, kept for the even classes
        assert (call.ids % 2 == 0).all()
        assert torch.equal(targets(call.grad), cls(call.ids, PLAIN))
    for call in negative:  # the samples that failed their class's threshold, unaugmented
        assert (call.ids % 2 == 1).all() and took_loss(call.grad).all()


# ---- SemiFL: the fix label from alpha(x) of the received model, L_fix on A(x), L_mix on alpha(mix) ------
def test_semifl_labels_by_the_weak_view_in_eval_mode_and_trains_fix_on_strong_and_mix_on_weak(
    small_config, monkeypatch
):
    rec = Recorder(num_classes=C, eval_shift=5)
    algo, rec = build(
        small_config,
        monkeypatch,
        "ssfl_args.algorithm=semifl",
        "ssfl_args.local_epochs=null",
        "ssfl_args.server_steps=0",
        recorder=rec,
    )
    data = coded_data(0, 30)
    algo.client_update(algo.message_for(0, 0), data, {}, CTX)
    label_pass = [c for c in rec.calls if not c.training]
    assert len(label_pass) == 1 and (label_pass[0].views == WEAK).all()
    assert torch.equal(label_pass[0].ids, data.unlabeled_idx)
    trained = rec.trained()
    fix = [c for c in trained if (c.views == STRONG).all()]
    mix = [c for c in trained if (c.views == WEAK).all()]
    assert len(fix) == len(mix) == 2 and len(trained) == 4  # two passes a step
    for call in fix:  # Eq. 3/5: A(x_fix) towards the received model's eval-mode class of alpha(x)
        assert torch.equal(targets(call.grad), cls(call.ids, WEAK, shift=5))
    for call in mix:  # Eq. 5: the mixture, weakly augmented, takes L_mix
        assert took_loss(call.grad).all()
