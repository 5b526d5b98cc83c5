"""FedSiam (Long et al. 2021): FSM, tau schedules, the boundary, the upload rule, EMA, ramps, e2e, resume.

The mechanism tests (EMA target, ramp counter, beta weight, FSM layer choice, borrowing, the
server's target update, FedSiam-D refused at the server) are exact checks on a tiny model; the
mutants in ``tests/mutants.yaml`` name them.
"""

from __future__ import annotations

import json
import math

import pytest
import torch
from torch import nn

from fedml_ssfl import stacked as stacked_module
from fedml_ssfl.algorithms import fedsiam as fedsiam_module
from fedml_ssfl.algorithms.base import (
    ClientContext,
    ClientData,
    DataInfo,
    Message,
    ServerData,
    TrainSettings,
    message_nbytes,
)
from fedml_ssfl.algorithms.fedsiam import (
    ONLINE_PREFIX,
    FedSiam,
    FedSiamConfig,
    FSMWindow,
    ema_alpha,
    ema_pairs,
    ema_update,
    epoch_counter,
    fsm,
    layer_groups,
    linear_tau,
    quantile_boundary,
    rectangle_tau,
)
from fedml_ssfl.config import ConfigError, validate
from fedml_ssfl.models import build_model
from fedml_ssfl.runtime.local import run_local
from fedml_ssfl.ssl.consistency import sigmoid_rampup
from tests.conftest import resume_matches_uninterrupted

CPU = torch.device("cpu")


# ---- Eq. 10 ----------------------------------------------------------------------------------------
def test_layers_are_modules_and_fsm_is_exact_on_hand_made_layers() -> None:
    keys = ["conv.weight", "conv.bias", "bn.weight", "bn.num_batches_tracked", "fc.weight", "scale"]
    groups = layer_groups(keys)
    assert groups == {
        "conv": ["conv.weight", "conv.bias"],
        "bn": ["bn.weight", "bn.num_batches_tracked"],
        "fc": ["fc.weight"],
        "scale": ["scale"],
    }
    online = {
        "conv.weight": torch.tensor([3.0, 0.0]),  # the layer's online norm: ||(3, 0, 4)|| = 5
        "conv.bias": torch.tensor([4.0]),
        "bn.weight": torch.tensor([2.0, 0.0]),
        "bn.num_batches_tracked": torch.tensor(7),  # integer buffers do not count
        "fc.weight": torch.tensor([[1.0, 1.0], [1.0, 1.0]]),  # norm 2
        "scale": torch.tensor([0.0]),
    }
    target = {
        "conv.weight": torch.tensor([3.0, 1.0]),  # difference (0, 1, 0): 1 / 5
        "conv.bias": torch.tensor([4.0]),
        "bn.weight": torch.tensor([2.0, 0.0]),  # identical: 0
        "bn.num_batches_tracked": torch.tensor(99),
        "fc.weight": torch.tensor([[0.0, 1.0], [1.0, 3.0]]),  # difference norm sqrt(1 + 4): sqrt(5) / 2
        "scale": torch.tensor([0.0]),  # 0 / 0 -> 0
    }
    got = fsm(target, online, groups)
    assert got.dtype == torch.float64 and got.shape == (4,)
    assert got.tolist() == pytest.approx([0.2, 0.0, math.sqrt(5) / 2, 0.0], rel=1e-12)
    # direction: divided by the ONLINE layer's norm (Eq. 10), not the target's
    assert fsm(online, target, groups)[0].item() == pytest.approx(1 / math.sqrt(26), rel=1e-12)


# ---- Eq. 11 / 12 -----------------------------------------------------------------------------------
def test_linear_schedule_at_its_tipping_points() -> None:
    # R_G = 50, phi_g = 3: 0 up to R_g = 3, then 2 (1 - mu) R_G (R_G - R_g) / (R_G - phi_g)^2
    assert linear_tau(3, 50, 3, 0.8) == 0.0
    assert linear_tau(4, 50, 3, 0.8) == pytest.approx(2 * 0.2 * 50 * 46 / 47**2)  # 0.41648
    assert linear_tau(49, 50, 3, 0.8) == pytest.approx(2 * 0.2 * 50 / 47**2)
    assert linear_tau(50, 50, 3, 0.8) == 0.0
    # mu = 0.5 starts above 1 (50 * 46 / 47^2 = 1.0412); the config clips it (R_g = round + 1)
    assert linear_tau(4, 50, 3, 0.5) == pytest.approx(1.04120, abs=1e-5)
    cfg = FedSiamConfig(variant="d", tau_schedule="linear", mu=0.5)
    assert cfg.first_tipping_point == 3 and cfg.window_length == 3
    assert [cfg.tau(r, 50) for r in (0, 1, 2)] == [0.0, 0.0, 0.0]
    assert cfg.tau(3, 50) == 1.0 and cfg.tau(4, 50) == 1.0  # 1.0412, 1.0186 clipped
    assert cfg.tau(5, 50) == pytest.approx(50 * 44 / 47**2)  # 0.9959, the first value below 1
    assert cfg.tau(49, 50) == 0.0
    # over the run tau averages 1 - mu (unclipped)
    assert sum(linear_tau(r, 50, 3, 0.5) for r in range(1, 51)) / 50 == pytest.approx(0.5, abs=0.011)


def test_rectangle_schedule_at_its_tipping_points() -> None:
    height = (1 - 0.5) * 50 / (40 - 10)  # 0.8333
    values = {r: rectangle_tau(r, 50, 10, 40, 0.5) for r in (9, 10, 11, 39, 40, 41)}
    assert values == {9: 0.0, 10: 0.0, 11: pytest.approx(height), 39: pytest.approx(height), 40: 0.0, 41: 0.0}
    cfg = FedSiamConfig(variant="d", tau_schedule="rectangle")
    assert cfg.first_tipping_point == 10 and cfg.varphi_g == 40 and cfg.mu == 0.5
    assert [cfg.tau(r, 50) for r in (9, 10, 38, 39)] == [0.0, pytest.approx(height), pytest.approx(height), 0.0]
    # the variants' tau and alpha (Sec. 4.1 and the Remark of Sec. 3.3.3)
    pi, mt, d = FedSiamConfig(variant="pi"), FedSiamConfig(variant="mt"), FedSiamConfig(variant="d")
    assert [pi.tau(r, 50) for r in (0, 20)] == [0.0, 0.0] and [mt.tau(r, 50) for r in (0, 20)] == [1.0, 1.0]
    assert pi.alpha(20, 5000) == 0.0 and mt.alpha(0, 1) == 0.5
    assert d.alpha(2, 5000) == 0.0 and d.alpha(3, 5000) == 0.999  # alpha = 0 while R_g <= phi_g


# ---- Sec. 3.3.2 ------------------------------------------------------------------------------------
def test_quantile_boundary_over_the_window() -> None:
    window = FSMWindow(rounds=2)
    window.push(torch.tensor([[0.9, 0.8], [0.7, 0.6]]))  # round 1 (two clients x two layers): leaves
    window.push(torch.tensor([0.1, 0.2, 0.3]))  # round 2
    window.push(torch.tensor([0.5, 0.4]))  # round 3: Lambda = [0.1 .. 0.5]
    assert sorted(window.values().tolist()) == pytest.approx([0.1, 0.2, 0.3, 0.4, 0.5])
    # boundary = (1 - tau)-quantile: a fraction tau of Lambda lies at or above it
    assert window.boundary(0.5) == pytest.approx(0.3)
    assert window.boundary(0.25) == pytest.approx(0.4)
    assert window.boundary(0.1) == pytest.approx(0.46)  # linear interpolation between 0.4 and 0.5
    assert window.boundary(0.75) == pytest.approx(0.2)
    assert window.boundary(1.0) == 0.0  # every layer passes
    assert window.boundary(0.0) == math.inf  # no layer passes
    assert quantile_boundary(torch.zeros(0), 0.5) == 0.0  # no FSM yet: upload all
    restored = FSMWindow(rounds=7)
    restored.load_state_dict(window.state_dict())
    assert restored.rounds == 2 and torch.equal(restored.values(), window.values())


# ---- Eq. 9 -----------------------------------------------------------------------------------------
def test_ema_ramp_and_the_target_after_one_step_on_a_tiny_model() -> None:
    assert [ema_alpha(t, 0.999) for t in (0, 1, 3, 9, 998)] == pytest.approx([0.0, 0.5, 0.75, 0.9, 0.998999])
    assert ema_alpha(999, 0.999) == pytest.approx(0.999) and ema_alpha(10_000, 0.999) == 0.999
    online, target = nn.Linear(2, 1), nn.Linear(2, 1)
    with torch.no_grad():
        online.weight.copy_(torch.tensor([[1.0, 2.0]]))
        online.bias.fill_(0.5)
        target.weight.copy_(torch.tensor([[3.0, -1.0]]))
        target.bias.fill_(1.5)
    opt = torch.optim.SGD(online.parameters(), lr=0.1)
    online(torch.tensor([[2.0, 4.0]])).sum().backward()  # d/dw = (2, 4), d/db = 1
    opt.step()  # online: w = (0.8, 1.6), b = 0.4
    alpha = ema_alpha(3, 0.999)  # 0.75
    ema_update(ema_pairs(target, online), alpha)
    assert target.weight[0].tolist() == pytest.approx([0.75 * 3 + 0.25 * 0.8, 0.75 * -1 + 0.25 * 1.6])
    assert target.bias.item() == pytest.approx(0.75 * 1.5 + 0.25 * 0.4)
    ema_update(ema_pairs(target, online), 0.0)  # alpha = 0 (Pi): the target is the online net
    assert torch.equal(target.weight, online.weight) and torch.equal(target.bias, online.bias)
    bn_t, bn_s = nn.BatchNorm1d(2), nn.BatchNorm1d(2)
    bn_s.num_batches_tracked.fill_(5)
    bn_s.running_mean.fill_(1.0)
    ema_update(ema_pairs(bn_t, bn_s), 0.5)
    assert bn_t.num_batches_tracked.item() == 5 and bn_t.running_mean.tolist() == [0.5, 0.5]


# ---- the algorithm on a tiny model ----------------------------------------------------------------------
INFO = DataInfo(num_classes=3, in_channels=1, image_size=8, mean=(0.5,), std=(0.25,), flip=False)


def _model_fn() -> nn.Module:
    return build_model("cnn28", num_classes=3, in_channels=1, image_size=8, norm="gn")


def _tiny(server_labels: int = 0, steps: int = 4, model_fn=_model_fn, **cfg) -> tuple[FedSiam, ClientData]:
    """A FedSiam on a 3-class 8x8 cnn28; labels-at-server iff ``server_labels > 0``."""
    gen = torch.Generator().manual_seed(0)
    images = torch.randint(0, 256, (60, 1, 8, 8), generator=gen, dtype=torch.uint8)
    labels = torch.randint(0, 3, (60,), generator=gen)
    scenario = "server" if server_labels else "client"
    server = ServerData(images, labels, torch.arange(0, server_labels), torch.arange(0), 3, scenario)
    algo = FedSiam(
        FedSiamConfig(**cfg),
        model_fn,
        server,
        INFO,
        TrainSettings(local_steps=steps, batch_size=8, comm_round=10, learning_rate=0.1, lr_schedule="constant"),
        CPU,
        0,
    )
    algo.setup()
    data = ClientData(0, images, labels, torch.arange(20, 60), torch.arange(10, 20), 3)
    return algo, data


def _message(algo: FedSiam, tau: float, boundary: float) -> Message:
    algo.server_step(0)
    msg = algo.message_for(0, 0)
    return Message(weights=msg.weights, extras={**msg.extras, "tau": tau, "boundary": boundary})


def _bytes(state: dict[str, torch.Tensor], keys) -> int:
    return sum(state[k].numel() * state[k].element_size() for k in keys)


def test_pi_sends_no_online_layer_mt_all_and_d_those_above_the_boundary() -> None:
    ctx = ClientContext(0, CPU, 0)
    model_keys = set(_model_fn().state_dict())
    online_keys = {ONLINE_PREFIX + k for k in model_keys}
    algo, data = _tiny(variant="pi")
    full = _bytes(algo.global_state, model_keys)  # one model, float32

    algo.server_step(0)
    down = algo.message_for(0, 0)
    assert set(down.weights) == model_keys  # Pi: the target only, both ways
    assert message_nbytes(down) == full + 24  # + round, tau, boundary
    pi = algo.client_update(down, data, {}, ctx)
    assert set(pi.weights) == model_keys and message_nbytes(pi) == full
    assert pi.extras["metrics"]["fsm_mean"] == 0.0  # alpha = 0: the target IS the online net

    algo, _ = _tiny(variant="mt")
    algo.server_step(0)
    down = algo.message_for(0, 0)
    assert set(down.weights) == model_keys | online_keys and message_nbytes(down) == 2 * full + 24
    mt = algo.client_update(down, data, {}, ctx)
    assert set(mt.weights) == model_keys | online_keys and message_nbytes(mt) == 2 * full
    assert mt.extras["metrics"]["online_frac"] == 1.0 and mt.extras["metrics"]["fsm_mean"] > 0

    # D: the same update (fresh state, same context) with tau = 1 gives the FSM; then a boundary mid-ranking
    algo, _ = _tiny(variant="d", phi_g=0)
    every = algo.client_update(_message(algo, 1.0, 0.0), data, {}, ctx)
    divergence = every.extras["fsm"]
    groups = layer_groups(algo.global_state)
    assert divergence.shape == (len(groups),) and set(every.weights) == model_keys | online_keys
    beyond = algo.client_update(_message(algo, 1.0, 1e9), data, {}, ctx)  # tau = 1 sends all, whatever the boundary
    assert set(beyond.weights) == model_keys | online_keys
    ranked = sorted(divergence.tolist())
    boundary = (ranked[3] + ranked[4]) / 2  # between two layers: no float32 / float64 tie at the boundary
    d = algo.client_update(_message(algo, 0.5, boundary), data, {}, ctx)
    assert torch.equal(d.extras["fsm"], divergence)
    chosen = [name for j, name in enumerate(groups) if divergence[j] >= boundary]
    assert 0 < len(chosen) < len(groups)
    sent = {ONLINE_PREFIX + k for name in chosen for k in groups[name]}
    assert set(d.weights) == model_keys | sent  # exactly the layers with FSM >= boundary (Eq. 10, 3.3.2)
    for k in sent:  # the ONLINE net's layer (the same update as `every`), not the target's
        assert torch.equal(d.weights[k], every.weights[k])
        assert not torch.equal(d.weights[k], d.weights[k[len(ONLINE_PREFIX) :]])
    fsm_bytes = 4 * len(groups)
    online_bytes = _bytes(algo.global_state, [k[len(ONLINE_PREFIX) :] for k in sent])
    assert message_nbytes(d) == full + online_bytes + fsm_bytes
    assert full + fsm_bytes < message_nbytes(d) < 2 * full + fsm_bytes
    none = algo.client_update(_message(algo, 0.0, 0.0), data, {}, ctx)  # tau = 0: target only
    assert set(none.weights) == model_keys and message_nbytes(none) == full + fsm_bytes


# ---- mechanism spies: what Eq. 9 read and what weight J got -----------------------------------------------
def _spy_ema(monkeypatch, algo: FedSiam, slot: str) -> list[tuple[float, dict[str, torch.Tensor]]]:
    """Record, at every Eq. 9 update, its alpha and the state of the online net in scratch ``slot``.

    The online net is read from the model itself, not from the pairs handed to ``ema_update``,
    so that pairs built the wrong way round show up. The server's update is FedSiam's own, a
    client's the job trainer's (its target is the job's Follower, fedml_ssfl/stacked.py).
    """
    calls: list[tuple[float, dict[str, torch.Tensor]]] = []
    real = fedsiam_module.ema_update

    def spy(pairs, alpha):
        calls.append((alpha, {k: v.detach().clone() for k, v in algo._scratch[slot].state_dict().items()}))
        real(pairs, alpha)

    monkeypatch.setattr(fedsiam_module if slot == "server" else stacked_module, "ema_update", spy)
    return calls


def _hand_ema(start: dict[str, torch.Tensor], onlines, alphas) -> dict[str, torch.Tensor]:
    """Eq. 9 by hand: ``theta_t <- alpha theta_t + (1 - alpha) theta_s`` after each recorded step."""
    out = {k: v.clone() for k, v in start.items()}
    for alpha, online in zip(alphas, onlines, strict=True):
        for k, v in out.items():
            out[k] = alpha * v + (1 - alpha) * online[k] if v.is_floating_point() else online[k].clone()
    return out


def _close(a: dict[str, torch.Tensor], b: dict[str, torch.Tensor]) -> bool:
    return all(torch.allclose(a[k], b[k], rtol=1e-5, atol=1e-6) for k in b)


def _spy_consistency_weight(monkeypatch, name: str) -> list[float]:
    """Record d(loss)/dJ at every client step: the weight J actually has in the update (Eq. 7/8)."""
    grads: list[float] = []
    real = getattr(fedsiam_module, name)

    def spy(logits, probs):
        j = real(logits, probs)
        j.register_hook(lambda g: grads.append(float(g)))
        return j

    monkeypatch.setattr(fedsiam_module, name, spy)
    return grads


def _target(msg: Message) -> dict[str, torch.Tensor]:
    return {k: v for k, v in msg.weights.items() if not k.startswith(ONLINE_PREFIX)}


# ---- Eq. 9 on a client: alpha per local epoch (the authors' counter) ---------------------------------------
def test_client_target_is_the_eq9_ema_with_alpha_constant_per_local_epoch(monkeypatch) -> None:
    # local_epochs = 2 over 40 unlabeled samples at batch 8: 5 steps an epoch, 10 a round. The
    # counter is the authors' c = p E + e + 1 (p: the client's participation, 1-based; e: epoch)
    algo, data = _tiny(variant="mt", local_epochs=2)
    calls = _spy_ema(monkeypatch, algo, "client")
    state: dict = {}
    for p, r in ((1, 0), (2, 5)):  # the second participation is round 5: p counts participations
        calls.clear()
        algo.server_step(r)
        msg = algo.message_for(0, r)
        reply = algo.client_update(msg, data, state, ClientContext(r, CPU, 0))
        assert [epoch_counter(p, 2, e) for e in (0, 1)] == [2 * p + 1, 2 * p + 2]
        alphas = [1 - 1 / (2 * p + 1 + e + 1) for e in (0, 1) for _ in range(5)]  # 0.75, 0.8; 5/6, 6/7
        assert [a for a, _ in calls] == pytest.approx(alphas, abs=1e-15)
        assert _close(_target(reply), _hand_ema(_target(msg), [o for _, o in calls], alphas))
        assert all(torch.equal(reply.weights[ONLINE_PREFIX + k], v) for k, v in calls[-1][1].items())
        metrics = reply.extras["metrics"]
        assert metrics["alpha"] == pytest.approx(alphas[-1]) and metrics["ramp_counter"] == 2 * p + 2
        algo.aggregate({0: reply}, r)
    assert state == {"steps": 20, "participations": 2}  # nothing else with a synchronised target


def test_ramp_unit_epoch_counts_a_round_as_one_epoch_and_step_counts_steps(monkeypatch) -> None:
    # local_epochs null: a round's T = 4 steps are one local epoch, c = p + 1, alpha = 1 - 1/(p + 2)
    algo, data = _tiny(variant="mt", steps=4)
    assert algo.config.ramp_unit == "epoch"
    calls = _spy_ema(monkeypatch, algo, "client")
    state: dict = {}
    for p in (1, 2, 3):
        calls.clear()
        algo.server_step(0)
        algo.client_update(algo.message_for(0, 0), data, state, ClientContext(0, CPU, 0))
        assert [a for a, _ in calls] == [1 - 1 / (p + 2)] * 4
    # ramp_unit: step counts the client's SGD steps across rounds, 1 for the first (alpha 0.5)
    algo, data = _tiny(variant="mt", steps=4, ramp_unit="step")
    calls = _spy_ema(monkeypatch, algo, "client")
    state = {}
    for r in (0, 1):
        algo.server_step(r)
        algo.client_update(algo.message_for(0, r), data, state, ClientContext(r, CPU, 0))
    assert [a for a, _ in calls] == pytest.approx([ema_alpha(t, 0.999) for t in range(1, 9)])
    assert state == {"steps": 8, "participations": 2}
    # Pi: alpha 0 at every step (the target is the online net); FedSiam-D: 0 until phi_g
    algo, data = _tiny(variant="pi")
    calls = _spy_ema(monkeypatch, algo, "client")
    algo.server_step(7)
    reply = algo.client_update(algo.message_for(0, 7), data, {"participations": 40}, ClientContext(7, CPU, 0))
    assert [a for a, _ in calls] == [0.0] * 4 and reply.extras["metrics"]["fsm_mean"] == 0.0


# ---- beta^k: the sigmoid ramp over the epoch counter, and J's weight in the update ---------------------
def test_j_compares_the_online_view_with_an_independent_target_view() -> None:
    """Eq. 4: J is between f(x + eta; theta_s) and f(x + eta'; theta_t), two draws of the weak view.

    FedSiam-Pi on a GroupNorm net: the target is the online net at every step (alpha 0), so J is
    above zero only because eta and eta' differ; with one view for both it would be exactly 0.
    """
    algo, data = _tiny(variant="pi")
    algo.server_step(0)
    reply = algo.client_update(algo.message_for(0, 0), data, {}, ClientContext(0, CPU, 0))
    assert reply.extras["metrics"]["consistency"] > 1e-6


@pytest.mark.parametrize(
    ("cfg", "name", "beta_max"),
    [
        ({}, "softmax_mse", 1 / 3),  # the authors' effective weight on Eq. 4's class sum: 1 / C
        ({"consistency": "kl"}, "kl_consistency", 1.0),  # their KL is not divided by C
        ({"beta_max": 0.5}, "softmax_mse", 0.5),
    ],
)
def test_beta_follows_the_sigmoid_ramp_over_the_epoch_counter_and_weights_j(monkeypatch, cfg, name, beta_max):
    algo, data = _tiny(variant="mt", local_epochs=2, **cfg)
    grads = _spy_consistency_weight(monkeypatch, name)
    state: dict = {}
    for p in (1, 2):  # the same round twice: the ramp counts the client's epochs, not rounds
        grads.clear()
        algo.server_step(0)
        reply = algo.client_update(algo.message_for(0, 0), data, state, ClientContext(0, CPU, 0))
        betas = [beta_max * sigmoid_rampup(2 * p + e + 1, 10) for e in (0, 1) for _ in range(5)]
        assert grads == pytest.approx(betas, rel=1e-6)  # d loss / d J = beta^k at every step (Eq. 7)
        assert reply.extras["metrics"]["beta"] == pytest.approx(betas[-1])
        assert "ce" in reply.extras["metrics"] and reply.extras["metrics"]["consistency"] > 0
    assert grads[0] == pytest.approx(beta_max * math.exp(-5 * 0.5**2), rel=1e-6)  # c = 5 of phi_l = 10
    # beta_ramp_unit: round ramps over the global round index instead
    algo, data = _tiny(variant="mt", beta_ramp_unit="round", **cfg)
    grads = _spy_consistency_weight(monkeypatch, name)
    algo.server_step(4)
    algo.client_update(algo.message_for(0, 4), data, {"participations": 9}, ClientContext(4, CPU, 0))
    assert grads == pytest.approx([beta_max * sigmoid_rampup(4, 10)] * 4, rel=1e-6)


def test_beta_max_defaults_to_the_authors_weight() -> None:
    assert FedSiamConfig().beta_max is None
    assert FedSiamConfig().beta_weight(10) == pytest.approx(0.1)  # MSE: their softmax_mse_loss / C
    assert FedSiamConfig(consistency="kl").beta_weight(10) == 1.0
    assert FedSiamConfig(beta_max=2.0).beta_weight(10) == 2.0
    assert FedSiamConfig().beta(11, 10) == pytest.approx(0.1) and FedSiamConfig().beta(10, 10) == pytest.approx(0.1)
    assert FedSiamConfig(beta_rampup=0).beta(0, 4) == 0.25  # no ramp


# ---- labels-at-server: Eq. 8 on the server, Eq. 9 on the global target -----------------------------------
@pytest.mark.parametrize("variant", ["mt", "pi"])
def test_server_steps_move_the_global_target_by_eq9(monkeypatch, variant) -> None:
    algo, _ = _tiny(server_labels=20, steps=4, variant=variant)
    calls = _spy_ema(monkeypatch, algo, "server")
    # an aggregate pair whose target differs from its online net, as after a round
    algo.agg_target = {k: v + 0.05 for k, v in algo.global_state.items()}
    agg_online = dict(algo.agg_online)
    for u in (0, 3):
        calls.clear()
        algo.server_step(u)
        # the authors' server counter q = u T + s, 0 on the very first server step; Pi: alpha 0
        alphas = [ema_alpha(u * 4 + s, 0.999) if variant == "mt" else 0.0 for s in range(4)]
        assert [a for a, _ in calls] == pytest.approx(alphas, abs=1e-15)
        assert all(torch.equal(algo.global_state[k], v) for k, v in calls[-1][1].items())  # L trained G
        assert not torch.equal(algo.global_state["fc.weight"], agg_online["fc.weight"])
        assert _close(algo.global_target, _hand_ema(algo.agg_target, [o for _, o in calls], alphas))
        if variant == "pi":
            assert all(torch.equal(algo.global_target[k], algo.global_state[k]) for k in algo.global_state)
        else:
            assert not torch.equal(algo.global_target["fc.weight"], algo.agg_target["fc.weight"])
            assert not torch.equal(algo.global_target["fc.weight"], algo.global_state["fc.weight"])
    calls.clear()
    algo.finalize()  # one more server update, counter index comm_round = 10
    assert [a for a, _ in calls] == pytest.approx(
        [ema_alpha(40 + s, 0.999) if variant == "mt" else 0.0 for s in range(4)]
    )
    msg = algo.message_for(1, 3)
    assert all(torch.equal(msg.weights[k], algo.global_target[k]) for k in algo.global_target)  # the clients' target


def test_labels_at_server_clients_train_j_only() -> None:
    for variant in ("pi", "mt"):
        algo, data = _tiny(server_labels=20, variant=variant)
        algo.server_step(0)
        unlabeled = ClientData(1, data.images, data.labels, data.unlabeled_idx, torch.arange(0), 3)
        reply = algo.client_update(algo.message_for(1, 0), unlabeled, {}, ClientContext(0, CPU, 0))
        assert "ce" not in reply.extras["metrics"] and reply.num_samples == 40  # J only (Eq. 8)
        nothing = ClientData(2, data.images, data.labels, torch.arange(0), torch.arange(0), 3)
        assert algo.client_update(algo.message_for(2, 0), nothing, {}, ClientContext(0, CPU, 0)).is_empty
    with pytest.raises(ConfigError, match=r"ssfl_args\.variant: d .*Sec\. 4\.3"):
        _tiny(server_labels=20, variant="d")  # also when built without a config check
    assert _tiny(server_labels=20)[0].config.variant == "mt" and _tiny()[0].config.variant == "d"


def test_client_keeps_its_own_target_without_sync() -> None:
    local, data = _tiny(variant="mt", steps=2, target_sync=False)
    state: dict = {}
    local.server_step(0)
    reply = local.client_update(local.message_for(0, 0), data, state, ClientContext(0, CPU, 0))
    assert set(state) == {"steps", "participations", "target"} and state["steps"] == 2
    assert all(torch.equal(state["target"][k], reply.weights[k]) for k in state["target"])
    assert all(v.device.type == "cpu" for v in state["target"].values())
    # the next round starts from the client's own target, not the global one
    local.aggregate({0: reply}, 0)
    local.global_target = {k: torch.zeros_like(v) for k, v in local.global_target.items()}
    local.server_step(1)
    again = local.client_update(local.message_for(0, 1), data, dict(state), ClientContext(1, CPU, 0))
    synced = local.client_update(
        local.message_for(0, 1), data, {"steps": 2, "participations": 1}, ClientContext(1, CPU, 0)
    )  # no target in the state: it starts from the (zeroed) global target
    assert not torch.equal(again.weights["fc.weight"], synced.weights["fc.weight"])


def test_aggregation_borrows_missing_online_layers_from_the_target_weighted_by_samples() -> None:
    algo, _ = _tiny(variant="d")
    keys = list(algo.global_state)
    t_a = {k: torch.full_like(v, 1.0) for k, v in algo.global_state.items()}
    t_b = {k: torch.full_like(v, 5.0) for k, v in algo.global_state.items()}
    fc_online = {ONLINE_PREFIX + k: torch.full_like(algo.global_state[k], 9.0) for k in ("fc.weight", "fc.bias")}
    replies = {
        0: Message(weights={**t_a, **fc_online}, num_samples=1, extras={"fsm": torch.ones(7)}),
        1: Message(weights=t_b, num_samples=3, extras={"fsm": torch.zeros(7)}),
    }
    algo.tau_now = 0.5
    metrics = algo.aggregate(replies, 4)
    for k in keys:
        assert torch.allclose(algo.global_target[k], torch.full_like(t_a[k], (1 * 1 + 3 * 5) / 4)), k
        online = (1 * 9 + 3 * 5) / 4 if k.startswith("fc.") else (1 * 1 + 3 * 5) / 4
        assert torch.allclose(algo.global_state[k], torch.full_like(t_a[k], online)), k
    assert metrics["online_frac"] == pytest.approx(1 / 14)  # one layer of 2 clients x 7 layers
    assert algo.window.values().numel() == 14 and metrics["window_values"] == 14
    assert algo.window.boundary(0.5) == pytest.approx(0.5)


def _dropout_model() -> nn.Module:
    return nn.Sequential(nn.Flatten(), nn.Linear(64, 16), nn.ReLU(), nn.Dropout(0.5), nn.Linear(16, 3))


def test_nan_loss_names_the_client() -> None:
    from fedml_ssfl.algorithms.base import NonFiniteLossError

    algo, data = _tiny(variant="mt")
    algo.server_step(0)
    msg = algo.message_for(3, 0)
    msg.weights[ONLINE_PREFIX + "fc.bias"] = torch.full_like(msg.weights["fc.bias"], float("nan"))
    with pytest.raises(NonFiniteLossError, match="round 1 on client 0"):
        algo.client_update(msg, data, {}, ClientContext(0, CPU, 0))


def test_config_check_names_the_key(small_config) -> None:
    cfg = small_config("ssfl_args.algorithm=fedsiam")
    a = cfg.ssfl_args
    assert a.variant == "mt" and a.alpha_max == 0.999 and a.ramp_unit == "epoch"  # MT at the server
    assert a.consistency == "mse" and a.beta_max is None and a.beta_rampup == 10 and a.beta_ramp_unit == "epoch"
    client = small_config("ssfl_args.algorithm=fedsiam", "data_args.label_scenario=client")
    assert client.ssfl_args.variant == "d"  # FedSiam-D where the paper runs it
    for bad, key in [
        ("variant=dd", "variant"),
        ("consistency=l2", "consistency"),
        ("tau_schedule=cosine", "tau_schedule"),
        ("mu=1.5", "mu"),
        ("alpha_max=-0.1", "alpha_max"),
        ("window_rounds=0", "window_rounds"),
        ("local_epochs=0", "local_epochs"),
        ("eval_net=both", "eval_net"),
        ("phi_g=-1", "phi_g"),
        ("ramp_unit=steps", "ramp_unit"),
        ("beta_ramp_unit=step", "beta_ramp_unit"),
        ("beta_max=-1", "beta_max"),
        ("beta_rampup=-1", "beta_rampup"),
    ]:
        with pytest.raises(ConfigError, match=rf"ssfl_args\.{key}"):
            small_config("ssfl_args.algorithm=fedsiam", f"ssfl_args.{bad}")
    with pytest.raises(ConfigError, match=r"ssfl_args\.varphi_g"):
        small_config("ssfl_args.algorithm=fedsiam", "ssfl_args.tau_schedule=rectangle", "ssfl_args.varphi_g=10")
    with pytest.raises(ConfigError, match=r"data_args\.num_server_labels"):
        small_config("ssfl_args.algorithm=fedsiam", "ssfl_args.variant=pi", "data_args.num_server_labels=0")
    with pytest.raises(ConfigError, match=r"data_args\.labels_per_class_client"):
        small_config(
            "ssfl_args.algorithm=fedsiam", "data_args.label_scenario=client", "data_args.labels_per_class_client=0"
        )


def test_fedsiam_d_is_refused_in_labels_at_server(small_config) -> None:
    # Sec. 4.3: FedSiam-D "do[es] not fit" labels-at-server; only Pi and MT are evaluated there
    with pytest.raises(ConfigError, match=r"ssfl_args\.variant: d .*Sec\. 4\.3.*set ssfl_args\.variant to pi or mt"):
        small_config("ssfl_args.algorithm=fedsiam", "ssfl_args.variant=d")
    for variant in ("pi", "mt"):
        assert small_config("ssfl_args.algorithm=fedsiam", f"ssfl_args.variant={variant}").ssfl_args.variant == variant
    ok = small_config("ssfl_args.algorithm=fedsiam", "ssfl_args.variant=d", "data_args.label_scenario=client")
    assert ok.ssfl_args.variant == "d"


# ---- end to end ---------------------------------------------------------------------------------------
def _rows(run_dir) -> list[dict]:
    return [json.loads(x) for x in (run_dir / "metrics.jsonl").read_text().splitlines()]


def test_fedsiam_d_learns_digits_with_labels_at_client(small_config, tmp_path) -> None:
    # Measured 0.822 (seed 1: 0.833). The floor guards the siamese pair end to end: with a frozen
    # target (alpha = 1 in Eq. 9) the borrowed online layers never learn and it scores 0.095 (seed 1:
    # 0.086). It does not see the consistency term (beta_max 0: 0.819): the exact tests above do.
    cfg = small_config(
        "ssfl_args.algorithm=fedsiam",
        "data_args.label_scenario=client",
        "data_args.num_server_labels=0",
        "train_args.comm_round=5",
        "train_args.local_steps=12",
        "train_args.learning_rate=0.1",
        "ssfl_args.phi_g=1",
        "ssfl_args.beta_rampup=2",
    )
    result = run_local(cfg, run_dir=tmp_path / "d")
    assert result.final_acc >= 0.70, result.final_acc
    rows = _rows(result.run_dir)
    # tau by Eq. 11 with R_G = 5, phi_g = 1, mu = 0.5 (R_g = round + 1), clipped to 1
    assert [r["tau"] for r in rows] == pytest.approx([0.0, 0.9375, 0.625, 0.3125, 0.0])
    model = sum(t.numel() * t.element_size() for t in _digits_model().state_dict().values())
    one = 4 * (model + 4 * 7)  # 4 clients: the target and the 7-layer FSM vector each
    between = 0
    for r in rows:
        frac = r["online_frac"]
        assert "fsm_mean" in r and r["bytes_down"] == 4 * (2 * model + 24)
        if frac == 0.0:
            assert r["bytes_up"] == one
        elif frac == 1.0:
            assert r["bytes_up"] == one + 4 * model
        else:
            between += 1
            assert one < r["bytes_up"] < one + 4 * model
        assert ("boundary" in r) == (r["tau"] > 0)
    assert rows[0]["bytes_up"] == one and rows[0]["fsm_mean"] == 0.0  # alpha = 0 until phi_g
    assert rows[-1]["bytes_up"] == one and rows[-1]["fsm_mean"] > 0
    assert between >= 1


@pytest.mark.parametrize("variant", ["pi", "mt"])
def test_fedsiam_learns_digits_with_labels_at_server(small_config, tmp_path, variant) -> None:
    # 50 server labels; the server trains the aggregate each round (Eq. 8). Measured pi 0.811, mt 0.825
    # (seed 1: 0.749, 0.808); without the server's step 0.095 for both (random 0.10).
    cfg = small_config(
        "ssfl_args.algorithm=fedsiam",
        f"ssfl_args.variant={variant}",
        "train_args.comm_round=5",
        "train_args.local_steps=12",
        "train_args.learning_rate=0.1",
        "ssfl_args.beta_rampup=2",
    )
    result = run_local(cfg, run_dir=tmp_path / variant)
    assert result.final_acc >= 0.6, result.final_acc
    model = sum(t.numel() * t.element_size() for t in _digits_model().state_dict().values())
    online_sent = _rows(result.run_dir)[-1]["bytes_up"] > 4 * model + 64
    assert online_sent == (variant == "mt")  # Pi uploads the target only, MT both nets


def _digits_model() -> nn.Module:
    return build_model("cnn28", num_classes=10, in_channels=1, image_size=8, norm="gn")


@pytest.mark.parametrize("scenario", ["client", "server"])
def test_fedsiam_resume_is_exact(small_config, tmp_path, scenario) -> None:
    # client: FedSiam-D (targets kept per client, the FSM window, client counters); server: MT
    # with the server's Eq. 8 steps and the global target's Eq. 9 steps
    extra = (
        [
            "data_args.label_scenario=client",
            "ssfl_args.phi_g=1",
            "ssfl_args.window_rounds=2",
            "ssfl_args.target_sync=false",
        ]
        if scenario == "client"
        else ["ssfl_args.variant=mt"]
    )
    cfg = small_config(
        "ssfl_args.algorithm=fedsiam",
        "train_args.client_num_in_total=3",
        "train_args.client_num_per_round=2",
        "train_args.comm_round=4",
        *extra,
    )
    a, _ = resume_matches_uninterrupted(cfg, tmp_path)
    if scenario == "client":
        assert len(a["algorithm"]["window"]["per_round"]) == 2
        assert any("target" in cs for cs in a["client_states"].values())
    assert all(cs["participations"] >= 1 for cs in a["client_states"].values())
    assert _rows(tmp_path / "full") == [
        {**r, "seconds": x["seconds"]} for r, x in zip(_rows(tmp_path / "part"), _rows(tmp_path / "full"))
    ]


# ---- FedSiam's FedAvg, FedAvg+ and FedSem baselines (Sec. 4.1, Table 3; issue 37) ----------------------------
def _fedavg_world(**cfg):
    from fedml_ssfl.algorithms.base import DataInfo, ServerData, TrainSettings
    from fedml_ssfl.algorithms.bounds import FedAvgSL, FedAvgSLConfig
    from fedml_ssfl.models import build_model

    info = DataInfo(num_classes=3, in_channels=1, image_size=8, mean=(0.5,), std=(0.25,), flip=False)
    gen = torch.Generator().manual_seed(0)
    images = torch.randint(0, 256, (60, 1, 8, 8), generator=gen, dtype=torch.uint8)
    labels = torch.randint(0, 3, (60,), generator=gen)
    server = ServerData(images, labels, torch.arange(0), torch.arange(0), 3, label_scenario="client")
    algo = FedAvgSL(
        FedAvgSLConfig(**cfg),
        lambda: build_model("cnn28", num_classes=3, in_channels=1, image_size=8, norm="gn"),
        server,
        info,
        TrainSettings(local_steps=2, batch_size=4, comm_round=4, learning_rate=0.05),
        torch.device("cpu"),
        0,
    )
    algo.setup()
    data = ClientData(0, images, labels, torch.arange(10, 40), torch.arange(0, 6), 3)
    return algo, data


def _spy_jobs(monkeypatch) -> list[tuple[torch.Tensor, torch.Tensor, str]]:
    """Every supervised job the algorithm builds: (indices, labels at them, view)."""
    from fedml_ssfl.algorithms import bounds

    seen: list[tuple[torch.Tensor, torch.Tensor, str]] = []
    original = bounds.supervised_job

    def spy(pipeline, images, labels, idx, *args, augment="weak", **kw):
        seen.append((idx.clone(), labels[idx].clone(), augment))
        return original(pipeline, images, labels, idx, *args, augment=augment, **kw)

    monkeypatch.setattr(bounds, "supervised_job", spy)
    return seen


@pytest.mark.parametrize("augment", ["plain", "weak"])
def test_fedavg_and_fedavg_plus_train_on_the_clients_labels_alone(monkeypatch, augment) -> None:
    # FedSiam's FedAvg (original images) and FedAvg+ (with data augmentation): supervised FedAvg on each
    # client's labeled samples only, weighted by how many it trained on
    seen = _spy_jobs(monkeypatch)
    algo, data = _fedavg_world(client_data="labeled", augment=augment)
    algo.server_step(0)
    reply = algo.client_update(algo.message_for(0, 0), data, {}, ClientContext(0, torch.device("cpu"), 0))
    assert [(s[0].tolist(), s[2]) for s in seen] == [(list(range(6)), augment)]
    assert torch.equal(seen[0][1], data.labels[:6]) and reply.num_samples == 6
    seen.clear()
    algo, data = _fedavg_world()  # the upper bound: every sample, true labels
    algo.client_update(algo.message_for(0, 0), data, {}, ClientContext(0, torch.device("cpu"), 0))
    assert sorted(seen[0][0].tolist()) == list(range(6)) + list(range(10, 40))


def test_fedsem_pseudo_labels_once_with_the_phase_1_model(monkeypatch) -> None:
    # FedSem (Table 3: R_G^1 rounds of FedAvg on the labels, then R_G^2 on labels + pseudo-labels): from round
    # R_G^1 = 2 each client trains on its unlabeled samples too, labelled by the argmax of the global model
    # Phase 1 ended with (sent once), not their true labels; the labels stay fixed afterwards
    seen = _spy_jobs(monkeypatch)
    algo, data = _fedavg_world(client_data="labeled", fedsem_rounds=2)
    state: dict = {}
    for r in range(2):  # Phase 1
        algo.server_step(r)
        msg = algo.message_for(0, r)
        assert "labeler" not in msg.extras
        reply = algo.client_update(msg, data, state, ClientContext(r, torch.device("cpu"), 0))
        algo.aggregate({0: reply}, r)
        assert seen[-1][0].tolist() == list(range(6))
    phase1 = {k: v.clone() for k, v in algo.global_state.items()}
    algo.server_step(2)
    msg = algo.message_for(0, 2)
    assert all(torch.equal(msg.extras["labeler"][k], phase1[k]) for k in phase1)
    # the expected labels, computed here: the Phase 1 model in eval mode on the normalised original images
    model = algo.model_fn()
    model.load_state_dict(phase1)
    model.eval()
    x = (data.images[data.unlabeled_idx].float() / 255.0 - 0.5) / 0.25
    with torch.no_grad():
        expected = model(x).argmax(dim=1)
    reply = algo.client_update(msg, data, state, ClientContext(2, torch.device("cpu"), 0))
    idx, labels, _ = seen[-1]
    assert idx.tolist() == list(range(6)) + list(range(10, 40)) and reply.num_samples == 36
    assert torch.equal(labels[:6], data.labels[:6]) and torch.equal(labels[6:], expected)
    assert not torch.equal(expected, data.labels[10:40])  # pseudo-labels, not the hidden truth
    algo.aggregate({0: reply}, 2)
    algo.server_step(3)
    msg = algo.message_for(0, 3)
    assert "labeler" not in msg.extras  # sent once
    algo.client_update(msg, data, state, ClientContext(3, torch.device("cpu"), 0))
    assert torch.equal(seen[-1][1][6:], expected)  # the same labels, not the newer model's


def test_fedavg_sl_baseline_options_are_checked() -> None:
    base = {"data_args": {"dataset": "digits"}}
    for ssfl, key in [
        ({"client_data": "some"}, "client_data"),
        ({"augment": "strong"}, "augment"),
        ({"fedsem_rounds": 30}, "fedsem_rounds"),  # needs client_data: labeled
        ({"client_data": "labeled", "fedsem_rounds": -1}, "fedsem_rounds"),
    ]:
        with pytest.raises(ConfigError, match=rf"ssfl_args\.{key}"):
            validate({**base, "ssfl_args": {"algorithm": "fedavg_sl", **ssfl}})
