"""Participation as data (issue 36): the simulator's availability model, over-selection, the minimum of
clients, participation.jsonl (resume-exact), its replay, and what a client that misses rounds keeps.

Expected values are computed here from the documented draws (``derive_seed`` of (seed, "availability",
round, client) and (seed, "finish", round, client)) and from the papers' formulas, never with the
function under test.
"""

from __future__ import annotations

import copy
import json

import pytest
import torch

from fedml_ssfl import seeding
from fedml_ssfl.algorithms.base import ClientContext
from fedml_ssfl.algorithms.registry import available_algorithms
from fedml_ssfl.checkpoint import load_checkpoint
from fedml_ssfl.config import ConfigError
from fedml_ssfl.experiment import build_experiment
from fedml_ssfl.participation import Participation, Planner, available_clients, plan_round, read_trace
from fedml_ssfl.runtime.common import finish_round, start_round
from fedml_ssfl.runtime.local import run_local, run_round
from tests.conftest import assert_same_state, resume_matches_uninterrupted
from tests.test_idle_clients import CASES as IDLE_CASES
from tests.test_weighting import LABELS_AT_CLIENT, average, gap, params, pinned

CPU = torch.device("cpu")


def draw(seed, *parts):
    """The documented uniform draw: derive_seed / 2**63."""
    return seeding.derive_seed(seed, *parts) / 2**63


def lines(run_dir):
    return [json.loads(x) for x in (run_dir / "participation.jsonl").read_text().splitlines()]


# ---- the draws ---------------------------------------------------------------------------------------
def test_availability_is_a_seeded_draw_per_round_and_client():
    probs = [1.0, 0.0, 0.8, 0.8, 0.3]
    seen = [available_clients(7, r, probs) for r in range(200)]
    assert seen == [available_clients(7, r, probs) for r in range(200)]  # a pure function
    for r, got in enumerate(seen):
        assert got == {k for k, p in enumerate(probs) if draw(7, "availability", r, k) < p}
    assert all(0 in s and 1 not in s for s in seen)
    rate = sum(2 in s for s in seen) / len(seen)
    assert 0.7 < rate < 0.9
    assert seen != [available_clients(8, r, probs) for r in range(200)]  # the seed matters


def test_over_selection_keeps_the_first_ck_replies_by_the_seeded_finish_time():
    differs = 0
    for r in range(20):
        reach = {k for k in range(10) if draw(3, "availability", r, k) < 0.7}
        plan = plan_round(3, r, 10, 3, available=reach, over_selection=1.0)
        assert len(plan.asked) == 6 and plan.asked == sorted(plan.asked)
        assert plan.answered == [k for k in plan.asked if k in reach]
        by_time = sorted(plan.answered, key=lambda k: draw(3, "finish", r, k))
        assert plan.aggregated == sorted(by_time[:3])  # aggregated in client order
        differs += plan.aggregated != plan.answered[:3]
    assert differs, "the finish order never differed from the id order: the test could not fail"
    # no over-selection, everyone reachable: the runtimes' sampler as it always was
    plain = plan_round(3, 4, 10, 3)
    assert plain.asked == plain.answered == plain.aggregated and len(plain.asked) == 3


def test_a_round_with_fewer_replies_than_min_clients_is_skipped():
    asked = plan_round(5, 0, 6, 4).asked
    reach = set(asked[:2])
    kept = plan_round(5, 0, 6, 4, available=reach, min_clients=2)
    assert not kept.skipped and kept.aggregated == sorted(reach)
    skipped = plan_round(5, 0, 6, 4, available=reach, min_clients=3)
    assert skipped.skipped and skipped.answered == [] and skipped.aggregated == []


def test_the_broadcast_reaches_only_reachable_clients_not_asked():
    plan = plan_round(1, 2, 8, 3, available={0, 1, 2, 3, 4}, broadcast=True)
    assert plan.listeners == sorted({0, 1, 2, 3, 4} - set(plan.asked))
    assert set(range(5, 8)) - set(plan.asked), "every unreachable client was asked: the test could not fail"
    assert plan_round(1, 2, 8, 3, broadcast=False).listeners == []


def test_trace_and_participation_files_are_checked_naming_the_key_and_line(tmp_path):
    trace = tmp_path / "trace.jsonl"
    trace.write_text('{"round": 1, "available": [0, 2]}\n{"round": 2, "available": []}\n')
    assert read_trace(trace, 4) == [{0, 2}, set()]
    trace.write_text('{"round": 1, "available": [0, 9]}\n')
    with pytest.raises(ConfigError, match=r"train_args.availability_trace: .* line 1: 'available'"):
        read_trace(trace, 4)
    trace.write_text('{"round": 2, "available": [0]}\n')
    with pytest.raises(ConfigError, match="line 1: expected"):
        read_trace(trace, 4)
    bad = {"round": 1, "asked": [0], "answered": [0, 1], "aggregated": []}
    with pytest.raises(ConfigError, match="'answered' names clients that were not asked"):
        Participation.from_json(bad, "here", 4)
    short = Planner(0, 4, 2, replay={0: Participation(0, [0, 1], [0, 1], [0, 1])}, replay_source="p.jsonl")
    assert short.plan(0).aggregated == [0, 1]
    with pytest.raises(ConfigError, match="train_args.replay_participation: p.jsonl has no line for round 2"):
        short.plan(1)


def test_a_missing_replay_file_is_refused_naming_the_key_and_leaves_no_folder(small_config, tmp_path):
    cfg = small_config(f"train_args.replay_participation={tmp_path / 'nowhere.jsonl'}")
    with pytest.raises(ConfigError, match=r"train_args.replay_participation: cannot read .*nowhere.jsonl"):
        run_local(cfg, run_dir=tmp_path / "run")
    assert not (tmp_path / "run").exists()


def test_participation_keys_are_checked(small_config):
    with pytest.raises(ConfigError, match=r"train_args.availability: .* one per client"):
        small_config("train_args.availability=[0.5, 0.5]")
    with pytest.raises(ConfigError, match="train_args.min_clients"):
        small_config("train_args.min_clients=5")
    with pytest.raises(ConfigError, match="train_args.replay_participation"):
        small_config("train_args.replay_participation=x.jsonl", "train_args.availability=0.5")
    with pytest.raises(ConfigError, match="train_args.over_selection: only the local simulator"):
        small_config("comm_args.backend=MPI", "common_args.training_type=cross_silo", "train_args.over_selection=0.5")


# ---- whole runs --------------------------------------------------------------------------------------
def test_an_unreliable_run_is_reproducible_resume_exact_and_replays_to_the_same_model(small_config, tmp_path):
    cfg = small_config(
        "train_args.comm_round=4",
        "train_args.client_num_per_round=2",
        "train_args.availability=[0.9, 0.5, 0.7, 0.6]",
        "train_args.over_selection=0.5",
        "train_args.local_steps=2",
    )
    resume_matches_uninterrupted(cfg, tmp_path)
    full, part = tmp_path / "full", tmp_path / "part"
    assert (full / "participation.jsonl").read_text() == (part / "participation.jsonl").read_text()
    rec = lines(full)
    assert [x["round"] for x in rec] == [1, 2, 3, 4]
    for x in rec:
        r = x["round"] - 1
        reach = {k for k, p in enumerate([0.9, 0.5, 0.7, 0.6]) if draw(0, "availability", r, k) < p}
        assert len(x["asked"]) == 3 and x["answered"] == [k for k in x["asked"] if k in reach]
        assert len(x["aggregated"]) == min(2, len(x["answered"]))
    assert any(x["answered"] != x["asked"] for x in rec) and any(len(x["answered"]) == 3 for x in rec)
    rows = [json.loads(x) for x in (full / "metrics.jsonl").read_text().splitlines()]
    assert [row["clients"] for row in rows] == [len(x["aggregated"]) for x in rec]

    replay = small_config(
        "train_args.comm_round=4",
        "train_args.client_num_per_round=2",
        f"train_args.replay_participation={full / 'participation.jsonl'}",
        "train_args.local_steps=2",
    )
    run_local(replay, run_dir=tmp_path / "replay")
    a = load_checkpoint(full / "checkpoints" / "last.pt")
    b = load_checkpoint(tmp_path / "replay" / "checkpoints" / "last.pt")
    assert_same_state(a["algorithm"], b["algorithm"], "algorithm")
    assert_same_state(a["client_states"], b["client_states"], "client_states")
    assert lines(tmp_path / "replay") == rec


def test_a_resumed_run_keeps_each_earlier_line_once(small_config, tmp_path):
    cfg = small_config("train_args.comm_round=3", "train_args.local_steps=1", "tracking_args.checkpoint_every=2")
    run_local(cfg, run_dir=tmp_path / "run", stop_after=2)
    path = tmp_path / "run" / "participation.jsonl"
    # a session killed after round 3's line but before its checkpoint left one line too many
    path.write_text(path.read_text() + '{"round": 3, "asked": [9]}\n')
    run_local(cfg, run_dir=tmp_path / "run", resume=True)
    rec = lines(tmp_path / "run")
    assert [x["round"] for x in rec] == [1, 2, 3] and rec[2]["asked"] == [0, 1, 2, 3]


def test_a_round_without_enough_clients_is_skipped_and_the_model_kept(small_config, tmp_path):
    trace = tmp_path / "trace.jsonl"
    trace.write_text('{"round": 1, "available": [0, 1, 2, 3]}\n{"round": 2, "available": [1]}\n')
    cfg = small_config(f"train_args.availability_trace={trace}", "train_args.min_clients=2", "train_args.local_steps=1")
    run_local(cfg, run_dir=tmp_path / "run", stop_after=1)
    before = load_checkpoint(tmp_path / "run" / "checkpoints" / "last.pt")
    run_local(cfg, run_dir=tmp_path / "run", resume=True)
    after = load_checkpoint(tmp_path / "run" / "checkpoints" / "last.pt")
    assert_same_state(before["algorithm"], after["algorithm"], "algorithm")
    assert_same_state(before["client_states"], after["client_states"], "client_states")
    rec = lines(tmp_path / "run")
    assert rec[1]["skipped"] and rec[1]["aggregated"] == [] and not rec[0]["skipped"]
    rows = [json.loads(x) for x in (tmp_path / "run" / "metrics.jsonl").read_text().splitlines()]
    assert rows[1]["clients"] == 0 and rows[1]["bytes_down"] == 0


# ---- weighting over the replies that arrived -------------------------------------------------------------
UNEQUAL = (30, 90, 200)


def arrived_round(small_config, overrides, asked, arrived, unlabeled=UNEQUAL, total=5, labeled=None):
    """Round 0 with ``asked`` clients asked and only ``arrived`` answering, cut to unequal sizes."""
    import dataclasses

    exp = build_experiment(
        small_config(
            f"train_args.client_num_in_total={total}",
            f"train_args.client_num_per_round={len(asked)}",
            "train_args.local_steps=2",
            *overrides,
        )
    )
    algo = exp.algorithm
    algo.setup()
    plan = Participation(0, list(asked), list(arrived), list(arrived))
    start = start_round(exp, 0, Planner(0, total, len(asked), replay={0: plan}))
    assert start.chosen == list(arrived) and set(start.messages) == set(arrived)
    ctx = ClientContext(round_idx=0, device=CPU, seed=0)
    labeled = labeled or (0,) * len(arrived)
    data, replies = {}, {}
    for k, n_u, n_l in zip(arrived, unlabeled, labeled):
        full = exp.client_data(k, 0)
        data[k] = dataclasses.replace(full, unlabeled_idx=full.unlabeled_idx[:n_u], labeled_idx=full.labeled_idx[:n_l])
        replies[k] = algo.run_client_update(start.messages[k], data[k], {}, ctx)
    row = finish_round(exp, start, replies, 0)
    assert row["clients"] == len(arrived)
    return exp, start, data, replies


def test_eq5_counts_the_server_and_the_clients_that_arrived_not_those_asked(small_config):
    exp, start, data, replies = arrived_round(
        small_config, ["ssfl_args.algorithm=fedavg_ssl", "ssfl_args.threshold=0"], [0, 1, 2, 3], [0, 2, 3]
    )
    algo, keys = exp.algorithm, params(exp.algorithm)
    models = [algo._server_state, *(replies[k].weights for k in (0, 2, 3))]
    # (w_s + sum over the 3 that arrived) / (3 + 1); C_k + 1 = 5 would count a model that never came
    pinned(algo.global_state, average(models, [1, 1, 1, 1], keys), average(models, [2, 1, 1, 1], keys), keys)


def test_eq7_with_a_group_that_lost_members_and_a_group_left_empty(small_config):
    # K = 5, S = 2 fixed blocks k * S // K: {0, 1, 2} and {3, 4}; only 0 and 2 arrive
    exp, start, data, replies = arrived_round(
        small_config,
        ["ssfl_args.algorithm=fedavg_ssl", "ssfl_args.threshold=0", "ssfl_args.averaging=grouping"],
        [0, 2, 3, 4],
        [0, 2],
        unlabeled=(30, 200),
    )
    algo, keys = exp.algorithm, params(exp.algorithm)
    server = algo._server_state
    group0 = average([server, replies[0].weights, replies[2].weights], [1, 1, 1], keys)
    assert gap(algo.group_states[0], group0, keys) < 1e-6  # (w_s + w_0 + w_2) / (|G_0 arrived| + 1)
    assert 1 not in algo.group_states  # the empty group folds nothing and keeps what it had (none yet)
    # the global model: the mean of the groups that took part (the paper divides the users that
    # communicated into groups); counting the empty group as w_s would pull it towards the server
    pinned(algo.global_state, group0, average([group0, server], [1, 1], keys), keys)


@pytest.mark.parametrize("name", ["fedavg_fixmatch", "fedprox_uda"])
def test_baselines_weight_the_replies_that_arrived_by_their_samples(small_config, name):
    exp, start, data, replies = arrived_round(
        small_config,
        [f"ssfl_args.algorithm={name}", "ssfl_args.threshold=0", *LABELS_AT_CLIENT],
        [0, 1, 3, 4],
        [1, 3, 4],
        labeled=(20, 4, 10),
    )
    algo, keys = exp.algorithm, params(exp.algorithm)
    n = [data[k].num_labeled + data[k].num_unlabeled for k in (1, 3, 4)]
    models = [replies[k].weights for k in (1, 3, 4)]
    pinned(algo.global_state, average(models, n, keys), average(models, [1, 1, 1], keys), keys)


@pytest.mark.parametrize(
    "name, extra",
    [
        ("fedseal", ["data_args.num_server_val=20", "ssfl_args.fixed_threshold=0", "ssfl_args.bootstrap_steps=0"]),
        ("semifl", ["ssfl_args.threshold=0", "ssfl_args.local_epochs=null", "ssfl_args.server_momentum=0"]),
    ],
)
def test_uniform_papers_average_the_replies_that_arrived_uniformly(small_config, name, extra):
    exp, start, data, replies = arrived_round(
        small_config, [f"ssfl_args.algorithm={name}", "ssfl_args.server_steps=1", *extra], [0, 1, 2, 4], [0, 2, 4]
    )
    algo, keys = exp.algorithm, params(exp.algorithm)
    models = [replies[k].weights for k in (0, 2, 4)]
    pinned(algo.base_state, average(models, [1, 1, 1], keys), average(models, UNEQUAL, keys), keys)


def test_fedsiam_weights_the_replies_that_arrived_by_all_their_data(small_config):
    exp, start, data, replies = arrived_round(
        small_config,
        ["ssfl_args.algorithm=fedsiam", *LABELS_AT_CLIENT],
        [0, 1, 2, 3],
        [1, 2, 3],
        labeled=(20, 4, 10),
    )
    algo = exp.algorithm
    keys = list(algo.global_state)
    n = [data[k].num_labeled + data[k].num_unlabeled for k in (1, 2, 3)]  # n^(b): all the data on client b
    targets = [replies[k].weights for k in (1, 2, 3)]
    pinned(algo.agg_target, average(targets, n, keys), average(targets, [1, 1, 1], keys), keys)


@pytest.mark.parametrize("scenario", ["server", "client"])
def test_fedmatch_averages_the_replies_that_arrived_uniformly(small_config, scenario):
    from fedml_ssfl.algorithms.fedmatch import PSI

    extra = LABELS_AT_CLIENT if scenario == "client" else []
    labeled = (20, 4, 10) if scenario == "client" else None
    exp, start, data, replies = arrived_round(
        small_config, ["ssfl_args.algorithm=fedmatch", *extra], [0, 1, 2, 3], [0, 1, 3], labeled=labeled
    )
    algo = exp.algorithm
    lay = algo.layout()
    assert set(algo.client_psi) == {0, 1, 3} and 2 not in algo.views  # records only of those that took part
    # psi: the uniform mean of the arrived clients' psi (what each held plus its delta), hard-thresholded
    held = {k: {n: algo.client_psi[k][n] for n in lay.params} for k in (0, 1, 3)}
    from fedml_ssfl.sparse import densify, hard_threshold

    psis = [{n: densify(held[k][n], lay.shapes[n]) for n in lay.params} for k in (0, 1, 3)]
    paper = {
        n: hard_threshold(t, algo.setting("psi_threshold")) for n, t in average(psis, [1, 1, 1], lay.params).items()
    }
    assert gap(algo.psi, paper, lay.params) < 1e-6
    assert any(key.startswith(PSI) for key in replies[0].weights)


# ---- what a client that misses rounds keeps --------------------------------------------------------------
MISSED_CASES = {
    **IDLE_CASES,
    "fedseal": [  # every client ensembles: the broadcast is what an absent client must not get
        "ssfl_args.algorithm=fedseal",
        "data_args.num_server_val=50",
        "ssfl_args.bootstrap_steps=2",
        "ssfl_args.server_steps=2",
    ],
    "fedavg_ssl": ["ssfl_args.algorithm=fedavg_ssl", "ssfl_args.persistent_momentum=true"],
    "semifl": [*IDLE_CASES["semifl"], "ssfl_args.persistent_optimizer=true"],
    "fedmatch": ["ssfl_args.algorithm=fedmatch", "ssfl_args.helper_interval=1"],
    "local_sl": ["ssfl_args.algorithm=local_sl", *LABELS_AT_CLIENT],
    "local_fixmatch": ["ssfl_args.algorithm=local_fixmatch", *LABELS_AT_CLIENT],
    "local_uda": ["ssfl_args.algorithm=local_uda", *LABELS_AT_CLIENT],
    "server_only": ["ssfl_args.algorithm=server_only"],
}


def test_every_algorithm_has_a_missed_rounds_case():
    assert {v[0].split("=", 1)[1] for v in MISSED_CASES.values()} == set(available_algorithms())


# K = 4: client 0 trains in round 1, is asked but away in rounds 2-4 (no reply, no broadcast), and is back in
# round 5; client 3 joins late (round 4); client 2 listens to the broadcast whenever it is not asked.
SCHEDULE = [
    Participation(0, [0, 1], [0, 1], [0, 1], [2]),
    Participation(1, [0, 1], [1], [1], [2]),
    Participation(2, [0, 1], [1], [1], [2]),
    Participation(3, [0, 1, 3], [1, 3], [1, 3], [2]),
    Participation(4, [0, 1], [0, 1], [0, 1], [2, 3]),
]


@pytest.mark.parametrize("case", sorted(MISSED_CASES))
def test_a_client_away_for_rounds_keeps_its_state_untouched_and_a_late_one_starts_fresh(small_config, case):
    cfg = small_config(*MISSED_CASES[case], "train_args.local_steps=1", "train_args.client_num_per_round=2")
    exp = build_experiment(cfg)
    algo = exp.algorithm
    algo.setup()
    planner = Planner(0, 4, 2, replay={p.round_idx: p for p in SCHEDULE})
    states = {k: {} for k in range(4)}
    records = list(algo.client_records)
    run_round(exp, 0, states, planner)
    kept = copy.deepcopy(states[0])
    kept_records = {name: copy.deepcopy(getattr(algo, name).get(0)) for name in records}
    for r in (1, 2, 3):
        if r == 3:
            assert states[3] == {}, "a client that never took part holds nothing"
        run_round(exp, r, states, planner)
        # the rule: an absent client's state (and the server's records of it) are left exactly as they were
        assert_same_state(states[0], kept, f"client 0 after round {r + 1}")
        for name in records:
            assert_same_state(getattr(algo, name).get(0), kept_records[name], f"{name}[0] after round {r + 1}")
    run_round(exp, 4, states, planner)  # back: it trains from the state it kept
    if kept:
        assert not _same(states[0], kept), "client 0 trained in round 5 but its state did not move"
    # counters count the client's own rounds (FedSiam's user_epoch), an ensemble the models it received (FedSEAL)
    for counter in ("participations", "ensemble_count"):
        if counter in kept:
            assert states[0][counter] == kept[counter] + 1, counter


def _same(a, b):
    try:
        assert_same_state(a, b)
    except AssertionError:
        return False
    return True


def test_fedseal_an_unreachable_client_does_not_fold_the_broadcast(small_config, tmp_path):
    trace = tmp_path / "trace.jsonl"
    trace.write_text(
        '{"round": 1, "available": [0, 1, 2, 3]}\n'
        + "".join(f'{{"round": {r}, "available": [1, 2, 3]}}\n' for r in (2, 3, 4))
    )
    cfg = small_config(
        *MISSED_CASES["fedseal"],
        "train_args.local_steps=1",
        "train_args.client_num_per_round=2",
        f"train_args.availability_trace={trace}",
    )
    exp = build_experiment(cfg)
    exp.algorithm.setup()
    planner = Planner.from_config(cfg)
    states = {k: {} for k in range(4)}
    run_round(exp, 0, states, planner)
    kept = copy.deepcopy(states[0])
    assert kept.get("ensemble_count", 0) >= 1
    not_asked = 0
    for r in (1, 2, 3):
        plan = planner.plan(r, True)
        not_asked += 0 not in plan.asked
        assert 0 not in plan.listeners
        run_round(exp, r, states, planner)
    assert not_asked, "client 0 was asked in every round away: the broadcast path was not exercised"
    assert_same_state(states[0], kept, "client 0")
    assert states[2].get("ensemble_count", 0) >= 2  # a reachable client not asked still folds it


def test_the_fedml_runtime_records_the_same_participation_and_its_replay_ends_with_its_model(small_config, tmp_path):
    """Both runtimes write participation.jsonl through the one recorder; replaying a FedML run's record in
    the simulator ends with that run's model (FedSEAL: the broadcast's listeners are recorded and replayed)."""
    from tests.test_fedml_backend import FEDSEAL, run_protocol

    cfg = small_config(*FEDSEAL, "train_args.comm_round=2", "train_args.local_steps=1")
    local = run_local(cfg, run_dir=tmp_path / "local")
    fed, _, _ = run_protocol(cfg, tmp_path / "fed")
    rec = lines(fed.run_dir)
    assert rec == lines(local.run_dir)
    assert all(x["listeners"] == sorted(set(range(4)) - set(x["asked"])) for x in rec)
    replay = small_config(
        *FEDSEAL,
        "train_args.comm_round=2",
        "train_args.local_steps=1",
        f"train_args.replay_participation={tmp_path / 'fed' / 'participation.jsonl'}",
    )
    run_local(replay, run_dir=tmp_path / "replay")
    a = load_checkpoint(tmp_path / "fed" / "checkpoints" / "last.pt")
    b = load_checkpoint(tmp_path / "replay" / "checkpoints" / "last.pt")
    assert_same_state(a["algorithm"], b["algorithm"], "algorithm")
    assert_same_state(a["client_states"], b["client_states"], "client_states")


def test_run_replay_flag_sets_the_replay_key(capsys):
    from fedml_ssfl.cli import main
    from tests.conftest import SMALL

    args = [x for item in SMALL for x in ("--set", item)]
    assert main(["run", *args, "--replay", "runs/a/participation.jsonl", "--print-config"]) == 0
    assert "replay_participation: runs/a/participation.jsonl" in capsys.readouterr().out
