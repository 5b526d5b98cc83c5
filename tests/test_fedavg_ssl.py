"""Zhang et al.'s SSFL benchmark (``fedavg_ssl``): each mechanism checked exactly on tiny data.

The client and server steps are compared with a reference written here (our own SGD on views we
control), the averaging rules with hand-made models of known values. The input pipeline's views
are replaced by recognisable deterministic ones: alpha(x) = the plain image, A(x) = its negative,
mirrored. With ``batch_size`` above a party's sample count every step's batch is its whole set
(in a shuffled order, which a batch mean and GroupNorm do not see), so the reference needs no
knowledge of the batch stream.
"""

from __future__ import annotations

import math

import pytest
import torch
from torch.nn import functional as F

from fedml_ssfl.algorithms.base import ClientContext, Message
from fedml_ssfl.config import ConfigError
from fedml_ssfl.experiment import build_experiment
from fedml_ssfl.training import InputPipeline, cosine_lr
from tests.conftest import resume_matches_uninterrupted

WHOLE = "train_args.batch_size=400"  # > 347 unlabeled per client and > 50 server labels
CLOSE = 2e-6  # float32 rounding of a shuffled batch order over a few steps
CPU = torch.device("cpu")


def weak_view(self, images, generator):
    return self.plain(images)


def strong_view(self, images, generator):
    return -self.plain(images).flip(-1)


@pytest.fixture
def views(monkeypatch):
    """alpha(x) = plain image, A(x) = its mirrored negative, in every InputPipeline."""
    monkeypatch.setattr(InputPipeline, "weak", weak_view)
    monkeypatch.setattr(InputPipeline, "strong", strong_view)


def make(small_config, *overrides):
    exp = build_experiment(small_config(WHOLE, *overrides))
    exp.algorithm.setup()
    return exp, exp.algorithm


def ctx(exp, r):
    return ClientContext(round_idx=r, device=exp.device, seed=0)


def gap(a, b):
    """Largest absolute difference over the floating tensors of two state dicts."""
    return max(float((a[k].double() - b[k].double()).abs().max()) for k in a if a[k].is_floating_point())


def client_views(algo, data):
    """(alpha(x), A(x)) of a client's whole unlabeled set, as the patched pipeline builds them."""
    pipe = InputPipeline(algo.data_info, CPU)
    x = data.images[data.unlabeled_idx]
    return weak_view(pipe, x, None), strong_view(pipe, x, None)


def consistency(x_pseudo, x_train, tau, masked=True):
    """Eq. 6 / Eq. 3 by hand: pseudo-label argmax f(x_pseudo) where max prob >= tau, CE on f(x_train)."""

    def loss(model):
        if x_train is x_pseudo:
            logits_p = logits_t = model(x_pseudo)
        else:
            logits_p, logits_t = model(torch.cat([x_pseudo, x_train])).chunk(2)
        conf, y = logits_p.detach().softmax(dim=1).max(dim=1)
        ce = F.cross_entropy(logits_t, y, reduction="none")
        return (ce * (conf >= tau)).mean() if masked else ce.mean()

    return loss


def replay(algo, starts, rounds, loss_fn, *, nesterov=True, persistent=True, train=None):
    """Our own SGD: round ``rounds[i]`` starts from ``starts[i]`` and takes T steps of ``loss_fn``.

    ``persistent``: one optimiser for all rounds (its momentum carries over); else a fresh one
    per round. The learning rate is Eq. 9 at the global step ``round * T + s`` of ``train``
    (default the algorithm's settings).
    """
    t = algo.train if train is None else train
    model = algo.model_fn().train()
    opt = None
    for start, r in zip(starts, rounds):
        model.load_state_dict(start)
        if opt is None or not persistent:
            opt = torch.optim.SGD(
                model.parameters(),
                lr=t.learning_rate,
                momentum=t.momentum,
                weight_decay=t.weight_decay,
                nesterov=nesterov,
            )
        for s in range(t.local_steps):
            for group in opt.param_groups:
                group["lr"] = cosine_lr(t, r * t.local_steps + s)
            opt.zero_grad()
            loss_fn(model).backward()
            opt.step()
    return {k: v.detach().clone() for k, v in model.state_dict().items()}


def filled(state, value, buffers=None):
    """A copy of ``state`` with every parameter (and, if given, every floating buffer) set to a value."""
    out = {}
    for k, v in state.items():
        is_buffer = "running_" in k or "num_batches" in k
        if not v.is_floating_point():
            out[k] = v.clone()
        elif is_buffer and buffers is not None:
            out[k] = torch.full_like(v, buffers)
        elif is_buffer:
            out[k] = v.clone()
        else:
            out[k] = torch.full_like(v, value)
    return out


def value_of(state):
    """The single value every parameter of a :func:`filled` state holds."""
    vals = {float(v.flatten()[0]) for k, v in state.items() if v.is_floating_point() and "running_" not in k}
    assert len(vals) == 1, vals
    return vals.pop()


# ---- (a) CRL, Eq. 6 ----------------------------------------------------------------------------
def test_crl_pseudo_labels_come_from_the_weak_view_and_the_loss_is_on_the_strong_view(small_config, views):
    exp, algo = make(small_config, "train_args.local_steps=1", "ssfl_args.bootstrap_steps=30")
    algo.bootstrap()  # a model that tells the digits apart: its pseudo-labels vary
    data = exp.client_data(0)
    x_w, x_s = client_views(algo, data)
    model = algo.model_fn()
    model.load_state_dict(algo.global_state)
    with torch.no_grad():
        conf_w, y_w = model(x_w).softmax(dim=1).max(dim=1)
        conf_s, y_s = model(x_s).softmax(dim=1).max(dim=1)
    tau = float(conf_w.median())  # the mask keeps about half of the samples
    algo.config.threshold = tau
    # the views disagree, so every wrong role assignment gives another step
    assert (y_w != y_s).float().mean() > 0.2 and ((conf_w >= tau) != (conf_s >= tau)).float().mean() > 0.2

    reply = algo.client_update(algo.message_for(0, 0), data, {}, ctx(exp, 0))
    start = [algo.global_state]
    right = replay(algo, start, [0], consistency(x_w, x_s, tau))
    assert gap(reply.weights, right) < CLOSE
    wrong = {
        "roles swapped": replay(algo, start, [0], consistency(x_s, x_w, tau)),
        "weak view for both (Eq. 3)": replay(algo, start, [0], consistency(x_w, x_w, tau)),
        "no mask": replay(algo, start, [0], consistency(x_w, x_s, tau, masked=False)),
    }
    for name, other in wrong.items():
        assert gap(reply.weights, other) > 100 * CLOSE, name
    kept = conf_w >= tau
    m = reply.extras["metrics"]
    assert m["mask_rate"] == pytest.approx(float(kept.float().mean()))
    truth = data.labels[data.unlabeled_idx]
    assert m["pseudo_acc"] == pytest.approx(float((y_w[kept] == truth[kept]).float().mean()))


# ---- (b) self-training, Eq. 3 ------------------------------------------------------------------
def test_self_training_takes_pseudo_label_and_loss_on_the_weak_view(small_config, views):
    exp, algo = make(small_config, "train_args.local_steps=1", "ssfl_args.user_loss=self_training")
    data = exp.client_data(1)
    x_w, x_s = client_views(algo, data)
    algo.config.threshold = 0.0  # every sample trains: the views alone decide the step
    reply = algo.client_update(algo.message_for(1, 0), data, {}, ctx(exp, 0))
    start = [algo.global_state]
    assert gap(reply.weights, replay(algo, start, [0], consistency(x_w, x_w, 0.0))) < CLOSE
    assert gap(reply.weights, replay(algo, start, [0], consistency(x_w, x_s, 0.0))) > 100 * CLOSE  # CRL
    assert gap(reply.weights, replay(algo, start, [0], consistency(x_s, x_s, 0.0))) > 100 * CLOSE


def test_self_training_pseudo_labels_come_from_the_eval_mode_forward(small_config, views):
    """Eq. 3's y_bar with BatchNorm: the authors' code labels with the model in eval mode (running
    statistics), and the cross-entropy is on the train-mode forward of the same view."""
    exp, algo = make(
        small_config, "model_args.norm=bn", "train_args.local_steps=1", "ssfl_args.user_loss=self_training"
    )
    data = exp.client_data(1)
    x_w, _ = client_views(algo, data)
    algo.config.threshold = 0.0  # every sample trains on its label: which forward labels decides the step
    reply = algo.client_update(algo.message_for(1, 0), data, {}, ctx(exp, 0))

    def labelled_in(mode):
        def loss(model):
            model.train(mode == "train")
            with torch.no_grad():
                y = model(x_w).argmax(dim=1)
            model.train()
            return F.cross_entropy(model(x_w), y)

        return loss

    start = [algo.global_state]
    eval_labels = replay(algo, start, [0], labelled_in("eval"))
    train_labels = replay(algo, start, [0], labelled_in("train"))
    # BatchNorm's shuffled batch sums round differently: a wider tolerance than CLOSE, far below the gap
    assert gap(eval_labels, train_labels) > 1000 * CLOSE  # the two readings give different steps here
    assert gap(reply.weights, eval_labels) < 10 * CLOSE


# ---- (c) grouping, Eq. 7 -----------------------------------------------------------------------
def test_grouping_averages_each_group_with_the_server_and_sends_it_back(small_config):
    exp, algo = make(small_config, "ssfl_args.averaging=grouping", "ssfl_args.num_groups=2")
    algo._server_state = filled(algo.global_state, 0.0)  # w_s = 0, client k's model = k + 1
    replies = {k: Message(weights=filled(algo.global_state, k + 1.0), num_samples=10 * (k + 1)) for k in range(4)}
    algo.aggregate(replies, 0)
    # fixed groups are contiguous id blocks (the authors' code): {0, 1} and {2, 3}
    g0, g1 = (0 + 1 + 2) / 3, (0 + 3 + 4) / 3
    assert value_of(algo.group_states[0]) == pytest.approx(g0)
    assert value_of(algo.group_states[1]) == pytest.approx(g1)
    assert value_of(algo.global_state) == pytest.approx((g0 + g1) / 2)  # not FedAvg's (0+1+2+3+4)/5 = 2
    for k, want in ((0, g0), (1, g0), (2, g1), (3, g1)):  # group i receives its own w_avg,i
        msg = algo.message_for(k, 1)
        assert msg.extras["group"] == k // 2 and value_of(msg.weights) == pytest.approx(want), k
    # Eq. 7 with C_k < K: a group without a sampled client this round is left out of the mean
    algo.aggregate({k: replies[k] for k in (0, 1)}, 1)
    assert value_of(algo.global_state) == pytest.approx(g0)


def test_weight_diversity_measures_each_party_from_where_it_started(small_config):
    """Eq. 8 with grouping: g_i = w_i - (the model party i started from): the server's w_avg, each
    client's group average w_avg,i it received; sum ||g_i||^2 / ||sum g_i||^2 as printed."""
    exp, algo = make(small_config, "ssfl_args.averaging=grouping", "ssfl_args.num_groups=2")
    algo.global_state = filled(algo.global_state, 0.5)
    algo.group_states = {0: filled(algo.global_state, 1.0), 1: filled(algo.global_state, 3.0)}
    algo._server_state = filled(algo.global_state, 0.6)  # g = 0.1 from w_avg
    starts = {0: 1.0, 1: 1.0, 2: 3.0, 3: 3.0}  # contiguous groups {0, 1}, {2, 3}
    replies = {k: Message(weights=filled(algo.global_state, v + 0.2)) for k, v in starts.items()}  # g = 0.2 each
    metrics = algo.aggregate(replies, 0)
    # every parameter moved the same in each party, so the parameter count cancels
    assert metrics["weight_diversity"] == pytest.approx((0.1**2 + 4 * 0.2**2) / (0.1 + 4 * 0.2) ** 2)
    assert metrics["weight_diversity_fc"] == pytest.approx((0.1**2 + 4 * 0.2**2) / (0.1 + 4 * 0.2) ** 2)


def test_random_regrouping_deals_the_sampled_clients_into_groups_and_broadcasts_the_global(small_config):
    exp, algo = make(small_config, "ssfl_args.averaging=grouping", "ssfl_args.regroup=random")
    chosen = [0, 1, 2, 3]
    for r in range(3):
        groups = [algo.group_of(k, chosen, r) for k in chosen]
        assert sorted(groups) == [0, 0, 1, 1] and groups == [algo.group_of(k, chosen, r) for k in chosen]
    algo._server_state = filled(algo.global_state, 0.0)
    algo.aggregate({k: Message(weights=filled(algo.global_state, k + 1.0)) for k in chosen}, 0)
    assert value_of(algo.message_for(0, 1).weights) == pytest.approx(value_of(algo.global_state))


# ---- (d) FedAvg with the server as one model, Eq. 4/5 ------------------------------------------
def test_fedavg_counts_the_server_as_one_model_uniformly(small_config):
    exp, algo = make(small_config)
    algo._server_state = filled(algo.global_state, 10.0)
    sizes = [1, 1, 1, 100]  # uniform: the sample counts must not matter
    replies = {k: Message(weights=filled(algo.global_state, k + 1.0), num_samples=sizes[k]) for k in range(4)}
    algo.aggregate(replies, 0)
    assert value_of(algo.global_state) == pytest.approx((10 + 1 + 2 + 3 + 4) / 5)  # Eq. 4
    algo.aggregate({0: replies[0], 3: replies[3], 1: Message()}, 1)  # Eq. 5: C_k = 2 live replies
    assert value_of(algo.global_state) == pytest.approx((10 + 1 + 4) / 3)
    assert value_of(algo.message_for(2, 2).weights) == pytest.approx(5.0)  # everybody gets w_avg


# ---- (e) the authors' optimiser and parameter-only averaging ------------------------------------
def test_a_client_step_is_nesterov_sgd_by_hand(small_config, views):
    exp, algo = make(small_config, "train_args.local_steps=1", "ssfl_args.threshold=0.0")
    data = exp.client_data(2)
    x_w, x_s = client_views(algo, data)
    model = algo.model_fn()
    model.load_state_dict(algo.global_state)
    consistency(x_w, x_s, 0.0)(model).backward()
    t, state = algo.train, {}
    reply = algo.client_update(algo.message_for(2, 0), data, state, ctx(exp, 0))
    lr = cosine_lr(t, 0)
    for name, p in model.named_parameters():
        d = p.grad + t.weight_decay * p.detach()  # first step: buf = d, Nesterov steps d + m * buf
        assert torch.allclose(reply.weights[name], p.detach() - lr * (1 + t.momentum) * d, atol=1e-6), name
        assert torch.allclose(state["momentum"][name], d, atol=1e-6), name  # kept for the next round


def test_client_momentum_persists_across_rounds_in_its_state(small_config, views):
    exp, algo = make(small_config, "train_args.local_steps=2", "ssfl_args.threshold=0.0")
    data = exp.client_data(3)
    x_w, x_s = client_views(algo, data)
    loss = consistency(x_w, x_s, 0.0)
    state = {}
    first = algo.client_update(algo.message_for(3, 0), data, state, ctx(exp, 0))
    assert set(state["momentum"]) == set(algo.parameter_names())
    start1 = {k: (v + first.weights[k]) / 2 for k, v in algo.global_state.items()}  # some other w_avg
    second = algo.client_update(Message(weights=start1), data, state, ctx(exp, 1))
    starts = [algo.global_state, start1]
    assert gap(first.weights, replay(algo, starts[:1], [0], loss)) < CLOSE
    assert gap(second.weights, replay(algo, starts, [0, 1], loss)) < CLOSE
    fresh = replay(algo, starts, [0, 1], loss, persistent=False)
    assert gap(second.weights, fresh) > 100 * CLOSE  # a fresh optimiser per round is another run


def test_the_fresh_plain_sgd_option(small_config, views):
    exp, algo = make(
        small_config,
        "train_args.local_steps=2",
        "ssfl_args.threshold=0.0",
        "ssfl_args.nesterov=false",
        "ssfl_args.persistent_momentum=false",
    )
    data = exp.client_data(0)
    x_w, x_s = client_views(algo, data)
    loss = consistency(x_w, x_s, 0.0)
    state = {}
    algo.client_update(algo.message_for(0, 0), data, state, ctx(exp, 0))
    assert "momentum" not in state
    reply = algo.client_update(algo.message_for(0, 1), data, state, ctx(exp, 1))
    starts = [algo.global_state, algo.global_state]
    assert gap(reply.weights, replay(algo, starts, [0, 1], loss, nesterov=False, persistent=False)) < CLOSE


def test_server_momentum_persists_across_rounds_in_the_algorithm_state(small_config, views):
    exp, algo = make(small_config, "train_args.local_steps=2")
    sd = algo.server_data
    x = weak_view(InputPipeline(algo.data_info, CPU), sd.images[sd.labeled_idx], None)
    y = sd.labels[sd.labeled_idx]

    def supervised(model):
        return F.cross_entropy(model(x), y)

    w0 = algo.global_state
    algo.server_step(0)
    algo.aggregate({}, 0)  # no client: w_avg = w_s
    assert set(algo.state_dict()["server_momentum"]) == set(algo.parameter_names())
    algo.server_step(1)
    assert gap(algo._server_state, replay(algo, [w0, algo.global_state], [0, 1], supervised)) < CLOSE
    fresh = replay(algo, [w0, algo.global_state], [0, 1], supervised, persistent=False)
    assert gap(algo._server_state, fresh) > 100 * CLOSE


def test_only_parameters_are_averaged_and_the_server_keeps_its_bn_statistics(small_config):
    exp, algo = make(small_config, "model_args.norm=bn")
    base = algo.global_state
    assert any("running_mean" in k for k in base)
    algo._server_state = filled(base, 0.0, buffers=-1.0)
    algo._server_state["norm1.num_batches_tracked"] = torch.tensor(7)
    replies = {k: Message(weights=filled(base, k + 1.0, buffers=50.0 + k)) for k in range(4)}
    algo.aggregate(replies, 0)
    g = algo.global_state
    assert value_of(g) == pytest.approx(2.0)  # (0 + 1 + 2 + 3 + 4) / 5 over the parameters
    assert torch.all(g["norm1.running_mean"] == -1.0) and torch.all(g["norm3.running_var"] == -1.0)
    assert int(g["norm1.num_batches_tracked"]) == 7
    # the option: every floating tensor is averaged
    algo.config.average_buffers = True
    algo.aggregate(replies, 1)
    g = algo.global_state
    assert torch.allclose(
        g["norm1.running_mean"], torch.full_like(g["norm1.running_mean"], (-1 + 50 + 51 + 52 + 53) / 5)
    )


def test_a_client_keeps_its_own_bn_statistics_across_rounds(small_config):
    exp, algo = make(small_config, "model_args.norm=bn", "ssfl_args.threshold=0.0")
    data = exp.client_data(0)
    state = {}
    first = algo.client_update(algo.message_for(0, 0), data, state, ctx(exp, 0))
    own = state["buffers"]
    assert set(own) == {k for k in first.weights if k not in algo.parameter_names()}
    assert all(torch.equal(own[k], first.weights[k]) for k in own)
    params = {k: v for k, v in algo.global_state.items() if k in algo.parameter_names()}
    # two messages that differ only in their BN statistics: the client ignores them
    a = Message(weights={**filled(algo.global_state, 0.0, buffers=3.0), **params})
    b = Message(weights={**filled(algo.global_state, 0.0, buffers=9.0), **params})
    ra = algo.client_update(a, data, dict(state), ctx(exp, 1))
    rb = algo.client_update(b, data, dict(state), ctx(exp, 1))
    assert gap(ra.weights, rb.weights) == 0.0
    # the option: the received statistics are used
    algo.config.average_buffers = True
    ra = algo.client_update(a, data, dict(state), ctx(exp, 1))
    rb = algo.client_update(b, data, dict(state), ctx(exp, 1))
    assert gap(ra.weights, rb.weights) > 1.0


def test_resume_continues_momentum_bn_statistics_and_bootstrap_bit_for_bit(small_config, tmp_path):
    cfg = small_config(
        "model_args.norm=bn",
        "train_args.comm_round=3",
        "train_args.client_num_per_round=2",
        "ssfl_args.averaging=grouping",
        "ssfl_args.threshold=0.0",
        "ssfl_args.bootstrap_steps=3",
    )
    full, _ = resume_matches_uninterrupted(cfg, tmp_path, stop_after=1)
    assert full["algorithm"]["server_momentum"] and full["algorithm"]["bootstrapped"]
    trained = [s for s in full["client_states"].values() if s]
    assert trained and all(s["momentum"] and s["buffers"] for s in trained)


# ---- (f) the threshold tau -----------------------------------------------------------------------
def test_tau_decides_whether_a_client_trains(small_config, views):
    exp, algo = make(small_config, "ssfl_args.threshold=1.0")
    data = exp.client_data(1)
    x_w, x_s = client_views(algo, data)
    w0 = algo.global_state
    idle = algo.client_update(algo.message_for(1, 0), data, {}, ctx(exp, 0))
    assert idle.extras["metrics"]["mask_rate"] == 0.0 and "pseudo_acc" not in idle.extras["metrics"]
    # nothing passes tau: the step is weight decay (through the momentum) alone
    assert gap(idle.weights, replay(algo, [w0], [0], consistency(x_w, x_s, 1.0))) < CLOSE
    drift = gap(idle.weights, w0)
    assert 0 < drift < 1e-4
    # with tau lowered the same client trains on every sample
    algo.config.threshold = 0.0
    busy = algo.client_update(algo.message_for(1, 0), data, {}, ctx(exp, 0))
    assert busy.extras["metrics"]["mask_rate"] == 1.0 and 0 <= busy.extras["metrics"]["pseudo_acc"] <= 1
    assert gap(busy.weights, w0) > 100 * drift


# ---- bootstrapping (an option beyond the paper) and the config ------------------------------------
def test_bootstrap_makes_w0_a_server_only_model_and_its_momentum_carries_on(small_config, views):
    exp, algo = make(small_config, "ssfl_args.bootstrap_steps=5", "train_args.local_steps=2")
    w_init = algo.global_state
    sd = algo.server_data
    x = weak_view(InputPipeline(algo.data_info, CPU), sd.images[sd.labeled_idx], None)
    y = sd.labels[sd.labeled_idx]
    t = algo.train
    model = algo.model_fn().train()
    model.load_state_dict(w_init)
    opt = torch.optim.SGD(
        model.parameters(), lr=t.learning_rate, momentum=t.momentum, weight_decay=t.weight_decay, nesterov=True
    )
    lrs = [t.learning_rate] * 5 + [cosine_lr(t, s) for s in range(t.local_steps)]  # gamma, then Eq. 9
    states = []
    for lr in lrs:
        for group in opt.param_groups:
            group["lr"] = lr
        opt.zero_grad()
        F.cross_entropy(model(x), y).backward()
        opt.step()
        states.append({k: v.detach().clone() for k, v in model.state_dict().items()})
    algo.server_step(0)
    w0 = algo.global_state
    assert gap(w0, states[4]) < CLOSE  # w^0: 5 server-only steps
    assert gap(algo._server_state, states[-1]) < CLOSE  # round 0 continues the same optimiser
    assert gap(algo.message_for(0, 0).weights, w0) == 0.0  # the clients' round 0 starts from w^0
    algo.server_step(1)  # bootstraps once
    assert algo.global_state is w0
    _, plain = make(small_config)
    assert plain.bootstrapped and gap(plain.message_for(0, 0).weights, plain.global_state) == 0.0


def test_client_update_is_a_pure_function_of_its_inputs(small_config):
    exp, algo = make(small_config)
    msg = algo.message_for(0, 0)
    a = algo.client_update(msg, exp.client_data(0), {}, ctx(exp, 0))
    b = algo.client_update(msg, exp.client_data(0), {}, ctx(exp, 0))
    assert gap(a.weights, b.weights) == 0.0
    c = algo.client_update(msg, exp.client_data(0), {}, ctx(exp, 1))
    assert gap(a.weights, c.weights) > 0


@pytest.mark.parametrize(
    ("override", "match"),
    [
        ("ssfl_args.bootstrap_steps=-1", r"ssfl_args\.bootstrap_steps.*>= 0"),
        ("train_args.momentum=0.0", r"ssfl_args\.nesterov.*train_args\.momentum > 0"),
        ("ssfl_args.threshold=1.5", r"ssfl_args\.threshold"),
    ],
)
def test_bad_settings_name_the_key_and_the_fix(small_config, override, match):
    with pytest.raises(ConfigError, match=match):
        small_config(override)


def test_paper_silent_defaults_are_the_authors_code(small_config):
    c = small_config().ssfl_args
    assert (c.user_loss, c.averaging, c.threshold, c.bootstrap_steps) == ("crl", "fedavg", 0.95, 0)
    assert c.nesterov and c.persistent_momentum and not c.average_buffers
    assert math.isclose(small_config("train_args.momentum=0.0", "ssfl_args.nesterov=false").train_args.momentum, 0.0)
