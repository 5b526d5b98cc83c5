"""Local epochs (``train_args.epochs``): E passes over each client's own data, in every runtime.

Each client k takes T_k = E x ceil(n_k / B_k) steps a round, n_k and B_k from the data it holds
(the algorithm's rule, ``Algorithm.epoch_data``); the server's own T is E passes over its labels.
Counted here through the real path (torch's SGD steps one after another, the stacked trainer's
steps), stacked equal to one after another with unequal T_k, per-algorithm rules, and a deployment
(each silo knowing only its own size) ending with the simulator's model. Tiny sizes.
"""

from __future__ import annotations

import math

import pytest
import torch

from fedml_ssfl import stacked
from fedml_ssfl.algorithms.base import ClientContext, ClientData
from fedml_ssfl.config import ConfigError, validate
from fedml_ssfl.experiment import build_experiment, resolve_local_steps
from fedml_ssfl.runtime.local import run_round

B = 8


def _epochs_experiment(small_config, *overrides: str):
    exp = build_experiment(small_config("train_args.epochs=2", f"train_args.batch_size={B}", *overrides))
    exp.algorithm.setup()
    return exp


def _client(exp, client_id: int, labeled: int, unlabeled: int = 0, offset: int = 0) -> ClientData:
    """Client ``client_id`` holding ``labeled`` labeled and ``unlabeled`` unlabeled training samples."""
    ds = exp.dataset
    idx = torch.arange(offset, offset + labeled + unlabeled)
    return ClientData(
        client_id=client_id,
        images=ds.train_images,
        labels=ds.train_labels,
        unlabeled_idx=idx[labeled:],
        labeled_idx=idx[:labeled],
        num_classes=ds.num_classes,
    )


def _ctx(exp, round_idx: int = 0) -> ClientContext:
    return ClientContext(round_idx=round_idx, device=exp.device, seed=exp.config.common_args.random_seed)


def test_each_client_takes_e_passes_over_its_own_data_one_after_another(small_config, monkeypatch) -> None:
    """E = 2, B = 8: a client of 3B samples takes 6 optimiser steps, one of B + 1 takes 4."""
    exp = _epochs_experiment(small_config, "ssfl_args.algorithm=fedavg_sl")
    algo, steps = exp.algorithm, []
    real_step = torch.optim.SGD.step

    def counting(self, *args, **kwargs):
        steps[-1] += 1
        return real_step(self, *args, **kwargs)

    monkeypatch.setattr(torch.optim.SGD, "step", counting)
    for k, n in ((0, 3 * B), (1, B + 1)):
        steps.append(0)
        msg = algo.message_for(k, 0)
        reply = algo.run_client_update(msg, _client(exp, k, n, offset=100 * k), {}, _ctx(exp))
        assert not reply.is_empty
    assert steps == [6, 4]
    assert algo.train.local_steps == resolve_local_steps(exp.config, 50) == 2 * math.ceil(50 / B)  # the server's
    # the fixed-steps option: every client takes train_args.local_steps (3), whatever its size
    fixed = build_experiment(small_config(f"train_args.batch_size={B}", "ssfl_args.algorithm=fedavg_sl"))
    fixed.algorithm.setup()
    for k, n in ((0, 3 * B), (1, B + 1)):
        steps.append(0)
        fixed.algorithm.run_client_update(fixed.algorithm.message_for(k, 0), _client(exp, k, n), {}, _ctx(exp))
    assert steps[2:] == [3, 3]


def test_stacked_clients_of_unequal_steps_train_as_alone(small_config, monkeypatch) -> None:
    """Stacked clients with different T_k are stacked by T_k, each group under its own settings (its
    steps and Eq. 9's position): the replies equal one after another."""
    exp = _epochs_experiment(small_config, "ssfl_args.algorithm=fedavg_sl", "train_args.stack_clients=true")
    algo = exp.algorithm
    sizes = {0: 3 * B, 1: B + 1, 2: 3 * B - 2}  # T_k = 6, 4, 6
    work = {k: (algo.message_for(k, 1), _client(exp, k, n, offset=90 * k), {}) for k, n in sizes.items()}
    stacks: list[tuple[int, int]] = []  # (clients in the stack, its steps), once per stacked SGD step
    real_update = stacked.sgd_update

    def counting(params, *args, **kwargs):
        stacks.append(next(iter(params.values())).shape[0])
        return real_update(params, *args, **kwargs)

    monkeypatch.setattr(stacked, "sgd_update", counting)
    together = algo.run_client_updates_stacked(work, _ctx(exp, 1))
    assert list(together) == [0, 1, 2]
    assert sorted(stacks) == [1] * 4 + [2] * 6  # clients 0 and 2 stacked for 6 steps, client 1 alone for 4
    for k, (msg, data, _state) in work.items():
        alone = algo.run_client_update(msg, data, {}, _ctx(exp, 1))
        for name, w in alone.weights.items():
            assert float((w - together[k].weights[name]).abs().max()) <= 1e-4, (k, name)
    assert float((together[0].weights["fc.weight"] - together[1].weights["fc.weight"]).abs().max()) > 1e-3


@pytest.mark.parametrize(
    ("overrides", "labeled", "unlabeled", "per_epoch"),
    [
        # default (FedAvg-SL): every sample it holds, at B
        (["ssfl_args.algorithm=fedavg_sl"], 5, 12, math.ceil(17 / B)),
        # Zhang et al.'s clients: the unlabeled set at B
        (["ssfl_args.algorithm=fedavg_ssl"], 0, 25, math.ceil(25 / B)),
        # FixMatch / UDA baselines: the unlabeled set at B^U
        (["ssfl_args.algorithm=fedavg_fixmatch", "ssfl_args.unlabeled_batch_size=12"], 0, 25, 3),
        (
            [
                "ssfl_args.algorithm=local_uda",
                "data_args.label_scenario=client",
                "data_args.num_server_labels=0",
                "ssfl_args.unlabeled_batch_size=12",
            ],
            5,
            25,
            3,
        ),
        # FedMatch: the unlabeled set at B^U
        (["ssfl_args.algorithm=fedmatch", "ssfl_args.unlabeled_batch_size=12"], 0, 25, 3),
        # SemiFL (local_epochs: null), FedSEAL, FedSiam: the unlabeled set at B
        (["ssfl_args.algorithm=semifl", "ssfl_args.local_epochs=null"], 0, 25, math.ceil(25 / B)),
        (["ssfl_args.algorithm=fedseal", "ssfl_args.fixed_threshold=0.5"], 0, 25, math.ceil(25 / B)),
        (["ssfl_args.algorithm=fedsiam"], 0, 25, math.ceil(25 / B)),
    ],
)
def test_each_algorithm_counts_its_epoch_over_its_own_set(small_config, overrides, labeled, unlabeled, per_epoch):
    exp = _epochs_experiment(small_config, *overrides)
    data = _client(exp, 0, labeled, unlabeled)
    assert exp.algorithm.client_train(data).local_steps == 2 * per_epoch
    with exp.algorithm.client_settings(data) as own:
        assert exp.algorithm.train is own and own.local_steps == 2 * per_epoch
    assert exp.algorithm.train.local_steps == resolve_local_steps(exp.config, int(exp.split.server_labeled.numel()))


def test_a_round_in_the_simulator_runs_each_client_its_own_steps(small_config, monkeypatch) -> None:
    """A real split (Dirichlet: clients of unequal size): the round's SGD steps are the clients' own T_k."""
    exp = _epochs_experiment(
        small_config,
        "ssfl_args.algorithm=fedavg_sl",
        "data_args.partition_method=dirichlet",
        "data_args.partition_alpha=0.3",
        "train_args.batch_size=64",
    )
    algo = exp.algorithm
    own = {k: algo.client_train(exp.client_data(k, 0)).local_steps for k in range(4)}
    assert len(set(own.values())) > 1, own  # the split's clients differ in size
    counted: list[int] = []
    real_step = torch.optim.SGD.step

    def counting(self, *args, **kwargs):
        counted.append(1)
        return real_step(self, *args, **kwargs)

    monkeypatch.setattr(torch.optim.SGD, "step", counting)
    server_steps = algo.train.local_steps  # fedavg_sl's server trains T on its labels
    run_round(exp, 0, {k: {} for k in range(4)})
    assert len(counted) == sum(own.values()) + server_steps


def test_epochs_are_accepted_in_deployment_mode_and_negative_refused() -> None:
    raw = {
        "comm_args": {"mode": "deployment", "backend": "MPI"},
        "common_args": {"training_type": "cross_silo"},
        "train_args": {"epochs": 1, "client_num_in_total": 2, "client_num_per_round": 2},
        "data_args": {"local_data": "s_{silo}.npz", "server_data": "s.npz", "test_data": "t.npz"},
    }
    assert validate(raw).train_args.epochs == 1
    with pytest.raises(ConfigError, match=r"train_args\.epochs: -1 is out of range"):
        validate({"train_args": {"epochs": -1}})


def test_a_streaming_client_counts_what_it_holds_that_round(small_config) -> None:
    """streaming_noniid: a client's epoch is over the stages released by the round (its data then)."""
    exp = _epochs_experiment(
        small_config,
        "data_args.partition_method=streaming_noniid",
        "data_args.num_stages=3",
        "data_args.rounds_per_stage=2",
        "train_args.comm_round=6",
    )
    for k in range(4):
        held = [exp.client_data(k, r).num_unlabeled for r in range(6)]
        steps = [exp.algorithm.client_train(exp.client_data(k, r)).local_steps for r in range(6)]
        assert steps == [2 * math.ceil(n / B) for n in held]
        assert steps[0] < steps[5], (held, steps)


def test_fedsiam_ramp_counts_the_e_epochs_of_train_args_epochs(small_config) -> None:
    """FedSiam with ``local_epochs: null``: the authors' ramp counter sees E epochs of ceil(n / B) steps."""
    exp = _epochs_experiment(small_config, "ssfl_args.algorithm=fedsiam")
    data = _client(exp, 0, 0, 25)
    with exp.algorithm.client_settings(data):
        assert exp.algorithm.local_epochs(data) == (2, math.ceil(25 / B))
    fixed = build_experiment(small_config("ssfl_args.algorithm=fedsiam"))  # epochs 0: a round is one epoch of T
    assert fixed.algorithm.local_epochs(data) == (1, 3)
