"""Schedules and thresholds at settings other than their defaults, pinned to the papers' formulas by value.

A schedule tested only at its default lets through a slip that agrees with the default: a warm-up that
is never taken (the default has none), a floor never reached, a ramp length or cap written as the
default's number, one threshold for every class. Each test here sets the knobs to values of its own
and reads what the algorithm's real objects did with them: the learning rate of every SGD step a real
client or server update took (:func:`sgd_rates`), the ramp values of a real job, the rows a real step
trained on (:mod:`tests.known_net`), the server's per-round values. The expected numbers are the
papers' formulas written out here.
"""

from __future__ import annotations

import math

import pytest
import torch
from torch.nn import functional as F

from fedml_ssfl.algorithms.base import ClientContext
from fedml_ssfl.algorithms.fedmatch import PSI
from fedml_ssfl.experiment import build_experiment
from fedml_ssfl.runtime.common import finish_round, start_round
from tests.known_net import STRONG, WEAK, Recorder, coded_data, ids_of, tag_views, took_loss, view_of

CPU = torch.device("cpu")
C = 10
LABELS_AT_CLIENT = [
    "data_args.label_scenario=client",
    "data_args.num_server_labels=0",
    "data_args.labels_per_class_client=2",
]


def ctx(r: int) -> ClientContext:
    return ClientContext(round_idx=r, device=CPU, seed=0)


@pytest.fixture
def sgd_rates(monkeypatch):
    """The learning rate of every ``torch.optim.SGD`` step taken from here on, in order."""
    rates: list[float] = []
    step = torch.optim.SGD.step

    def recorded(self, *args, **kwargs):
        rates.append(self.param_groups[0]["lr"])
        return step(self, *args, **kwargs)

    monkeypatch.setattr(torch.optim.SGD, "step", recorded)
    return rates


def eq9(step: int, *, gamma: float, T: int, R: int, warm_rounds: int, c: float, floor: float, kind: str) -> float:
    """Zhang et al. Eq. 9 (``cosine``) and the authors' CosineAnnealingLR (``cosine_annealing``) after a
    linear warm-up of ``warm_rounds`` rounds, at local iteration ``step`` of a run of R rounds of T steps."""
    warm, total = warm_rounds * T, R * T
    if step < warm:
        return gamma * (step + 1) / warm
    frac = (step - warm) / (total - warm)
    if kind == "cosine_annealing":
        return gamma * (1 + math.cos(math.pi * frac)) / 2
    return gamma * max(math.cos(math.pi * c * frac), floor)


SCHEDULE = dict(gamma=0.1, T=3, R=4, warm_rounds=1, c=0.9, floor=0.05)
SCHEDULE_ARGS = [
    "train_args.learning_rate=0.1",
    "train_args.local_steps=3",
    "train_args.comm_round=4",
    "train_args.lr_warmup_rounds=1",
    "train_args.lr_cosine_c=0.9",
    "train_args.lr_floor=0.05",
]


def build(small_config, *overrides):
    exp = build_experiment(small_config(*overrides))
    exp.algorithm.setup()
    return exp, exp.algorithm


# ---- Zhang et al. Eq. 9: warm-up, c, the floor; the cosine-annealing variant --------------------------
@pytest.mark.parametrize("kind", ["cosine", "cosine_annealing"])
def test_eq9_with_warm_up_and_floor_is_what_the_clients_and_the_server_step_at(small_config, sgd_rates, kind):
    exp, algo = build(small_config, "ssfl_args.algorithm=fedavg_ssl", *SCHEDULE_ARGS, f"train_args.lr_schedule={kind}")
    data = exp.client_data(0)
    expected = []
    for r in (0, 3):  # round 0 is the warm-up, round 3 has the floor (cosine: cos(0.9 pi 2/3) < 0.05)
        algo.client_update(algo.message_for(0, r), data, {}, ctx(r))
        algo.server_step(r)
        expected += [eq9(r * 3 + s, kind=kind, **SCHEDULE) for s in range(3)] * 2
    assert sgd_rates == pytest.approx(expected, rel=1e-12)
    if kind == "cosine":
        assert sgd_rates[-1] == pytest.approx(0.1 * 0.05)  # the floor gamma * epsilon holds
    assert sgd_rates[0] == pytest.approx(0.1 / 3)  # the first warm-up step


@pytest.mark.parametrize("name", ["server_only", "fedavg_sl", "local_sl"])
def test_supervised_parties_follow_eq9_from_the_rounds_own_step(small_config, sgd_rates, name):
    extra = LABELS_AT_CLIENT if name == "local_sl" else []
    exp, algo = build(small_config, f"ssfl_args.algorithm={name}", *SCHEDULE_ARGS, *extra)
    r = 2
    if name == "server_only":
        algo.server_step(r)
    else:
        algo.client_update(algo.message_for(1, r), exp.client_data(1, r), {}, ctx(r))
    assert sgd_rates == pytest.approx([eq9(r * 3 + s, kind="cosine", **SCHEDULE) for s in range(3)], rel=1e-12)


# ---- FixMatch's tau, UDA's T and beta, TSA's schedule, through the real step ----------------------------
def known_logits(x: torch.Tensor) -> torch.Tensor:
    """Sample i's plain / weak view: class ``i % C`` at logit ``0.5 + 0.35 (i % 17)`` (confidence 0.155 to
    0.98); its strong view: class ``(i + 2) % C`` at logit 2."""
    views, ids = view_of(x), ids_of(x)
    out = torch.zeros(x.shape[0], C)
    rows = torch.arange(x.shape[0])
    strong = views == STRONG
    out[rows, ids % C] = 0.5 + 0.35 * (ids % 17).float()
    out[rows[strong]] = 0.0
    out[rows[strong], (ids[strong] + 2) % C] = 2.0
    return out


def confidence(ids: torch.Tensor) -> torch.Tensor:
    """The softmax confidence of :func:`known_logits` on sample ``ids``' plain or weak view."""
    z = 0.5 + 0.35 * (ids % 17).double()
    return z.exp() / (z.exp() + C - 1)


def ssl_step(small_config, monkeypatch, name, *overrides, r=0):
    """One real client update of ``name`` on a KnownNet with :func:`known_logits`; its one forward pass."""
    tag_views(monkeypatch)
    exp = build_experiment(
        small_config(
            f"ssfl_args.algorithm={name}",
            *LABELS_AT_CLIENT,
            "train_args.batch_size=12",
            "ssfl_args.unlabeled_batch_size=40",
            "train_args.local_steps=1",
            *overrides,
        )
    )
    rec = Recorder(num_classes=C, logits=known_logits)
    algo = exp.algorithm
    algo.model_fn = rec.factory()
    algo.setup()
    rec.clear()
    data = coded_data(0, 40, 12)
    algo.client_update(algo.message_for(0, r), data, {}, ctx(r))
    (call,) = rec.trained()
    return algo, data, call


@pytest.mark.parametrize("name", ["fedavg_fixmatch", "fedprox_fixmatch", "local_fixmatch"])
def test_fixmatch_keeps_exactly_the_samples_at_or_above_its_configured_tau(small_config, monkeypatch, name):
    algo, data, call = ssl_step(small_config, monkeypatch, name, "ssfl_args.threshold=0.6")
    strong = call.views == STRONG
    kept = took_loss(call.grad[strong])
    expected = confidence(call.ids[strong]) >= 0.6
    assert torch.equal(kept, expected) and 0 < int(expected.sum()) < 40  # tau = 0.6 splits the batch


@pytest.mark.parametrize("name", ["fedavg_uda", "fedprox_uda", "local_uda"])
def test_uda_sharpens_at_its_temperature_masks_at_its_beta_and_anneals_by_tsa(small_config, monkeypatch, name):
    R, T, r = 4, 1, 2
    algo, data, call = ssl_step(
        small_config,
        monkeypatch,
        name,
        "ssfl_args.temperature=0.8",
        "ssfl_args.threshold=0.6",
        "ssfl_args.tsa=linear",
        f"train_args.comm_round={R}",
        "ssfl_args.weak_view=weak",
        r=r,
    )
    n_x = 12
    logits = call.out
    weak, strong = logits[n_x : n_x + 40], logits[n_x + 40 :]
    ids = call.ids[n_x : n_x + 40]
    # the consistency's gradient on A(u): lambda_u (softmax(s) - softmax(z / T)) 1(max softmax(z) >= beta) / N
    mask = (confidence(ids) >= 0.6).float()
    expected = (F.softmax(strong, dim=1) - F.softmax(weak / 0.8, dim=1)) * mask[:, None] / 40
    assert torch.allclose(call.grad[n_x + 40 :], expected.float(), atol=1e-7)
    # TSA (linear): a labeled sample counts while its correct-class probability is <= eta_t, t = (r T + s) / (R T)
    eta = (r * T / (R * T)) * (1 - 1 / C) + 1 / C
    labeled = took_loss(call.grad[:n_x])
    assert (call.views[:n_x] == WEAK).all()  # whose class is the label: its probability is the confidence
    assert torch.equal(labeled, confidence(call.ids[:n_x]) <= eta) and 0 < int(labeled.sum()) < n_x


# ---- FedMatch: the lambda terms of Eq. 5 at other weights ------------------------------------------------
def test_fedmatch_psi_loss_weighs_each_term_of_eq5_by_its_own_lambda(small_config):
    lam = {"lambda_a": 0.3, "lambda_i": 0.05, "lambda_l2": 2.0, "lambda_l1": 1e-3}
    exp, algo = build(
        small_config,
        "ssfl_args.algorithm=fedmatch",
        "train_args.local_steps=1",
        "train_args.client_num_per_round=3",
        "ssfl_args.tau=0.1",
        "ssfl_args.helper_interval=1",
        "ssfl_args.num_helpers=1",
        *(f"ssfl_args.{k}={v}" for k, v in lam.items()),
    )
    states: dict[int, dict] = {k: {} for k in range(4)}
    for r in (0, 1):  # round 0 makes its sampled clients seen; round 1 sends each of them a helper
        start = start_round(exp, r)
        replies = {
            k: algo.client_update(start.messages[k], exp.client_data(k, r), states[k], ctx(r)) for k in start.chosen
        }
        finish_round(exp, start, replies, 0)
    k = next(k for k in start.chosen if replies[k].extras["metrics"]["helpers"] == 1)
    m = replies[k].extras["metrics"]
    assert m["loss_kl"] > 0 and m["loss_agree"] > 0
    l1 = sum(float(t.abs().sum()) for key, t in states[k]["view"].items() if key.startswith(PSI))  # psi received
    expected = lam["lambda_a"] * m["loss_agree"] + lam["lambda_i"] * m["loss_kl"] + lam["lambda_l2"] * m["l2"]
    assert m["loss_u"] == pytest.approx(expected + lam["lambda_l1"] * l1, rel=1e-5)


# ---- FedSiam: the alpha and beta ramps, Eq. 11 and Eq. 12 -------------------------------------------------
def test_fedsiam_ramps_follow_their_cap_and_length_on_the_epoch_counter(small_config):
    exp, algo = build(
        small_config,
        "ssfl_args.algorithm=fedsiam",
        *LABELS_AT_CLIENT,
        "ssfl_args.variant=mt",
        "ssfl_args.local_epochs=2",
        "ssfl_args.alpha_max=0.84",
        "ssfl_args.beta_max=0.3",
        "ssfl_args.beta_rampup=8",
    )
    data = exp.client_data(0)
    job = algo.local_job(algo.message_for(0, 0), data, {"participations": 1}, ctx(0))
    per_epoch = math.ceil(data.num_unlabeled / 32)
    counters = [2 * 2 + e + 1 for e in (0, 1) for _ in range(per_epoch)]  # p E + e + 1 in its 2nd round
    alphas = [min(1 - 1 / (c + 1), 0.84) for c in counters]  # Eq. 9's ramp under its cap: 0.833, then 0.84
    betas = [0.3 * math.exp(-5 * (1 - min(c / 8, 1)) ** 2) for c in counters]
    assert job.follower.alphas.tolist() == pytest.approx(alphas, rel=1e-12)
    assert job.consts["beta"].tolist() == pytest.approx(betas, rel=1e-6)
    assert alphas[0] < 0.84 == alphas[-1]


@pytest.mark.parametrize("schedule, mu", [("linear", 0.25), ("rectangle", 0.7)])
def test_fedsiam_tau_follows_eq11_and_eq12_at_other_tipping_points_and_mu(small_config, schedule, mu):
    R, phi, varphi = 12, 2, 7
    exp, algo = build(
        small_config,
        "ssfl_args.algorithm=fedsiam",
        *LABELS_AT_CLIENT,
        "ssfl_args.variant=d",
        f"ssfl_args.tau_schedule={schedule}",
        f"train_args.comm_round={R}",
        f"ssfl_args.phi_g={phi}",
        f"ssfl_args.varphi_g={varphi}",
        f"ssfl_args.mu={mu}",
    )
    taus = []
    for r in range(R):
        algo.server_step(r)
        taus.append(algo.tau_now)
    expected = []
    for r_g in range(1, R + 1):
        if schedule == "linear":  # Eq. 11
            value = 0.0 if r_g <= phi else -2 * (1 - mu) * R / (R - phi) ** 2 * (r_g - R)
        else:  # Eq. 12
            value = (1 - mu) * R / (varphi - phi) if phi < r_g < varphi else 0.0
        expected.append(min(1.0, max(0.0, value)))
    assert taus == pytest.approx(expected, rel=1e-12)
    assert 0 < min(t for t in taus if t > 0) < 1  # values the clip does not hide


# ---- FedSEAL: class-wise thresholds of different values, the lambda ramp -----------------------------------
def test_fedseal_keeps_a_positive_by_the_threshold_of_its_own_class(small_config, monkeypatch):
    tag_views(monkeypatch)
    exp, algo = build(
        small_config,
        "ssfl_args.algorithm=fedseal",
        "data_args.num_server_val=20",
        "ssfl_args.bootstrap_steps=0",
        "ssfl_args.server_steps=0",
        "ssfl_args.lambda_start=0.2",
        "ssfl_args.lambda_end=0.8",
        "ssfl_args.lambda_rampup_rounds=4",
        "train_args.batch_size=100",
        "train_args.local_steps=1",
    )
    rec = Recorder(num_classes=C, logits=known_logits)
    algo.model_fn = rec.factory()
    algo.setup()
    rec.clear()
    r = 2
    msg = algo.message_for(0, r)
    tau = torch.tensor([0.2 + 0.07 * c for c in range(C)])  # a different threshold for every class
    msg.extras["thresholds"] = tau
    data = coded_data(0, 60)
    ids = data.unlabeled_idx
    conf = confidence(ids)
    expected = conf >= tau[ids % C].double()
    assert expected.any() and not expected.all()
    assert (expected != (conf >= float(tau.mean()))).any()  # one shared threshold would keep others
    job = algo.local_job(msg, data, {}, ctx(r))
    assert job.notes["metrics"]["mask_rate"] == pytest.approx(float(expected.float().mean()))
    assert job.loss.positive_weight == pytest.approx(0.2 + (0.8 - 0.2) * r / 4)  # the linear lambda ramp
    rec.clear()
    algo.client_update(msg, data, {}, ctx(r))
    positive = [c for c in rec.trained() if (c.views == STRONG).all()]
    assert len(positive) == 1 and sorted(positive[0].ids.tolist()) == sorted(ids[expected].tolist())


# ---- SemiFL: lambda of Eq. 6, the client's B_m beside the server's B_s, the round's annealed rate ------------
def test_semifl_weighs_l_mix_by_lambda_steps_at_b_m_and_at_the_rounds_annealed_rate(
    small_config, monkeypatch, sgd_rates
):
    tag_views(monkeypatch)

    def client_round(loss_lambda):
        exp, algo = build(
            small_config,
            "ssfl_args.algorithm=semifl",
            "ssfl_args.local_epochs=null",
            "ssfl_args.server_steps=0",
            "ssfl_args.server_batch_size=5",
            f"ssfl_args.loss_lambda={loss_lambda}",
            "train_args.batch_size=8",
            "train_args.local_steps=2",
            "train_args.comm_round=5",
            "train_args.lr_warmup_rounds=1",
            "train_args.lr_schedule=cosine_annealing",
        )
        rec = Recorder(num_classes=C)
        algo.model_fn = rec.factory()
        algo.setup()
        rec.clear()
        sgd_rates.clear()
        algo.client_update(algo.message_for(0, 3), coded_data(0, 30), {}, ctx(3))
        return rec.trained(), list(sgd_rates)

    full, rates = client_round(1.0)
    part, _ = client_round(0.4)
    # the round's rate, once for the round: (1 + cos(pi (3 T - T) / (5 T - T))) / 2 after one warm-up round
    assert rates == pytest.approx([0.03 * (1 + math.cos(math.pi * 2 / 4)) / 2] * 2, rel=1e-12)
    assert len(full) == len(part) == 4 and all(c.x.shape[0] == 8 for c in full)  # B_m = 8, not B_s = 5
    for a, b in zip(full, part):
        scale = 0.4 if (a.views == WEAK).all() else 1.0  # L_fix + lambda L_mix: only the mixture's loss scales
        assert torch.allclose(b.grad, scale * a.grad, atol=1e-9) and took_loss(a.grad).any()
