"""The idle-client control (``train_args.idle_clients``): every sampled client sends back the model it
received, for every algorithm with a server side, while the server's path is the trained run's.

Per algorithm: the round's messages do not depend on the switch (the server step never sees it); each
idle reply is what the client was sent, in the algorithm's own message format (dense weights,
FedMatch's zero sigma / psi deltas, FedSiam's target and uploaded online layers); the client's state is
left alone (FedMatch keeps only the S2C record it must share with the server); and after aggregation
the clients' part of the server's model is the model it sent. The switch is refused, naming the key,
where it means nothing.
"""

from __future__ import annotations

import pytest
import torch

from fedml_ssfl.algorithms.base import ClientContext
from fedml_ssfl.algorithms.fedmatch import PSI, SIGMA
from fedml_ssfl.algorithms.fedsiam import ONLINE_PREFIX
from fedml_ssfl.config import ConfigError
from fedml_ssfl.experiment import build_experiment
from fedml_ssfl.runtime.common import finish_round, start_round
from fedml_ssfl.sparse import densify

CASES = {
    "fedavg_ssl": ["ssfl_args.algorithm=fedavg_ssl"],
    "fedavg_ssl-grouping": ["ssfl_args.algorithm=fedavg_ssl", "ssfl_args.averaging=grouping"],
    "fedavg_sl": ["ssfl_args.algorithm=fedavg_sl"],
    "semifl": [
        "ssfl_args.algorithm=semifl",
        "model_args.norm=bn",
        "ssfl_args.server_steps=2",
        "ssfl_args.local_epochs=null",
        "ssfl_args.threshold=0.1",
    ],
    "fedseal": [
        "ssfl_args.algorithm=fedseal",
        "data_args.num_server_val=50",
        "ssfl_args.bootstrap_steps=2",
        "ssfl_args.server_steps=2",
        "train_args.client_num_per_round=2",
    ],
    "fedmatch": ["ssfl_args.algorithm=fedmatch"],
    "fedmatch-client": [
        "ssfl_args.algorithm=fedmatch",
        "data_args.label_scenario=client",
        "data_args.num_server_labels=0",
        "data_args.labels_per_class_client=2",
    ],
    "fedsiam-mt": ["ssfl_args.algorithm=fedsiam"],
    "fedsiam-d-client": [
        "ssfl_args.algorithm=fedsiam",
        "data_args.label_scenario=client",
        "data_args.num_server_labels=0",
        "data_args.labels_per_class_client=2",
    ],
    "fedavg_fixmatch": ["ssfl_args.algorithm=fedavg_fixmatch"],
    "fedprox_fixmatch": ["ssfl_args.algorithm=fedprox_fixmatch"],
    "fedavg_uda": ["ssfl_args.algorithm=fedavg_uda"],
    "fedprox_uda": ["ssfl_args.algorithm=fedprox_uda", "ssfl_args.server_protocol=parallel"],
}


def _round_zero(small_config, case, idle):
    exp = build_experiment(small_config(*CASES[case], f"train_args.idle_clients={str(idle).lower()}"))
    exp.algorithm.setup()
    return exp, start_round(exp, 0)


def _same(a, b):
    a = a.to_dense() if a.is_sparse else a
    b = b.to_dense() if b.is_sparse else b
    return a.shape == b.shape and torch.equal(a, b)


def _assert_received(algo, k, msg, reply, state):
    """The idle reply is the model the client was sent, in the algorithm's own format."""
    name = algo.name
    if name == "fedmatch":
        lay = algo.layout()
        assert reply.weights and all(
            float(densify(t, lay.shapes[key.split("/", 1)[1]]).abs().max()) == 0.0
            for key, t in reply.weights.items()
            if key.startswith((SIGMA, PSI))
        ), "every sigma / psi delta is zero"
        assert any(key.startswith(PSI) for key in reply.weights)
        assert all(_same(reply.weights[b], msg.weights[b]) for b in lay.buffers)
        # the client's held copy is exactly the server's record of what it sent
        assert set(state) == {"view"} and all(
            torch.equal(state["view"][key], algo.views[k][key]) for key in state["view"]
        )
        return
    assert state == {}, "an idle client leaves its state alone"
    if name == "fedsiam":
        target = {key: v for key, v in msg.weights.items() if not key.startswith(ONLINE_PREFIX)}
        assert all(_same(reply.weights[key], v) for key, v in target.items())
        online = [key for key in reply.weights if key.startswith(ONLINE_PREFIX)]
        assert all(_same(reply.weights[key], msg.weights[key]) for key in online)
        return
    assert reply.weights.keys() == msg.weights.keys()
    assert all(_same(reply.weights[key], msg.weights[key]) for key in msg.weights)


def _assert_clients_part_is_what_was_sent(algo, sent, before, chosen):
    """After aggregating idle replies, the clients' contribution to the server's model is ``sent``."""
    name = algo.name

    def close(a, b, atol=1e-6):
        keys = [key for key in b if b[key].is_floating_point()]
        assert keys and all(torch.allclose(a[key].float(), b[key].float(), atol=atol) for key in keys)

    if name in ("fedavg_ssl", "fedavg_sl"):  # Eq. 5: the server as one model beside C_k copies of what it sent
        server, n = algo._server_state, len(chosen)
        params = [key for key, _ in algo.model_fn().named_parameters()]
        if name == "fedavg_ssl" and algo.config.averaging == "grouping":  # Eq. 7: two groups of two clients
            n = 2
            for g in algo.group_states.values():
                close(g, {key: (server[key] + n * sent[key]) / (n + 1) for key in params})
        close(algo.global_state, {key: (server[key] + n * sent[key]) / (n + 1) for key in params})
    elif name == "semifl":
        close(algo.base_state, sent)  # the server momentum step of a zero pseudo-gradient
    elif name == "fedseal":
        close(algo.base_state, sent)
    elif name == "fedsiam":
        close(algo.agg_target, before["global_target"])
        close(algo.agg_online, sent)
    elif name == "fedmatch":
        thr = algo.setting("s2c_threshold") + algo.setting("psi_threshold")
        close(algo.psi, before["psi"], atol=thr)  # what the clients held: the sent psi within the S2C threshold
        if algo.scenario == "client":
            close(algo.sigma, before["sigma"], atol=thr)
        else:
            assert all(torch.equal(algo.sigma[key], before["sigma"][key]) for key in before["sigma"])
    else:  # FedAvg / FedProx x FixMatch / UDA: the clients' average, the server's model when parallel
        if algo.config.server_protocol == "parallel":
            params = [key for key, _ in algo.model_fn().named_parameters()]
            n = len(chosen)
            close(algo.global_state, {key: (algo._server_state[key] + n * sent[key]) / (n + 1) for key in params})
        else:
            close(algo.global_state, sent)


@pytest.mark.parametrize("case", list(CASES))
def test_idle_clients_send_back_what_they_received_and_the_server_path_is_the_trained_runs(small_config, case):
    trained_exp, trained = _round_zero(small_config, case, idle=False)
    exp, start = _round_zero(small_config, case, idle=True)
    algo = exp.algorithm
    # the server's step and messages do not see the switch
    assert start.chosen == trained.chosen and start.messages.keys() == trained.messages.keys()
    for k, msg in start.messages.items():
        other = trained.messages[k]
        assert msg.weights.keys() == other.weights.keys()
        assert all(_same(msg.weights[key], other.weights[key]) for key in msg.weights), k
    sent = {key: v.clone() for key, v in algo.global_state.items()}
    before = {
        name: {key: v.clone() for key, v in getattr(algo, name).items()}
        for name in ("global_target", "psi", "sigma")
        if hasattr(algo, name)
    }
    ctx = ClientContext(round_idx=0, device=exp.device, seed=0)
    replies, states = {}, {}
    for k in start.chosen:
        states[k] = {}
        replies[k] = algo.run_client_update(start.messages[k], exp.client_data(k, 0), states[k], ctx)
        _assert_received(algo, k, start.messages[k], replies[k], states[k])
    # a trained client does change something: the control is not what training gives
    k0 = start.chosen[0]
    trained_reply = trained_exp.algorithm.run_client_update(trained.messages[k0], exp.client_data(k0, 0), {}, ctx)
    assert not all(_same(trained_reply.weights[key], replies[k0].weights[key]) for key in replies[k0].weights)
    finish_round(exp, start, replies, 0)
    _assert_clients_part_is_what_was_sent(algo, sent, before, start.chosen)


def test_idle_clients_do_not_receive_the_broadcast_but_it_is_still_counted(small_config):
    """FedSEAL broadcasts every round's model to every client (Algorithm 1 step 2); idle clients do no
    work, so the clients not sampled fold nothing in, while the messages are built and counted."""
    from fedml_ssfl.runtime.local import run_round

    for idle in (False, True):
        cfg = small_config(*CASES["fedseal"], f"train_args.idle_clients={str(idle).lower()}")
        exp = build_experiment(cfg)
        exp.algorithm.setup()
        states = {k: {} for k in range(4)}
        row = run_round(exp, 0, states)
        assert row["bytes_down"] == start_round_bytes(exp)
        folded = sorted(k for k, s in states.items() if "ensemble" in s)
        assert folded == ([] if idle else [0, 1, 2, 3])


def start_round_bytes(exp):
    """The bytes of K messages of round 1 (the model and the thresholds each)."""
    from fedml_ssfl.algorithms.base import message_nbytes

    return 4 * message_nbytes(exp.algorithm.message_for(0, 0))


@pytest.mark.parametrize("algorithm", ["server_only", "local_fixmatch"])
def test_the_switch_is_refused_where_it_means_nothing(small_config, algorithm):
    extra = (
        ["data_args.label_scenario=client", "data_args.num_server_labels=0"] if algorithm.startswith("local") else []
    )
    with pytest.raises(ConfigError, match=r"train_args\.idle_clients: algorithm '" + algorithm):
        small_config(f"ssfl_args.algorithm={algorithm}", *extra, "train_args.idle_clients=true")
