"""What the final model carries, and what the server computes per client, through the real objects, by value.

The paths after the clients' last round and on the server run once per run or once per client, so a
slip there moves no training loss: a final fine-tune skipped, FedSiam's extra server step counted from
zero, FedSEAL's last averaging left without its server update, a client given another client's group,
a helper record holding the global psi. Each test runs the algorithm's own server code on a real round
(or a whole short run) and compares what it produced with a reference written here: the papers'
formulas over the replies, or our own SGD replay of the server's steps (the input pipeline's weak view is
the plain image here, so the replay needs no augmentation draws; batches larger than the server's 50
labels make every step's batch the whole set).
"""

from __future__ import annotations

import pytest
import torch
from torch.func import functional_call
from torch.nn import functional as F

from fedml_ssfl.algorithms.base import ClientContext
from fedml_ssfl.algorithms.fedmatch import HELPER, PSI
from fedml_ssfl.experiment import build_experiment
from fedml_ssfl.runtime.common import finish_round, start_round
from fedml_ssfl.sparse import densify
from fedml_ssfl.training import InputPipeline, cosine_lr

CPU = torch.device("cpu")
CLOSE = 2e-6  # float32 rounding of a shuffled batch order over a few steps
LABELS_AT_CLIENT = [
    "data_args.label_scenario=client",
    "data_args.num_server_labels=0",
    "data_args.labels_per_class_client=2",
]


def ctx(r: int) -> ClientContext:
    return ClientContext(round_idx=r, device=CPU, seed=0)


@pytest.fixture
def plain_weak(monkeypatch):
    """alpha(x) = the plain image: the server's steps draw nothing but their batches."""
    monkeypatch.setattr(InputPipeline, "weak", lambda self, images, generator: self.plain(images))


def build(small_config, *overrides):
    exp = build_experiment(small_config(*overrides))
    exp.algorithm.setup()
    return exp, exp.algorithm


def run_round(exp, r, states=None, data_of=None):
    """One real round (server step, messages, client updates, aggregate); the start and the replies."""
    algo = exp.algorithm
    start = start_round(exp, r)
    states = states if states is not None else {}
    replies = {}
    for k in start.chosen:
        data = data_of(k) if data_of else exp.client_data(k, r)
        replies[k] = algo.run_client_update(start.messages[k], data, states.setdefault(k, {}), ctx(r))
    finish_round(exp, start, replies, 0)
    return start, replies


def gap(a, b, keys=None):
    keys = [k for k in (keys or a) if a[k].is_floating_point()]
    return max(float((a[k].double() - b[k].double()).abs().max()) for k in keys)


def server_labels(algo):
    d = algo.server_data
    x = InputPipeline(algo.data_info, CPU).plain(d.images[d.labeled_idx])
    return x, d.labels[d.labeled_idx]


def sgd_replay(algo, start, steps, rate, *, loss_weight=1.0, nesterov=False, clip=0.0, after_step=None):
    """Our own SGD from ``start``: ``steps`` full-batch steps of ``loss_weight`` CE on the server's labels
    (plain images), at ``rate(s)``, momentum and weight decay of ``train_args``."""
    model = algo.model_fn().train()
    model.load_state_dict(start)
    x, y = server_labels(algo)
    t = algo.train
    opt = torch.optim.SGD(
        model.parameters(), lr=t.learning_rate, momentum=t.momentum, weight_decay=t.weight_decay, nesterov=nesterov
    )
    for s in range(steps):
        for group in opt.param_groups:
            group["lr"] = rate(s)
        opt.zero_grad()
        (loss_weight * F.cross_entropy(model(x), y)).backward()
        if clip:
            torch.nn.utils.clip_grad_norm_(model.parameters(), clip)
        opt.step()
        if after_step is not None:
            after_step(s, model)
    return {k: v.detach().clone() for k, v in model.state_dict().items()}


# ---- Zhang et al.: grouping's groups (Eq. 7) --------------------------------------------------------
def test_fedavg_ssl_sends_each_client_its_own_groups_average(small_config):
    exp, algo = build(
        small_config,
        "ssfl_args.algorithm=fedavg_ssl",
        "ssfl_args.averaging=grouping",
        "ssfl_args.threshold=0",
        "train_args.client_num_in_total=5",
        "train_args.client_num_per_round=5",
        "train_args.local_steps=1",
    )
    start, replies = run_round(exp, 0)
    blocks = {0: [0, 1, 2], 1: [3, 4]}  # the authors' contiguous rank blocks, k * S // K
    keys = [name for name, _ in algo.model_fn().named_parameters()]
    for g, members in blocks.items():
        models = [algo._server_state, *(replies[k].weights for k in members)]
        expected = {key: sum(m[key].double() for m in models) / len(models) for key in keys}
        assert gap(algo.group_states[g], expected, keys) < 1e-6
        for k in members:  # next round, client k starts from its own group's w_avg,i
            assert gap(algo.message_for(k, 1).weights, expected, keys) < 1e-6
    assert gap(algo.group_states[0], algo.group_states[1], keys) > 1e-4


# ---- FedMatch: per-client psi records, embeddings and the helpers they choose ---------------------------
def test_fedmatch_keeps_each_clients_own_psi_and_embedding_and_sends_the_nearest_ones_psi(small_config):
    exp, algo = build(
        small_config,
        "ssfl_args.algorithm=fedmatch",
        *LABELS_AT_CLIENT,
        "ssfl_args.tau=0",
        "ssfl_args.lambda_a=1",
        "ssfl_args.helper_interval=1",
        "ssfl_args.num_helpers=1",
        "train_args.local_steps=2",
    )
    lay = algo.layout()
    states: dict = {}
    start, replies = run_round(exp, 0, states)
    model = algo.model_fn().eval()
    psi, emb = {}, {}
    for k in start.chosen:  # what client k trained: what it held plus its deltas
        held, sent = algo.views[k], replies[k].weights
        psi[k] = {n: held[PSI + n] + densify(sent[PSI + n], lay.shapes[n]) for n in lay.params}
        sigma = {n: held["sigma/" + n] + densify(sent["sigma/" + n], lay.shapes[n]) for n in lay.params}
        recorded = {n: densify(algo.client_psi[k][n], lay.shapes[n]) for n in lay.params}
        assert gap(recorded, psi[k]) < 1e-7  # the server's record is the client's own psi
        with torch.no_grad():
            theta = {n: sigma[n] + psi[k][n] for n in lay.params}
            emb[k] = functional_call(model, theta, (algo.probe,)).softmax(dim=1).reshape(-1).double()
        assert torch.allclose(algo.embeddings[k], emb[k], atol=1e-7)  # the embedding of the client's model
    assert gap(psi[start.chosen[0]], psi[start.chosen[1]]) > 1e-5
    for k in start.chosen:  # round 1: each seen client gets the psi of its nearest other client
        nearest = min((h for h in start.chosen if h != k), key=lambda h: float((emb[h] - emb[k]).norm()))
        msg = algo.message_for(k, 1)
        assert msg.extras["num_helpers"] == 1
        record = algo.views[k]
        helper = {n: record[PSI + n] + densify(msg.weights[HELPER.format(0) + n], lay.shapes[n]) for n in lay.params}
        assert gap(helper, psi[nearest]) <= 2 * algo.setting("s2c_threshold")


# ---- FedSiam: the final server step (labels-at-server) and the FSM window's boundary ---------------------------
def test_fedsiam_final_model_is_one_more_server_step_whose_ema_counter_goes_on(small_config, plain_weak):
    R, T = 2, 3
    exp, algo = build(
        small_config,
        "ssfl_args.algorithm=fedsiam",
        "ssfl_args.variant=mt",
        "ssfl_args.alpha_max=0.9",
        f"train_args.comm_round={R}",
        f"train_args.local_steps={T}",
        "train_args.batch_size=64",
    )
    for r in range(R):
        run_round(exp, r)
    online, target = dict(algo.agg_online), dict(algo.agg_target)
    algo.finalize()
    follower = algo.model_fn()
    follower.load_state_dict(target)

    def ema(s, model):  # Eq. 9 on the global pair, the server's counter q = R T + s (the final update's index R)
        alpha = min(1 - 1 / (R * T + s + 1), 0.9)
        with torch.no_grad():
            for f, o in zip(follower.state_dict().values(), model.state_dict().values()):
                f.mul_(alpha).add_((1 - alpha) * o)

    expected = sgd_replay(algo, online, T, lambda s: cosine_lr(algo.train, (R - 1) * T + s), after_step=ema)
    assert gap(algo.global_state, expected) < CLOSE  # G: T more steps on the labels from the last aggregate
    assert gap(algo.global_target, follower.state_dict()) < CLOSE
    assert gap(algo.global_state, online) > 1e-4


def test_fedsiam_boundary_is_the_quantile_of_the_last_window_rounds_of_fsm(small_config):
    exp, algo = build(
        small_config,
        "ssfl_args.algorithm=fedsiam",
        *LABELS_AT_CLIENT,
        "ssfl_args.variant=d",
        "ssfl_args.phi_g=1",
        "ssfl_args.window_rounds=2",
        "train_args.comm_round=6",
        "train_args.client_num_per_round=3",
        "train_args.local_steps=2",
    )
    fsm = []
    for r in range(3):
        start, replies = run_round(exp, r)
        fsm.append(torch.cat([replies[k].extras["fsm"] for k in start.chosen]).double())
    algo.server_step(3)
    tau = algo.config.tau(3, 6)  # Eq. 11 at R_g = 4: 0.48
    window = torch.cat(fsm[1:])  # rounds 2 and 3; round 1's values have left the window
    expected = float(torch.quantile(window, 1 - tau))
    assert 0 < tau < 1 and algo.tau_now == tau
    assert algo.boundary_now == pytest.approx(expected, rel=1e-9)
    assert algo.message_for(0, 3).extras["boundary"] == pytest.approx(expected, rel=1e-9)
    assert expected != pytest.approx(float(torch.quantile(fsm[2], 1 - tau)), rel=1e-3)  # not the last round alone


# ---- FedSEAL: the final server update on the last clients' average, the thresholds of the final model --------
def test_fedseal_final_model_is_the_server_update_of_the_last_average_with_its_thresholds(small_config, plain_weak):
    R, steps, decay = 2, 3, 0.8
    exp, algo = build(
        small_config,
        "ssfl_args.algorithm=fedseal",
        "data_args.num_server_val=40",
        "ssfl_args.bootstrap_steps=4",
        f"ssfl_args.server_steps={steps}",
        f"ssfl_args.lr_decay={decay}",
        f"train_args.comm_round={R}",
        "train_args.batch_size=64",
        "train_args.client_num_per_round=2",
    )
    for r in range(R):
        start, replies = run_round(exp, r)
    last = [replies[k].weights for k in start.chosen if not replies[k].is_empty]
    assert len(last) == 2
    average = {key: sum(m[key].double() for m in last) / 2 for key in last[0]}
    assert gap(algo.base_state, average) < 1e-6  # Eq. 2 of the last round's clients
    algo.finalize()
    lr = algo.train.learning_rate * decay ** (R - 1)  # the last round's rate, constant (Sec. 5.2.1)
    expected = sgd_replay(algo, algo.base_state, steps, lambda s: lr)
    assert gap(algo.global_state, expected) < CLOSE
    assert gap(algo.global_state, algo.base_state) > 1e-4
    # Eq. 5 of the final model on the validation set: tau_m = sum_{pred = m} conf / #{y = m}, in [0, 1]
    model = algo.model_fn().eval()
    model.load_state_dict(algo.global_state)
    d = algo.server_data
    with torch.no_grad():
        conf, pred = model(InputPipeline(algo.data_info, CPU).plain(d.images[d.val_idx])).softmax(dim=1).max(dim=1)
    y = d.labels[d.val_idx]
    tau = [min(float(conf[pred == m].sum()) / max(int((y == m).sum()), 1), 1.0) for m in range(10)]
    tau = [t if int((y == m).sum()) else 1.0 for m, t in enumerate(tau)]
    assert algo.thresholds.tolist() == pytest.approx(tau, abs=1e-6)


# ---- SemiFL: the final fine-tune and its static BatchNorm --------------------------------------------------
def test_semifl_final_model_is_the_fine_tuned_last_average(small_config, plain_weak):
    R = 2
    exp, algo = build(
        small_config,
        "ssfl_args.algorithm=semifl",
        "ssfl_args.threshold=0",
        "ssfl_args.local_epochs=null",
        "ssfl_args.server_steps=2",
        "ssfl_args.server_batch_size=64",
        f"train_args.comm_round={R}",
        "train_args.local_steps=2",
    )
    for r in range(R):
        run_round(exp, r)
    base = dict(algo.base_state)
    algo.finalize()
    rate = cosine_lr(algo.train, (R - 1) * algo.train.local_steps)  # the last round's rate
    expected = sgd_replay(algo, base, 2, lambda s: rate, nesterov=True, clip=1.0)
    assert gap(algo.global_state, expected) < CLOSE
    assert gap(algo.global_state, base) > 1e-4


def test_semifl_final_model_carries_the_static_bn_statistics_of_the_server_data(small_config):
    exp, algo = build(
        small_config,
        "ssfl_args.algorithm=semifl",
        "model_args.norm=bn",
        "ssfl_args.threshold=0",
        "ssfl_args.local_epochs=null",
        "ssfl_args.server_steps=1",
        "ssfl_args.sbn=server",
        "train_args.comm_round=1",
        "train_args.local_steps=1",
        "train_args.batch_size=64",
    )
    run_round(exp, 0)
    algo.finalize()
    model = algo.model_fn().train()
    model.load_state_dict(algo.global_state)
    inputs = {}
    hooks = [
        m.register_forward_pre_hook(lambda mod, args, name=name: inputs.__setitem__(name, args[0].detach()))
        for name, m in model.named_modules()
        if isinstance(m, torch.nn.BatchNorm2d)
    ]
    x, _ = server_labels(algo)  # the server's data: its 50 labels (no validation set here), one batch
    with torch.no_grad():
        model(x)
    for h in hooks:
        h.remove()
    assert inputs
    for name, z in inputs.items():
        mean = z.double().mean(dim=(0, 2, 3))
        var = z.double().var(dim=(0, 2, 3), unbiased=False)
        assert torch.allclose(algo.global_state[f"{name}.running_mean"].double(), mean, atol=1e-5)
        assert torch.allclose(algo.global_state[f"{name}.running_var"].double(), var, rtol=1e-4, atol=1e-6)


# ---- FedAvg / FedProx x FixMatch / UDA: the model the server broadcasts ------------------------------------
@pytest.mark.parametrize("name", ["fedavg_fixmatch", "fedprox_uda"])
def test_baselines_broadcast_the_servers_lambda_s_steps_on_the_original_image(small_config, monkeypatch, name):
    monkeypatch.setattr(InputPipeline, "weak", lambda self, images, generator: -self.plain(images).flip(-1))
    exp, algo = build(small_config, f"ssfl_args.algorithm={name}", "train_args.batch_size=64")
    before = dict(algo.global_state)
    algo.server_step(1)
    T = algo.train.local_steps
    # FedMatch Algorithm 2 lines 4-8 with A.1's original image and Table 4's lambda_s = 10
    expected = sgd_replay(algo, before, T, lambda s: cosine_lr(algo.train, T + s), loss_weight=10.0)
    assert gap(algo.message_for(0, 1).weights, expected) < CLOSE


# ---- fedavg_sl and server_only: the server's own steps ---------------------------------------------------
def test_fedavg_sl_averages_in_the_server_trained_from_the_global_model(small_config, plain_weak):
    exp, algo = build(small_config, "ssfl_args.algorithm=fedavg_sl", "train_args.batch_size=64")
    before = dict(algo.global_state)
    algo.server_step(1)
    T = algo.train.local_steps
    expected = sgd_replay(algo, before, T, lambda s: cosine_lr(algo.train, T + s))
    assert gap(algo._server_state, expected) < CLOSE and gap(expected, before) > 1e-4


def test_server_only_final_model_is_every_rounds_steps_on_the_labels(small_config, plain_weak, tmp_path):
    from fedml_ssfl.checkpoint import load_checkpoint
    from fedml_ssfl.runtime.local import run_local

    cfg = small_config("ssfl_args.algorithm=server_only", "train_args.batch_size=64", "train_args.comm_round=2")
    run_local(cfg, run_dir=tmp_path / "run")
    final = load_checkpoint(tmp_path / "run" / "checkpoints" / "last.pt")["algorithm"]["global_state"]
    exp, algo = build(small_config, "ssfl_args.algorithm=server_only", "train_args.comm_round=2")
    T = algo.train.local_steps
    state = dict(algo.global_state)
    for r in range(2):  # a fresh SGD each round, Eq. 9 at the global local step
        state = sgd_replay(algo, state, T, lambda s, r=r: cosine_lr(algo.train, r * T + s))
    assert gap(final, state) < CLOSE


# ---- the local baselines: one model per client ------------------------------------------------------------
@pytest.mark.parametrize("name", ["local_sl", "local_fixmatch"])
def test_local_baselines_evaluate_each_client_with_its_own_model(small_config, name):
    exp, algo = build(
        small_config, f"ssfl_args.algorithm={name}", *LABELS_AT_CLIENT, "train_args.client_num_per_round=3"
    )
    start, replies = run_round(exp, 0)
    initial = exp.algorithm.global_state
    models = algo.evaluation_models()
    assert len(models) == 4
    for k in range(4):
        state = models[k].state_dict()
        own = replies[k].extras["eval_weights"] if k in replies else initial
        assert gap(state, own) == 0, k
    trained = sorted(replies)
    assert gap(replies[trained[0]].extras["eval_weights"], replies[trained[1]].extras["eval_weights"]) > 1e-4
