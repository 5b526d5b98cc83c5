"""Aggregated quantities other than the model, pinned by value to the papers' formulas written out here.

Every test runs the algorithm's real round (its server step, its messages, each client's own update,
its ``aggregate``, through :func:`~fedml_ssfl.runtime.common.start_round` /
:func:`~fedml_ssfl.runtime.common.finish_round`) on clients cut to unequal sizes and unequal
labelled / unlabelled counts, and compares what the run computed with the paper's formula evaluated
here from first principles (our own forward passes, our own sums): never by calling the function under
test. Each test also checks that the likely wrong reading (a uniform mean where the paper pools by
count, a count-weighted mean where the paper is uniform, a stale round's value) lies far from the
paper's value on these clients, so that the test can fail.

* SemiFL (Diao et al., Algorithm 1, "static batch normalization"): the evaluated model's BN running
  statistics are the mean and biased variance of every BN layer's inputs pooled over the server's data
  and every client's unlabelled data, under the model the server sent, in train mode.
* FedSEAL (Bian et al.): Eq. 5's class-wise thresholds, computed where the run computes them (on the
  server's validation set, under the model it sends that round, clipped to [0, 1]); Eq. 8's
  self-ensemble of every client, sampled or not, the running mean of each round's global model's
  probabilities; Eq. 13's lambda and the per-round rate read at the round's own index.
* FedMatch (Jeong et al., Algorithm 1/2): psi averaged uniformly then hard-thresholded (|x| < t -> 0);
  BatchNorm buffers uniform over clients of unequal sizes; the upload ratio the mean over clients; the
  helpers sent in the rounds ``r % helper_interval == 0`` only, once clients have embeddings.
* Every registered algorithm: the count a client's reply carries (what any weighted average reads) is
  the paper's n for it, with unequal labelled and unlabelled counts, trained or idle.
"""

from __future__ import annotations

import dataclasses
import math

import pytest
import torch
from torch import nn

from fedml_ssfl.algorithms.base import ClientContext
from fedml_ssfl.algorithms.fedmatch import PSI, SIGMA
from fedml_ssfl.algorithms.registry import available_algorithms, get_algorithm
from fedml_ssfl.experiment import build_experiment
from fedml_ssfl.runtime.common import finish_round, start_round
from fedml_ssfl.training import InputPipeline

CPU = torch.device("cpu")
LABELS_AT_CLIENT = [
    "data_args.label_scenario=client",
    "data_args.num_server_labels=0",
    "data_args.labels_per_class_client=2",
]
UNLABELED = (30, 90, 200)
LABELED = (20, 4, 10)


def ctx(r: int) -> ClientContext:
    return ClientContext(round_idx=r, device=CPU, seed=0)


def build(small_config, *overrides):
    exp = build_experiment(small_config(*overrides))
    exp.algorithm.setup()
    return exp, exp.algorithm


def cut(exp, k, r, n_u, n_l=0):
    """Client ``k``'s data at round ``r`` cut to ``n_u`` unlabelled and ``n_l`` labelled samples."""
    full = exp.client_data(k, r)
    assert full.num_unlabeled >= n_u and full.num_labeled >= n_l, (k, full.num_unlabeled, full.num_labeled)
    return dataclasses.replace(full, unlabeled_idx=full.unlabeled_idx[:n_u], labeled_idx=full.labeled_idx[:n_l])


def one_round(exp, r, data, states, *, idle=False):
    """Round ``r`` for real: server step, messages, every chosen client's update on ``data[k]``, listeners
    (an algorithm that broadcasts to all) folding the message into their state, aggregate."""
    algo = exp.algorithm
    start = start_round(exp, r)
    replies = {}
    for k in start.chosen:
        if idle:
            replies[k] = algo.idle_reply(start.messages[k], data[k], states.setdefault(k, {}), ctx(r))
        else:
            replies[k] = algo.run_client_update(start.messages[k], data[k], states.setdefault(k, {}), ctx(r))
    for k, msg in start.listeners.items():
        algo.run_client_receive(msg, data[k], states.setdefault(k, {}), ctx(r))
    finish_round(exp, start, replies, 0)
    return start, replies


def far(a: torch.Tensor, b: torch.Tensor, margin: float = 1e-4) -> bool:
    return float((a.double() - b.double()).abs().max()) > margin


# ---- SemiFL: static batch normalisation over the server and clients of unequal sizes -----------------
def bn_inputs(model: nn.Module, x: torch.Tensor) -> dict[str, torch.Tensor]:
    """Each BatchNorm layer's input of one train-mode pass of ``x``, as (channels, values) in float64."""
    seen: dict[str, torch.Tensor] = {}
    hooks = [
        m.register_forward_pre_hook(
            lambda mod, args, name=name: seen.__setitem__(name, args[0].detach().double().transpose(0, 1).flatten(1))
        )
        for name, m in model.named_modules()
        if isinstance(m, nn.modules.batchnorm._BatchNorm)
    ]
    model.train()
    with torch.no_grad():
        model(x)
    for h in hooks:
        h.remove()
    return seen


def test_semifl_sbn_statistics_pool_the_server_and_every_clients_data_by_count(small_config):
    exp, algo = build(
        small_config,
        "ssfl_args.algorithm=semifl",
        "model_args.norm=bn",
        "data_args.num_server_val=20",
        "ssfl_args.threshold=0",
        "ssfl_args.local_epochs=null",
        "ssfl_args.server_steps=1",
        "ssfl_args.sbn=federated",
        "ssfl_args.sbn_batch_size=512",  # each party's data is one pass: the pooled figures need no batch order
        "train_args.client_num_per_round=3",
        "train_args.local_steps=1",
    )
    start = start_round(exp, 0)
    sent = start.messages[start.chosen[0]].weights  # W_g of Algorithm 1, after the server's fine-tune
    data = {k: cut(exp, k, 0, n) for k, n in zip(start.chosen, UNLABELED)}
    replies = {k: algo.run_client_update(start.messages[k], data[k], {}, ctx(0)) for k in start.chosen}
    finish_round(exp, start, replies, 0)

    model = algo.model_fn()
    model.load_state_dict(sent)
    pipeline = InputPipeline(algo.data_info, CPU)
    sd = algo.server_data
    parties = [sd.images[torch.cat([sd.labeled_idx, sd.val_idx])], *(d.images[d.unlabeled_idx] for d in data.values())]
    assert [p.shape[0] for p in parties] == [50 + 20, *UNLABELED]
    per_party = [bn_inputs(model, pipeline.plain(images)) for images in parties]
    assert per_party[0]
    for name in per_party[0]:
        pooled = torch.cat([p[name] for p in per_party], dim=1)  # every value of every party, one population
        mean, var = pooled.mean(dim=1), pooled.var(dim=1, unbiased=False)
        got_mean = algo.global_state[f"{name}.running_mean"].double()
        got_var = algo.global_state[f"{name}.running_var"].double()
        assert torch.allclose(got_mean, mean, atol=1e-5), name
        assert torch.allclose(got_var, var, rtol=1e-4, atol=1e-6), name
        party_means = torch.stack([p[name].mean(dim=1) for p in per_party]).mean(dim=0)  # one vote per party
        server_only = per_party[0][name].mean(dim=1)
        assert far(party_means, mean, 1e-3) and far(server_only, mean, 1e-3), name
    # the parameters are the server's momentum step on the clients' uniform mean; sBN leaves them alone
    for key, _ in model.named_parameters():
        assert torch.equal(algo.global_state[key], sent[key])


# ---- FedSEAL: Eq. 5 thresholds where the run computes them, Eq. 8 ensembles of every client -----------------
def eval_probs(algo, weights, images) -> torch.Tensor:
    model = algo.model_fn()
    model.load_state_dict(weights)
    model.eval()
    with torch.no_grad():
        return torch.softmax(model(InputPipeline(algo.data_info, CPU).plain(images)).double(), dim=1)


def eq5(probs: torch.Tensor, labels: torch.Tensor, d: int) -> torch.Tensor:
    """Bian et al. Eq. 5, one class at a time: sum of the winning confidences of the samples predicted m
    over the number of validation samples labelled m; clipped to [0, 1]; 1 for a class with no sample."""
    out = []
    for m in range(d):
        pred = probs.argmax(dim=1)
        num = sum(float(probs[i, m]) for i in range(len(labels)) if int(pred[i]) == m)
        den = sum(1 for y in labels.tolist() if y == m)
        out.append(1.0 if den == 0 else min(max(num / den, 0.0), 1.0))
    return torch.tensor(out, dtype=torch.float64)


def test_fedseal_thresholds_and_every_clients_ensemble_are_eq5_and_eq8_of_each_rounds_model(small_config):
    rounds = 3
    exp, algo = build(
        small_config,
        "ssfl_args.algorithm=fedseal",
        "data_args.num_server_val=40",
        "ssfl_args.bootstrap_steps=2",
        "ssfl_args.server_steps=1",
        "ssfl_args.lambda_rampup_rounds=4",
        "ssfl_args.lr_decay=0.5",
        f"train_args.comm_round={rounds}",
        "train_args.client_num_per_round=2",  # two clients listen each round: they fold w^t too
        "train_args.local_steps=1",
    )
    sizes = dict(zip(range(4), (30, 90, 200, 60)))
    data = {k: cut(exp, k, 0, n) for k, n in sizes.items()}
    states: dict = {}
    sd = algo.server_data
    val_images, val_labels = sd.images[sd.val_idx], sd.labels[sd.val_idx]
    d = algo.data_info.num_classes
    models = []
    for r in range(rounds):
        start, replies = one_round(exp, r, data, states)
        w_t = algo.global_state  # the model the server trained this round and sent with its thresholds
        models.append(w_t)
        for msg in [*start.messages.values(), *start.listeners.values()]:
            assert all(torch.equal(msg.weights[k], w_t[k]) for k in w_t)
        expected = eq5(eval_probs(algo, w_t, val_images), val_labels, d)
        sent = next(iter(start.messages.values())).extras["thresholds"]
        assert torch.allclose(sent.double(), expected, atol=1e-6), r
        assert torch.allclose(algo.thresholds.double(), expected, atol=1e-6), r
        assert len(start.chosen) == 2 and len(start.listeners) == 2
        # Eq. 13's lambda and Sec. 5.2.1's rate at this round's own index (ramp over 4 rounds from 0.1 to 1)
        for k in start.chosen:
            metrics = replies[k].extras["metrics"]
            assert metrics["ensemble_size"] == r + 1
        row_lambda = 0.1 + 0.9 * min(1.0, r / 4)
        assert algo.config.positive_weight(r) == pytest.approx(row_lambda)
        assert algo.round_lr(r) == pytest.approx(algo.train.learning_rate * 0.5**r)
    assert far(eq5(eval_probs(algo, models[0], val_images), val_labels, d), expected, 1e-3)  # thresholds move
    for k, n in sizes.items():  # Eq. 8: p_bar^t = mean over t of p(x; w^t), every client, sampled or not
        probs = [eval_probs(algo, w, data[k].images[data[k].unlabeled_idx]) for w in models]
        mean = sum(probs) / len(probs)
        assert states[k]["ensemble_count"] == rounds
        assert states[k]["ensemble"].shape == (n, d)
        assert torch.allclose(states[k]["ensemble"].double(), mean, atol=1e-5), k
        assert far(probs[-1], mean, 1e-3)  # the last model alone is another value


def test_fedseal_client_step_uses_the_rounds_lambda_and_decayed_rate(small_config, monkeypatch):
    """The lambda and rate a client trains with are read at the round's index (ctx.round_idx), not the
    first round's or the next one's: the job the real step builds, round by round."""
    from fedml_ssfl.algorithms import fedseal as fedseal_module

    exp, algo = build(
        small_config,
        "ssfl_args.algorithm=fedseal",
        "data_args.num_server_val=20",
        "ssfl_args.fixed_threshold=0",
        "ssfl_args.bootstrap_steps=0",
        "ssfl_args.server_steps=1",
        "ssfl_args.lambda_rampup_rounds=4",
        "ssfl_args.lr_decay=0.5",
        "train_args.comm_round=4",
        "train_args.local_steps=1",
    )
    seen = []
    original = fedseal_module.PositiveNegativeLoss

    def spy(weight):
        seen.append(weight)
        return original(weight)

    monkeypatch.setattr(fedseal_module, "PositiveNegativeLoss", spy)
    jobs = []
    real_job = type(algo).local_job

    def record(self, msg, data, state, c):
        job = real_job(self, msg, data, state, c)
        jobs.append((c.round_idx, job.lr))
        return job

    monkeypatch.setattr(type(algo), "local_job", record)
    data = {k: cut(exp, k, 0, 30) for k in range(4)}
    states: dict = {}
    for r in range(4):
        seen.clear()
        jobs.clear()
        one_round(exp, r, data, states)
        assert seen and all(w == pytest.approx(0.1 + 0.9 * r / 4) for w in seen), (r, seen)
        lr = algo.train.learning_rate * 0.5**r
        assert jobs and all(rr == r and float(j) == pytest.approx(lr) for rr, j in jobs), (r, jobs)


# ---- FedMatch: psi thresholded after a uniform mean, buffers, upload ratio, the helper rounds -------------
def reconstructed(algo, replies, views, prefix):
    """What each client trained: what it held (the server's S2C record before aggregation) + its delta."""
    lay = algo.layout()
    out = {}
    for k, msg in replies.items():
        out[k] = {}
        for n in lay.params:
            t = msg.weights[prefix + n]
            out[k][n] = views[k][prefix + n] + (t.to_dense() if t.is_sparse else t).reshape(lay.shapes[n])
    return out


@pytest.mark.parametrize("scenario", ["client", "server"])
def test_fedmatch_psi_buffers_and_upload_ratio_are_uniform_over_unequal_clients(small_config, scenario):
    extra = LABELS_AT_CLIENT if scenario == "client" else []
    labeled = LABELED if scenario == "client" else (0, 0, 0)
    exp, algo = build(
        small_config,
        "ssfl_args.algorithm=fedmatch",
        "model_args.norm=bn",
        "ssfl_args.tau=0",
        "ssfl_args.lambda_a=1",
        "ssfl_args.psi_threshold=2e-4",  # large enough that the threshold zeroes entries of the mean
        "ssfl_args.c2s_threshold=2e-2",  # sparse uploads whose sizes differ by client
        "train_args.client_num_per_round=3",
        "train_args.local_steps=2",
        *extra,
    )
    start = start_round(exp, 0)
    data = {k: cut(exp, k, 0, u, n_l) for k, u, n_l in zip(start.chosen, UNLABELED, labeled)}
    replies = {k: algo.run_client_update(start.messages[k], data[k], {}, ctx(0)) for k in start.chosen}
    views = {k: dict(algo.views[k]) for k in start.chosen}  # what each client held (s2c records)
    row = finish_round(exp, start, replies, 0)
    lay = algo.layout()
    counts = [u + n_l for u, n_l in zip(UNLABELED, labeled)]
    assert [replies[k].num_samples for k in start.chosen] == counts

    psis = reconstructed(algo, replies, views, PSI)
    thr = 2e-4
    zeroed = 0
    for n in lay.params:
        mean = sum(psis[k][n].double() for k in start.chosen) / 3
        expected = torch.where(mean.abs() < thr, torch.zeros_like(mean), mean)  # Algorithm 1 l. 11, then |x| < t -> 0
        assert torch.allclose(algo.psi[n].double(), expected, atol=1e-7), n
        zeroed += int(((mean != 0) & (expected == 0)).sum())
    assert zeroed > 0, "the threshold never bit: raise psi_threshold"
    by_count = {n: sum(c * psis[k][n].double() for c, k in zip(counts, start.chosen)) / sum(counts) for n in lay.params}
    assert any(far(by_count[n], algo.psi[n], 1e-5) for n in lay.params)
    if scenario == "client":
        sigmas = reconstructed(algo, replies, views, SIGMA)
        for n in lay.params:
            mean = sum(sigmas[k][n].double() for k in start.chosen) / 3
            assert torch.allclose(algo.sigma[n].double(), mean, atol=1e-7), n

    floats = [b for b in lay.buffers if algo.buffers[b].is_floating_point()]
    assert floats, "a BN model has running statistics"
    for b in floats:  # each client's running statistics, after its own steps on its own data: a uniform mean
        mean = sum(replies[k].weights[b].double() for k in start.chosen) / 3
        assert torch.allclose(algo.buffers[b].double(), mean, atol=1e-6), b
        assert torch.equal(algo.global_state[b], algo.buffers[b])
    weighted = sum(c * replies[k].weights[floats[0]].double() for c, k in zip(counts, start.chosen)) / sum(counts)
    assert far(weighted, algo.buffers[floats[0]], 1e-4)

    # Table 1's cost: the values each client sent (non-zeros of a sparse delta, every entry of a dense one)
    # over the trainable parameters, averaged over the clients, one vote each
    n_params = sum(math.prod(lay.shapes[n]) for n in lay.params)

    def values(msg):
        return sum(
            (t.coalesce().values().numel() if t.is_sparse else t.numel())
            for key, t in msg.weights.items()
            if key not in lay.buffers
        )

    per_client = [values(replies[k]) / n_params for k in start.chosen]
    if scenario == "client":  # (labels-at-server: every client's psi delta is mostly the same L2 pull onto sigma)
        assert len(set(per_client)) > 1
    assert row["c2s_ratio"] == pytest.approx(sum(per_client) / 3, rel=1e-9)


def test_fedmatch_sends_helpers_in_the_rounds_of_its_interval_once_clients_are_embedded(small_config):
    exp, algo = build(
        small_config,
        "ssfl_args.algorithm=fedmatch",
        *LABELS_AT_CLIENT,
        "ssfl_args.tau=0",
        "ssfl_args.num_helpers=2",
        "ssfl_args.helper_interval=3",
        "train_args.comm_round=7",
        "train_args.local_steps=1",
    )
    data = {k: cut(exp, k, 0, 30, 4) for k in range(4)}
    states: dict = {}
    helpers_by_round = []
    for r in range(7):
        start, replies = one_round(exp, r, data, states)
        helpers_by_round.append(sorted({int(m.extras["num_helpers"]) for m in start.messages.values()}))
        for k in start.chosen:
            assert replies[k].extras["metrics"]["helpers"] == start.messages[k].extras["num_helpers"]
    # round 0: no client has an embedding yet; then every round r with r % 3 == 0, and only those
    assert helpers_by_round == [[0], [0], [0], [2], [0], [0], [2]]


# ---- every registered algorithm: the count its client's reply carries ----------------------------------
# The paper's n for each algorithm's client reply, from the client's unlabelled (u) and labelled (l) counts:
# what a sample-weighted average (FedSiam Eq. 2, FedAvg's n_k / n) reads, and what a uniform one must ignore.
PAPER_COUNT = {
    "fedavg_ssl": lambda u, n_l: u,  # Zhang et al.: clients hold unlabelled data only (labels-at-server)
    "fedseal": lambda u, n_l: u,  # Bian et al.: unlabelled clients
    "semifl": lambda u, n_l: u,  # Diao et al.: unlabelled clients
    "fedmatch": lambda u, n_l: u + n_l,  # Jeong et al. Alg. 1: sigma on l labels, psi on u samples
    "fedsiam": lambda u, n_l: u + n_l,  # Long et al. Eq. 2: n^(b), all the data on client b
    "fedavg_fixmatch": lambda u, n_l: u + n_l,  # FedAvg's n_k: every sample client k trained on
    "fedprox_fixmatch": lambda u, n_l: u + n_l,
    "fedavg_uda": lambda u, n_l: u + n_l,
    "fedprox_uda": lambda u, n_l: u + n_l,
    "fedavg_sl": lambda u, n_l: u + n_l,  # the supervised bound trains on all of a client's samples, labelled
    "local_sl": lambda u, n_l: u + n_l,  # no average; the count picks the single exported model
    "local_fixmatch": lambda u, n_l: u + n_l,
    "local_uda": lambda u, n_l: u + n_l,
    "server_only": None,  # no client trains: the clients send nothing
}
TRAINS = {  # overrides under which every client of the round trains (and so replies with a model)
    "fedavg_ssl": ["ssfl_args.threshold=0"],
    "fedseal": ["data_args.num_server_val=20", "ssfl_args.fixed_threshold=0", "ssfl_args.bootstrap_steps=0"],
    "semifl": ["ssfl_args.threshold=0", "ssfl_args.local_epochs=null", "ssfl_args.server_steps=1"],
    "fedmatch": ["ssfl_args.tau=0"],
    "fedavg_fixmatch": ["ssfl_args.threshold=0"],
    "fedprox_fixmatch": ["ssfl_args.threshold=0"],
    "fedavg_uda": ["ssfl_args.threshold=0"],
    "fedprox_uda": ["ssfl_args.threshold=0"],
}


def test_every_registered_algorithm_has_its_papers_count():
    assert sorted(PAPER_COUNT) == available_algorithms(), "a new algorithm: write its paper's count here"


CASES = [
    pytest.param(name, idle, id=f"{name}-{'idle' if idle else 'trained'}")
    for name in sorted(PAPER_COUNT)
    for idle in (False, True)
    if not (idle and get_algorithm(name).idle_clients_note)  # the config check refuses idle_clients there
]


@pytest.mark.parametrize("name, idle", CASES)
def test_each_reply_carries_the_papers_count_on_unequal_clients(small_config, name, idle):
    cls = get_algorithm(name)
    client = "client" in cls.label_scenarios
    labeled = LABELED if client else (0, 0, 0)
    overrides = [f"ssfl_args.algorithm={name}", *TRAINS.get(name, []), "train_args.local_steps=1"]
    overrides += ["train_args.client_num_per_round=3", *(LABELS_AT_CLIENT if client else [])]
    exp, algo = build(small_config, *overrides)
    start = start_round(exp, 0)
    data = {k: cut(exp, k, 0, u, n_l) for k, u, n_l in zip(start.chosen, UNLABELED, labeled)}
    run = algo.idle_reply if idle else algo.run_client_update
    replies = {k: run(start.messages[k], data[k], {}, ctx(0)) for k in start.chosen}
    count = PAPER_COUNT[name]
    if count is None:
        assert all(m.is_empty and m.num_samples == 0 for m in replies.values())
        return
    expected = [count(u, n_l) for u, n_l in zip(UNLABELED, labeled)]
    assert [replies[k].num_samples for k in start.chosen] == expected
    assert len(set(expected)) == 3
    finish_round(exp, start, replies, 0)


def test_fedmatch_embeds_each_clients_own_model_with_its_own_statistics_on_the_seeded_noise(small_config):
    """Sec. 3.1: the server embeds client l's model theta_l = sigma_l + psi_l (with the BatchNorm statistics
    sent) as its prediction on one fixed random-noise input (tests/test_final_paths.py follows the helpers
    the embeddings choose)."""
    from fedml_ssfl import seeding

    exp, algo = build(
        small_config,
        "ssfl_args.algorithm=fedmatch",
        "model_args.norm=bn",
        *LABELS_AT_CLIENT,
        "ssfl_args.tau=0",
        "ssfl_args.lambda_a=1",
        "ssfl_args.num_helpers=1",
        "ssfl_args.helper_interval=1",
        "train_args.local_steps=2",
    )
    info = algo.data_info
    gen = seeding.generator(exp.config.common_args.random_seed, "fedmatch-probe")
    noise = (0.5 + 0.5 * torch.randn((1, info.in_channels, info.image_size, info.image_size), generator=gen)).clamp(
        0, 1
    )
    mean = torch.tensor(info.mean).view(1, -1, 1, 1)
    std = torch.tensor(info.std).view(1, -1, 1, 1)
    probe = (noise - mean) / std  # Gaussian noise in pixel space, normalised like the data
    assert torch.allclose(algo.probe, probe, atol=1e-6)

    start = start_round(exp, 0)
    data = {k: cut(exp, k, 0, u, n_l) for k, u, n_l in zip(start.chosen, (30, 90, 200, 60), (20, 4, 10, 6))}
    replies = {k: algo.run_client_update(start.messages[k], data[k], {}, ctx(0)) for k in start.chosen}
    views = {k: dict(algo.views[k]) for k in start.chosen}
    finish_round(exp, start, replies, 0)
    lay = algo.layout()
    sigmas = reconstructed(algo, replies, views, SIGMA)
    psis = reconstructed(algo, replies, views, PSI)
    emb = {}
    for k in start.chosen:
        model = algo.model_fn()
        state = {n: sigmas[k][n] + psis[k][n] for n in lay.params}
        state.update({b: replies[k].weights[b] for b in lay.buffers})  # client k's own running statistics
        model.load_state_dict(state)
        model.eval()
        with torch.no_grad():
            emb[k] = torch.softmax(model(probe).double(), dim=1).reshape(-1)
        # compared as log-probabilities: on noise a BN model's softmax is nearly one-hot
        assert torch.allclose(algo.embeddings[k].log(), emb[k].log(), atol=1e-3), k
        model.load_state_dict({**state, **{b: algo.buffers[b] for b in lay.buffers}})
        with torch.no_grad():  # the global statistics give another embedding: the test can tell them apart
            assert far(torch.log_softmax(model(probe).double(), dim=1).reshape(-1), emb[k].log(), 1e-2)


# ---- the server's supervised step: which view of its labelled data, towards which label ----------------
SERVER_VIEW = {  # the papers' server loss on its labels: alpha(x), the weak view, towards the true label y
    "fedavg_ssl": ["ssfl_args.bootstrap_steps=0"],  # Zhang et al. Eq. 2: CE(f(alpha(x); w_s), y)
    "semifl": ["ssfl_args.server_steps=2"],  # Diao et al. Eq. 1: CE(f(alpha(x)), y)
    "fedseal": ["ssfl_args.bootstrap_steps=0", "ssfl_args.server_steps=2", "data_args.num_server_val=20"],  # Eq. 3/4
    "fedmatch": ["ssfl_args.server_steps=2"],  # Jeong et al. Eq. 4 (Algorithm 2): lambda_s CE(y, p(alpha(x)))
}


@pytest.mark.parametrize("name", sorted(SERVER_VIEW))
def test_the_server_trains_the_weak_view_of_its_labels_towards_their_labels(small_config, monkeypatch, name):
    from tests.known_net import WEAK, Recorder, coded_data, tag_views, targets, took_loss

    tag_views(monkeypatch)
    exp = build_experiment(
        small_config(
            f"ssfl_args.algorithm={name}", "train_args.batch_size=8", "train_args.local_steps=2", *SERVER_VIEW[name]
        )
    )
    algo = exp.algorithm
    rec = Recorder(num_classes=10)
    algo.model_fn = rec.factory()
    coded = coded_data(-1, 0, 40)  # 40 labelled samples whose id is in the image, label id % 10
    algo.server_data = dataclasses.replace(
        algo.server_data,
        images=coded.images,
        labels=coded.labels,
        labeled_idx=coded.labeled_idx,
        val_idx=coded.labeled_idx[:0],
    )
    if name == "fedseal":  # Eq. 5 needs a validation set: the last 10 samples, never trained on
        algo.server_data = dataclasses.replace(
            algo.server_data, labeled_idx=coded.labeled_idx[:30], val_idx=coded.labeled_idx[30:]
        )
    algo.setup()
    rec.clear()
    algo.server_step(0)
    trained = rec.trained()
    assert len(trained) == 2, [c.views.tolist() for c in rec.calls]  # one pass a step
    for call in trained:
        assert (call.views == WEAK).all() and call.training
        assert took_loss(call.grad).all()
        assert torch.equal(targets(call.grad), call.ids % 10)  # the true label, not the model's class on any view
        assert set(call.ids.tolist()) <= set(algo.server_data.labeled_idx.tolist())


def test_fedmatch_averages_sigma_over_the_clients_that_trained_it_and_psi_over_all(small_config):
    """Labels-at-client with one client holding no label: it trains psi only (Eq. 5) and sends no sigma, so
    sigma is the uniform mean of the two clients that trained it (Algorithm 1 l. 10), psi of all three."""
    exp, algo = build(
        small_config,
        "ssfl_args.algorithm=fedmatch",
        *LABELS_AT_CLIENT,
        "ssfl_args.tau=0",
        "ssfl_args.lambda_a=1",
        "train_args.client_num_per_round=3",
        "train_args.local_steps=2",
    )
    start = start_round(exp, 0)
    labeled = (20, 0, 10)
    data = {k: cut(exp, k, 0, u, n_l) for k, u, n_l in zip(start.chosen, UNLABELED, labeled)}
    replies = {k: algo.run_client_update(start.messages[k], data[k], {}, ctx(0)) for k in start.chosen}
    views = {k: dict(algo.views[k]) for k in start.chosen}
    held = {n: views[start.chosen[1]][SIGMA + n] for n in algo.layout().params}
    finish_round(exp, start, replies, 0)
    lay = algo.layout()
    a, b, c = start.chosen
    assert not any(key.startswith(SIGMA) for key in replies[b].weights)
    assert [replies[k].num_samples for k in start.chosen] == [50, 90, 210]
    sigmas = reconstructed(algo, {a: replies[a], c: replies[c]}, views, SIGMA)
    psis = reconstructed(algo, replies, views, PSI)
    thr = algo.setting("psi_threshold")
    for n in lay.params:
        two = (sigmas[a][n].double() + sigmas[c][n].double()) / 2
        assert torch.allclose(algo.sigma[n].double(), two, atol=1e-7), n
        mean = sum(psis[k][n].double() for k in start.chosen) / 3
        assert torch.allclose(algo.psi[n].double(), torch.where(mean.abs() < thr, 0 * mean, mean), atol=1e-7), n
    three = {n: (sigmas[a][n].double() + held[n].double() + sigmas[c][n].double()) / 3 for n in lay.params}
    assert any(far(three[n], algo.sigma[n], 1e-5) for n in lay.params)
