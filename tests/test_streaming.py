"""FedMatch's Streaming-NonIID task: stages of unlabeled data released every few rounds, in both runtimes' path."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from fedml_ssfl.algorithms.fedavg_ssl import FedAvgSSL
from fedml_ssfl.checkpoint import load_checkpoint
from fedml_ssfl.data import build_split
from fedml_ssfl.data.partition_methods import PartitionOptions
from fedml_ssfl.experiment import build_experiment, load_experiment_dataset, make_split
from fedml_ssfl.runtime.local import run_local

LABELS = torch.arange(10).repeat_interleave(250)


def streaming(scenario: str = "client", num_stages: int = 10, rounds_per_stage: int = 10, seed: int = 0, **kw):
    options = PartitionOptions(
        partition_method="streaming_noniid",
        label_scenario=scenario,
        num_server_labels=0 if scenario == "client" else 100,
        num_server_val=30,
        num_stages=num_stages,
        rounds_per_stage=rounds_per_stage,
        **kw,
    )
    return build_split(LABELS, 10, options, num_clients=10, seed=seed)


@pytest.mark.parametrize("scenario", ["client", "server"])
def test_stages_partition_the_unlabeled_set_disjointly(scenario: str) -> None:
    split = streaming(scenario)
    assert split.streaming and split.num_stages == 10 and split.rounds_per_stage == 10
    for k in range(split.num_clients):
        unl, stages = split.client_unlabeled[k], split.client_stages[k]
        assert stages.shape == unl.shape and stages.dtype == torch.int64
        assert (stages[1:] >= stages[:-1]).all() and stages.min() >= 0 and stages.max() <= 9
        chunks = [unl[stages == s] for s in range(10)]
        joined = torch.cat(chunks)
        assert torch.equal(joined, unl) and len(torch.unique(joined)) == len(unl)  # disjoint, all covered
        assert all(torch.equal(c, torch.sort(c).values) for c in chunks)
        sizes = split.stage_sizes(k)
        assert sizes.sum() == len(unl) and sizes.max() - sizes.min() <= 1


def test_released_samples_grow_exactly_by_the_stage_sizes() -> None:
    split = streaming(num_stages=10, rounds_per_stage=10)
    for k in range(split.num_clients):
        sizes = split.stage_sizes(k)
        previous = split.unlabeled_at(k, 0)
        assert len(previous) == sizes[0]
        for r in range(1, 120):
            now = split.unlabeled_at(k, r)
            growth = len(now) - len(previous)
            assert growth == (sizes[r // 10] if r % 10 == 0 and r < 100 else 0), (k, r)
            assert torch.equal(now[: len(previous)], previous)  # a released sample keeps its position
            previous = now
        assert len(previous) == len(split.client_unlabeled[k])
        assert torch.equal(split.unlabeled_at(k, None), split.client_unlabeled[k])
        assert [split.released_stages(r) for r in (0, 9, 10, 89, 90, 1000)] == [1, 1, 2, 9, 10, 10]
    with pytest.raises(ValueError, match="round_idx"):
        split.unlabeled_at(0, -1)


def test_streaming_is_batch_noniid_plus_stages() -> None:
    stream = streaming(num_stages=4)
    options = PartitionOptions(
        partition_method="batch_noniid", label_scenario="client", num_server_labels=0, num_server_val=30
    )
    batch = build_split(LABELS, 10, options, num_clients=10, seed=0)
    assert batch.client_stages is None and batch.num_stages == 0
    for a, b in zip(stream.client_unlabeled, batch.client_unlabeled):
        assert torch.equal(torch.sort(a).values, b)
    assert all(torch.equal(a, b) for a, b in zip(stream.client_labeled, batch.client_labeled))
    assert torch.equal(stream.server_val, batch.server_val)
    again, other = streaming(num_stages=4), streaming(num_stages=4, seed=3)
    assert all(torch.equal(a, b) for a, b in zip(stream.client_stages, again.client_stages))
    assert not all(torch.equal(a, b) for a, b in zip(stream.client_unlabeled, other.client_unlabeled))


def test_more_stages_than_samples_and_one_stage() -> None:
    tiny = streaming(num_stages=400, rounds_per_stage=1)
    sizes = tiny.stage_sizes(0)
    assert len(sizes) == 400 and sizes.sum() == len(tiny.client_unlabeled[0]) and set(sizes.tolist()) <= {0, 1}
    one = streaming(num_stages=1, rounds_per_stage=5)
    assert torch.equal(one.unlabeled_at(3, 0), one.client_unlabeled[3])


def test_a_batch_split_ignores_the_round() -> None:
    split = build_split(LABELS, 10, PartitionOptions(num_server_labels=50), num_clients=5, seed=0)
    assert not split.streaming and split.released_stages(7) == 0
    assert torch.equal(split.unlabeled_at(2, 7), split.client_unlabeled[2])
    assert len(split.stage_sizes(2)) == 0


STREAM = [
    "data_args.partition_method=streaming_noniid",
    "data_args.num_stages=3",
    "data_args.rounds_per_stage=2",
    "train_args.comm_round=5",
    "train_args.local_steps=1",
]


def test_experiment_client_data_follows_the_round(small_config) -> None:
    cfg = small_config(*STREAM)
    exp = build_experiment(cfg)
    for k in range(4):
        sizes = exp.split.stage_sizes(k)
        seen = [exp.client_data(k, r).num_unlabeled for r in range(6)]
        assert seen == [sizes[0]] * 2 + [sizes[:2].sum()] * 2 + [sizes.sum()] * 2
        assert exp.client_data(k).num_unlabeled == sizes.sum()
        assert torch.equal(exp.client_data(k, 0).labeled_idx, exp.client_data(k, 5).labeled_idx)


def test_run_local_streaming_trains_on_the_released_stages(small_config, tmp_path, monkeypatch) -> None:
    cfg = small_config(*STREAM)
    seen: dict[tuple[int, int], torch.Tensor] = {}
    real = FedAvgSSL.client_update

    def spy(self, msg, data, state, ctx):
        seen[(ctx.round_idx, data.client_id)] = data.unlabeled_idx.clone()
        return real(self, msg, data, state, ctx)

    monkeypatch.setattr(FedAvgSSL, "client_update", spy)
    run_local(cfg, run_dir=tmp_path / "run")
    split = make_split(cfg, load_experiment_dataset(cfg))
    assert {r for r, _ in seen} == set(range(5)) and {k for _, k in seen} == set(range(4))
    for (r, k), idx in seen.items():
        assert torch.equal(idx, split.unlabeled_at(k, r)), (r, k)
    sizes = {k: np.cumsum(split.stage_sizes(k)) for k in range(4)}
    for k in range(4):
        assert [len(seen[(r, k)]) for r in range(5)] == [sizes[k][min(2, r // 2)] for r in range(5)]
        assert len(seen[(0, k)]) < len(seen[(4, k)]) == len(split.client_unlabeled[k])


def test_streaming_resume_ends_with_the_uninterrupted_model(small_config, tmp_path) -> None:
    cfg = small_config(*STREAM, "train_args.comm_round=4")
    full = run_local(cfg, run_dir=tmp_path / "full")
    run_local(cfg, run_dir=tmp_path / "part", stop_after=2)
    resumed = run_local(cfg, run_dir=tmp_path / "part", resume=True)
    a = load_checkpoint(full.run_dir / "checkpoints" / "last.pt")["algorithm"]["global_state"]
    b = load_checkpoint(resumed.run_dir / "checkpoints" / "last.pt")["algorithm"]["global_state"]
    assert a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a)


def test_fedml_worker_sees_the_same_released_stages(small_config, monkeypatch) -> None:
    from fedml_ssfl.runtime.fedml.protocol import Reply, Task
    from fedml_ssfl.runtime.fedml.worker import ClientWorker

    cfg = small_config(*STREAM)
    exp = build_experiment(cfg)
    seen = {}

    def spy(self, msg, data, state, ctx):
        seen[(ctx.round_idx, data.client_id)] = data.unlabeled_idx.clone()
        return None

    monkeypatch.setattr(FedAvgSSL, "client_update", spy)
    worker = ClientWorker(exp, rank=1)
    for r, k in [(0, 1), (3, 1), (4, 2)]:
        up = worker.handle(Task(round=r, silo=k, rank=1, state={}, state_tag=r - 1))
        assert isinstance(up, Reply), getattr(up, "error", None)
        assert torch.equal(seen[(r, k)], exp.split.unlabeled_at(k, r))
    assert len(seen[(0, 1)]) < len(seen[(3, 1)])
