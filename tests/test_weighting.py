"""Each algorithm averages with its paper's weights, pinned by value on clients of unequal sizes.

With clients of equal size a uniform average and a sample-weighted one agree, so a test on such
clients cannot tell a paper's weighting from the other. Here every round is real (the server step,
the messages, the clients' own updates, the algorithm's own ``aggregate``, through
:func:`~fedml_ssfl.runtime.common.start_round` / :func:`~fedml_ssfl.runtime.common.finish_round`)
on clients cut to unequal sizes, and the server's new model is compared with the paper's formula
written out here over the clients' replies. Each test also checks that the other weighting would
give a model far from it on these clients, so that the test can fail.

* Zhang et al. Eq. 4/5: ``(w_s + sum_k w_k) / (C_k + 1)``, uniform, the server one party; Eq. 7:
  each group ``(w_s + sum_{G_i} w_k) / (|G_i| + 1)``, the global model the plain mean of the groups.
* FedMatch Algorithm 1 lines 10-11, Algorithm 2 line 15: ``1/A sum_a``, uniform.
* FedSiam Eq. 2: ``sum_b n^(b) / sum_j n^(j) theta^b`` with ``n^(b)`` all the data on client b.
* FedSEAL Eq. 2: ``1/|K^t| sum_k w_k``, uniform, the server not counted.
* SemiFL Algorithm 1: ``W_s = M_t^-1 sum_m W_m``, uniform.
* FedAvg (McMahan et al.) and FedProx as the package runs it: ``sum_k n_k / n w_k`` with ``n_k`` the
  samples client k trained on; with ``server_protocol: parallel`` Zhang et al.'s Eq. 5.
* ``fedavg_sl``: Eq. 5 with the server, FedAvg's ``n_k / n`` without it.
* The local baselines keep no average; their single model (export, single-model evaluation) is the
  one of the client that trained on the most samples.
"""

from __future__ import annotations

import dataclasses

import pytest
import torch

from fedml_ssfl.algorithms.base import ClientContext
from fedml_ssfl.algorithms.fedmatch import PSI, SIGMA
from fedml_ssfl.algorithms.fedsiam import ONLINE_PREFIX
from fedml_ssfl.experiment import build_experiment
from fedml_ssfl.runtime.common import finish_round, start_round
from fedml_ssfl.sparse import densify, hard_threshold

TOL = 1e-6
CPU = torch.device("cpu")
LABELS_AT_CLIENT = [
    "data_args.label_scenario=client",
    "data_args.num_server_labels=0",
    "data_args.labels_per_class_client=2",
]
UNLABELED = (30, 90, 200)
LABELED = (4, 10, 20)


def uneven_round(small_config, overrides, unlabeled=UNLABELED, labeled=None, total=4):
    """Round 0 of ``overrides`` with its sampled clients cut to ``unlabeled`` / ``labeled`` samples.

    Returns the experiment, the round's start, each client's data and its reply (after aggregation).
    """
    exp = build_experiment(
        small_config(
            f"train_args.client_num_in_total={total}",
            f"train_args.client_num_per_round={len(unlabeled)}",
            "train_args.local_steps=2",
            *overrides,
        )
    )
    algo = exp.algorithm
    algo.setup()
    start = start_round(exp, 0)
    labeled = labeled or (0,) * len(unlabeled)
    ctx = ClientContext(round_idx=0, device=CPU, seed=0)
    data, replies = {}, {}
    for k, n_u, n_l in zip(start.chosen, unlabeled, labeled):
        full = exp.client_data(k, 0)
        assert full.num_unlabeled >= n_u and full.num_labeled >= n_l
        data[k] = dataclasses.replace(full, unlabeled_idx=full.unlabeled_idx[:n_u], labeled_idx=full.labeled_idx[:n_l])
        replies[k] = algo.run_client_update(start.messages[k], data[k], {}, ctx)
        assert not replies[k].is_empty or "eval_weights" in replies[k].extras
    finish_round(exp, start, replies, 0)
    return exp, start, data, replies


def params(algo):
    return [name for name, _ in algo.model_fn().named_parameters()]


def average(states, weights, keys):
    """``sum_i w_i s_i / sum_i w_i`` over ``keys``, in float64."""
    total = float(sum(weights))
    return {k: sum(float(w) * s[k].double() for s, w in zip(states, weights)) / total for k in keys}


def gap(a, b, keys):
    return max(float((a[k].double() - b[k].double()).abs().max()) for k in keys)


def pinned(actual, paper, other, keys):
    """``actual`` is the paper's average, and the other weighting lies far from it on these clients."""
    assert gap(actual, paper, keys) < TOL
    assert gap(paper, other, keys) > 100 * TOL, "the clients are too alike to tell the weightings apart"


# ---- Zhang et al. ----------------------------------------------------------------------------------
def test_fedavg_ssl_eq5_is_uniform_over_the_server_and_clients_of_unequal_sizes(small_config):
    exp, start, data, replies = uneven_round(small_config, ["ssfl_args.algorithm=fedavg_ssl", "ssfl_args.threshold=0"])
    algo, keys = exp.algorithm, params(exp.algorithm)
    models = [algo._server_state, *(replies[k].weights for k in start.chosen)]
    paper = average(models, [1] * len(models), keys)
    by_samples = average(models, [algo.server_data.labeled_idx.numel(), *UNLABELED], keys)
    pinned(algo.global_state, paper, by_samples, keys)
    assert [replies[k].num_samples for k in start.chosen] == list(UNLABELED)


def test_fedavg_ssl_eq7_averages_unequal_groups_with_the_server_then_takes_their_plain_mean(small_config):
    exp, start, data, replies = uneven_round(
        small_config,
        ["ssfl_args.algorithm=fedavg_ssl", "ssfl_args.threshold=0", "ssfl_args.averaging=grouping"],
        unlabeled=(30, 60, 90, 120, 200),
        total=5,
    )
    algo, keys = exp.algorithm, params(exp.algorithm)
    server = algo._server_state
    groups = {0: [0, 1, 2], 1: [3, 4]}  # fixed blocks k * S // K of K = 5 clients, S = 2: unequal groups
    avgs = {}
    for g, members in groups.items():
        models = [server, *(replies[k].weights for k in members)]
        avgs[g] = average(models, [1] * len(models), keys)
        assert gap(algo.group_states[g], avgs[g], keys) < TOL
    paper = average(list(avgs.values()), [1, 1], keys)
    by_group_size = average(list(avgs.values()), [4, 3], keys)
    pinned(algo.global_state, paper, by_group_size, keys)


# ---- FedMatch --------------------------------------------------------------------------------------
@pytest.mark.parametrize("scenario", ["client", "server"])
def test_fedmatch_averages_sigma_and_psi_uniformly_over_clients_of_unequal_sizes(small_config, scenario):
    extra = LABELS_AT_CLIENT if scenario == "client" else []
    labeled = LABELED if scenario == "client" else (0, 0, 0)
    exp, start, data, replies = uneven_round(
        small_config,
        ["ssfl_args.algorithm=fedmatch", "ssfl_args.tau=0", "ssfl_args.lambda_a=1", *extra],
        labeled=labeled,
    )
    algo = exp.algorithm
    lay = algo.layout()

    def part(k, prefix):  # what client k held (the server's S2C record) plus the delta it sent
        held = algo.views[k]
        sent = replies[k].weights
        return {n: held[prefix + n] + densify(sent[prefix + n], lay.shapes[n]) for n in lay.params}

    counts = [replies[k].num_samples for k in start.chosen]
    assert counts == [u + n for u, n in zip(UNLABELED, labeled)]
    psis = [part(k, PSI) for k in start.chosen]
    thr = algo.setting("psi_threshold")
    paper = {n: hard_threshold(t.float(), thr) for n, t in average(psis, [1, 1, 1], lay.params).items()}
    other = {n: hard_threshold(t.float(), thr) for n, t in average(psis, counts, lay.params).items()}
    pinned(algo.psi, paper, other, lay.params)
    if scenario == "client":
        sigmas = [part(k, SIGMA) for k in start.chosen]
        pinned(algo.sigma, average(sigmas, [1, 1, 1], lay.params), average(sigmas, counts, lay.params), lay.params)


# ---- FedSiam ---------------------------------------------------------------------------------------
@pytest.mark.parametrize("variant", ["mt", "pi"])
def test_fedsiam_eq2_weights_each_client_by_all_of_its_data(small_config, variant):
    exp, start, data, replies = uneven_round(
        small_config,
        ["ssfl_args.algorithm=fedsiam", f"ssfl_args.variant={variant}", *LABELS_AT_CLIENT],
        labeled=(20, 4, 10),
    )
    algo = exp.algorithm
    keys = list(algo.global_state)
    n = [data[k].num_labeled + data[k].num_unlabeled for k in start.chosen]  # n^(b): all the data on client b
    assert [replies[k].num_samples for k in start.chosen] == n
    targets = [replies[k].weights for k in start.chosen]
    # MT uploads every online layer; Pi's online net is its target (alpha = 0), which it sends alone
    onlines = [
        {key: replies[k].weights.get(ONLINE_PREFIX + key, replies[k].weights[key]) for key in keys}
        for k in start.chosen
    ]
    assert all(ONLINE_PREFIX + key in replies[k].weights for k in start.chosen for key in keys) == (variant == "mt")
    pinned(algo.agg_target, average(targets, n, keys), average(targets, [1, 1, 1], keys), keys)
    pinned(algo.agg_online, average(onlines, n, keys), average(onlines, UNLABELED, keys), keys)
    assert gap(algo.global_state, algo.agg_online, keys) == 0  # labels-at-client: the server only aggregates


# ---- FedSEAL ---------------------------------------------------------------------------------------
def test_fedseal_eq2_is_the_uniform_mean_of_the_clients_the_server_not_counted(small_config):
    exp, start, data, replies = uneven_round(
        small_config,
        [
            "ssfl_args.algorithm=fedseal",
            "data_args.num_server_val=20",
            "ssfl_args.fixed_threshold=0",  # every sample is positive: every client trains
            "ssfl_args.bootstrap_steps=0",
            "ssfl_args.server_steps=1",
        ],
    )
    algo, keys = exp.algorithm, params(exp.algorithm)
    models = [replies[k].weights for k in start.chosen]
    pinned(algo.base_state, average(models, [1, 1, 1], keys), average(models, UNLABELED, keys), keys)


# ---- SemiFL ----------------------------------------------------------------------------------------
def test_semifl_averages_the_clients_uniformly(small_config):
    exp, start, data, replies = uneven_round(
        small_config,
        [
            "ssfl_args.algorithm=semifl",
            "ssfl_args.threshold=0",
            "ssfl_args.local_epochs=null",
            "ssfl_args.server_steps=1",
            "ssfl_args.server_momentum=0",  # the paper's plain average (the first momentum step is one anyway)
        ],
    )
    algo, keys = exp.algorithm, params(exp.algorithm)
    models = [replies[k].weights for k in start.chosen]
    pinned(algo.base_state, average(models, [1, 1, 1], keys), average(models, UNLABELED, keys), keys)


# ---- FedAvg / FedProx x FixMatch / UDA ---------------------------------------------------------------
BASELINES = ["fedavg_fixmatch", "fedprox_fixmatch", "fedavg_uda", "fedprox_uda"]


@pytest.mark.parametrize("name", BASELINES)
def test_baselines_weight_each_client_by_the_samples_it_trained_on(small_config, name):
    exp, start, data, replies = uneven_round(
        small_config, [f"ssfl_args.algorithm={name}", "ssfl_args.threshold=0", *LABELS_AT_CLIENT], labeled=(20, 4, 10)
    )
    algo, keys = exp.algorithm, params(exp.algorithm)
    n = [data[k].num_labeled + data[k].num_unlabeled for k in start.chosen]
    models = [replies[k].weights for k in start.chosen]
    pinned(algo.global_state, average(models, n, keys), average(models, [1, 1, 1], keys), keys)
    assert gap(average(models, n, keys), average(models, UNLABELED, keys), keys) > 100 * TOL


@pytest.mark.parametrize("protocol", ["sequential", "parallel"])
def test_baselines_labels_at_server_average_by_samples_or_with_the_server_as_one_model(small_config, protocol):
    exp, start, data, replies = uneven_round(
        small_config,
        ["ssfl_args.algorithm=fedavg_uda", "ssfl_args.threshold=0", f"ssfl_args.server_protocol={protocol}"],
    )
    algo, keys = exp.algorithm, params(exp.algorithm)
    models = [replies[k].weights for k in start.chosen]
    if protocol == "sequential":  # FedMatch Algorithm 2: the clients alone, FedAvg's n_k / n
        pinned(algo.global_state, average(models, UNLABELED, keys), average(models, [1, 1, 1], keys), keys)
    else:  # Zhang et al. Eq. 5: the server one model among C_k + 1, uniform
        models = [algo._server_state, *models]
        n_s = algo.server_data.labeled_idx.numel()
        pinned(algo.global_state, average(models, [1] * 4, keys), average(models, [n_s, *UNLABELED], keys), keys)


# ---- fedavg_sl ---------------------------------------------------------------------------------------
def test_fedavg_sl_is_eq5_with_the_server_and_fedavg_by_samples_without(small_config):
    exp, start, data, replies = uneven_round(small_config, ["ssfl_args.algorithm=fedavg_sl"])
    algo, keys = exp.algorithm, params(exp.algorithm)
    models = [algo._server_state, *(replies[k].weights for k in start.chosen)]
    pinned(
        algo.global_state,
        average(models, [1] * 4, keys),
        average(models, [algo.server_data.labeled_idx.numel(), *UNLABELED], keys),
        keys,
    )

    exp, start, data, replies = uneven_round(
        small_config,
        ["ssfl_args.algorithm=fedavg_sl", "ssfl_args.include_server=false", *LABELS_AT_CLIENT],
        labeled=(20, 4, 10),
    )
    algo = exp.algorithm
    n = [data[k].num_labeled + data[k].num_unlabeled for k in start.chosen]  # it trains on all of them
    assert [replies[k].num_samples for k in start.chosen] == n
    models = [replies[k].weights for k in start.chosen]
    pinned(algo.global_state, average(models, n, keys), average(models, [1, 1, 1], keys), keys)


# ---- the local baselines -------------------------------------------------------------------------------
@pytest.mark.parametrize("name", ["local_sl", "local_fixmatch", "local_uda"])
def test_local_baselines_single_model_is_the_client_with_the_most_samples(small_config, name):
    exp, start, data, replies = uneven_round(
        small_config, [f"ssfl_args.algorithm={name}", *LABELS_AT_CLIENT], unlabeled=(90, 200, 30), labeled=(4, 10, 20)
    )
    algo, keys = exp.algorithm, params(exp.algorithm)
    largest = start.chosen[1]  # 210 samples, not the first client and not the one with most labels
    assert [replies[k].num_samples for k in start.chosen] == [94, 210, 50]
    state = algo.global_model().state_dict()
    assert gap(state, replies[largest].extras["eval_weights"], keys) == 0
    assert all(gap(state, replies[k].extras["eval_weights"], keys) > 100 * TOL for k in start.chosen if k != largest)
    assert gap(algo.state_dict()["global_state"], state, keys) == 0  # what `fedml-ssfl export` ships
