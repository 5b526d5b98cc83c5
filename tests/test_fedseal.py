"""FedSEAL (Bian et al. 2021): thresholds, self-ensemble, positive/negative sets, negative loss, e2e."""

from __future__ import annotations

import json
import math

import pytest
import torch
from torch.nn import functional as F

from fedml_ssfl.algorithms.base import ClientContext, ClientData, DataInfo, ServerData, TrainSettings
from fedml_ssfl.algorithms.fedseal import (
    FedSEAL,
    FedSEALConfig,
    classwise_thresholds,
    filter_sets,
    predict_probs,
    update_ensemble,
)
from fedml_ssfl.config import ConfigError, validate
from fedml_ssfl.models import build_model
from fedml_ssfl.runtime.local import run_local
from fedml_ssfl.ssl.negative import complementary_loss, sample_complementary_labels
from fedml_ssfl.training import InputPipeline
from tests.conftest import resume_matches_uninterrupted


# ---- Eq. 5 ----------------------------------------------------------------------------------------
def test_thresholds_on_a_hand_made_validation_set() -> None:
    probs = torch.tensor(
        [
            [0.9, 0.1, 0.0, 0.0],  # true 0, predicted 0 (0.9)
            [0.7, 0.3, 0.0, 0.0],  # true 0, predicted 0 (0.7)
            [0.6, 0.4, 0.0, 0.0],  # true 1, predicted 0 (0.6)
            [0.2, 0.8, 0.0, 0.0],  # true 1, predicted 1 (0.8)
            [0.1, 0.3, 0.6, 0.0],  # true 2, predicted 2 (0.6)
            [0.1, 0.5, 0.4, 0.0],  # true 2, predicted 1 (0.5)
        ]
    )
    labels = torch.tensor([0, 0, 1, 1, 2, 2])
    tau = classwise_thresholds(probs, labels, 5)
    # tau_m = (sum of confidences of samples predicted m) / (number of true class-m samples)
    assert tau[0].item() == pytest.approx((0.9 + 0.7 + 0.6) / 2)  # over-predicted: above 1
    assert tau[1].item() == pytest.approx((0.8 + 0.5) / 2)
    assert tau[2].item() == pytest.approx(0.6 / 2)
    assert math.isinf(tau[3].item()) and math.isinf(tau[4].item())  # no validation sample of the class


def test_threshold_of_a_never_predicted_class_is_zero() -> None:
    probs = torch.tensor([[0.8, 0.2], [0.6, 0.4]])
    tau = classwise_thresholds(probs, torch.tensor([0, 1]), 2)
    assert tau.tolist() == pytest.approx([1.4, 0.0])


# ---- Eq. 8 ----------------------------------------------------------------------------------------
def test_ensemble_after_t_rounds_is_the_mean_of_t_probability_vectors() -> None:
    g = torch.Generator().manual_seed(0)
    rounds = [torch.softmax(torch.randn(7, 4, generator=g), dim=1) for _ in range(5)]
    mean, count = None, 0
    for t, p in enumerate(rounds, start=1):
        mean, count = update_ensemble(mean, count, p)
        assert count == t
        assert torch.allclose(mean, torch.stack(rounds[:t]).mean(dim=0), atol=1e-6)
    assert torch.allclose(mean.sum(dim=1), torch.ones(7), atol=1e-6)
    # a hand-made case: (1, 0), (0, 1), (0.5, 0.5) -> (0.5, 0.5)
    m, c = None, 0
    for p in ([1.0, 0.0], [0.0, 1.0], [0.5, 0.5]):
        m, c = update_ensemble(m, c, torch.tensor([p]))
    assert m.tolist() == [[0.5, 0.5]] and c == 3


# ---- Eq. 9-12 --------------------------------------------------------------------------------------
def test_positive_and_negative_sets_are_disjoint_and_follow_the_rules() -> None:
    g = torch.Generator().manual_seed(1)
    ens = torch.softmax(3 * torch.randn(400, 5, generator=g), dim=1)
    tau = torch.tensor([0.6, 0.7, 0.8, 0.5, 0.9])
    sets = filter_sets(ens, tau, 0.05, torch.Generator().manual_seed(2))
    conf, arg = ens.max(dim=1)
    assert not (sets.pos_mask & sets.neg_mask).any()
    assert torch.equal(sets.pos_mask, conf >= tau[arg])
    assert torch.equal(sets.pos_labels[sets.pos_mask], arg[sets.pos_mask])
    has_low = (ens <= 0.05).any(dim=1)
    assert torch.equal(sets.neg_mask, has_low & ~sets.pos_mask)
    chosen = ens[sets.neg_mask].gather(1, sets.neg_labels[sets.neg_mask].view(-1, 1))
    assert (chosen <= 0.05).all()
    assert sets.pos_mask.any() and sets.neg_mask.any()
    none = filter_sets(ens, tau, 0.05, torch.Generator().manual_seed(2), negative=False)
    assert not none.neg_mask.any() and torch.equal(none.pos_mask, sets.pos_mask)


def test_complementary_label_is_uniform_over_the_low_classes() -> None:
    probs = torch.tensor([[0.02, 0.9, 0.04, 0.04]]).repeat(3000, 1)
    labels, ok = sample_complementary_labels(probs, 0.05, torch.Generator().manual_seed(0))
    assert ok.all()
    counts = torch.bincount(labels, minlength=4)
    assert counts[1] == 0
    assert all(abs(c / 3000 - 1 / 3) < 0.04 for c in counts[[0, 2, 3]].tolist())
    _, ok = sample_complementary_labels(torch.full((2, 4), 0.25), 0.05, torch.Generator().manual_seed(0))
    assert not ok.any()


# ---- Eq. 15 ----------------------------------------------------------------------------------------
def test_negative_loss_on_hand_made_cases() -> None:
    # two equal logits: p = 1/2, loss = -log(1/2)
    assert complementary_loss(torch.zeros(1, 2), torch.tensor([0])).item() == pytest.approx(math.log(2))
    # logits (log 3, 0, 0): p = (3/5, 1/5, 1/5)
    logits = torch.tensor([[math.log(3.0), 0.0, 0.0]])
    assert complementary_loss(logits, torch.tensor([0])).item() == pytest.approx(-math.log(2 / 5))
    assert complementary_loss(logits, torch.tensor([1])).item() == pytest.approx(-math.log(4 / 5))
    # the mean over a batch, and the naive formula on random logits
    z = torch.randn(6, 4, generator=torch.Generator().manual_seed(0))
    y = torch.tensor([0, 1, 2, 3, 0, 1])
    naive = -torch.log(1 - F.softmax(z, dim=1).gather(1, y.view(-1, 1)).squeeze(1))
    assert torch.allclose(complementary_loss(z, y, reduction="none"), naive, atol=1e-5)
    assert complementary_loss(z, y).item() == pytest.approx(naive.mean().item(), abs=1e-5)
    # stable where the naive formula overflows, and its gradient lowers the complementary logit
    big = torch.tensor([[60.0, 0.0, 0.0]], requires_grad=True)
    loss = complementary_loss(big, torch.tensor([0]))
    assert math.isfinite(loss.item()) and loss.item() == pytest.approx(60 - math.log(2), rel=1e-4)
    loss.backward()
    assert big.grad[0, 0] > 0 and (big.grad[0, 1:] < 0).all()


# ---- config and schedule ---------------------------------------------------------------------------
def test_config_needs_a_validation_set() -> None:
    base = {
        "data_args": {"dataset": "digits", "num_server_labels": 50},
        "ssfl_args": {"algorithm": "fedseal"},
    }
    with pytest.raises(ConfigError, match=r"data_args\.num_server_val"):
        validate(base)
    ok = validate({**base, "data_args": {"dataset": "digits", "num_server_val": 50}})
    assert ok.ssfl_args.theta == 0.05 and ok.ssfl_args.lr_decay == 0.995
    fixed = validate({**base, "ssfl_args": {"algorithm": "fedseal", "fixed_threshold": 0.9}})
    streaming = {"dataset": "digits", "num_server_val": 50, "partition_method": "streaming_noniid"}
    with pytest.raises(ConfigError, match=r"data_args\.partition_method.*stages"):
        validate({**base, "data_args": streaming})
    assert fixed.ssfl_args.fixed_threshold == 0.9
    for bad, key in [
        ({"theta": 2.0}, "theta"),
        ({"lr_decay": 0.0}, "lr_decay"),
        ({"lambda_rampup_rounds": -1}, "lambda_rampup_rounds"),
        ({"server_steps": -1}, "server_steps"),
    ]:
        with pytest.raises(ConfigError, match=rf"ssfl_args\.{key}"):
            validate(
                {
                    **base,
                    "data_args": {"dataset": "digits", "num_server_val": 50},
                    "ssfl_args": {"algorithm": "fedseal", **bad},
                }
            )


def test_lambda_grows_over_the_rounds() -> None:
    cfg = FedSEALConfig(lambda_start=0.1, lambda_end=1.0, lambda_rampup_rounds=10)
    assert cfg.positive_weight(0) == pytest.approx(0.1)
    assert cfg.positive_weight(5) == pytest.approx(0.55)
    assert cfg.positive_weight(10) == cfg.positive_weight(50) == pytest.approx(1.0)
    assert FedSEALConfig(lambda_rampup_rounds=0).positive_weight(0) == 1.0


# ---- the client keeps the ensemble as its state ------------------------------------------------------
def test_client_state_holds_the_ensemble_of_received_models() -> None:
    info = DataInfo(num_classes=3, in_channels=1, image_size=8, mean=(0.5,), std=(0.25,), flip=False)
    gen = torch.Generator().manual_seed(0)
    images = torch.randint(0, 256, (40, 1, 8, 8), generator=gen, dtype=torch.uint8)
    labels = torch.randint(0, 3, (40,), generator=gen)
    server = ServerData(images, labels, torch.arange(0, 10), torch.arange(10, 20), 3)

    def model_fn():
        return build_model("cnn28", num_classes=3, in_channels=1, image_size=8, norm="gn")

    algo = FedSEAL(
        FedSEALConfig(bootstrap_steps=2),
        model_fn,
        server,
        info,
        TrainSettings(local_steps=2, batch_size=8, comm_round=3),
        torch.device("cpu"),
        0,
    )
    algo.setup()
    data = ClientData(0, images, labels, torch.arange(20, 40), torch.arange(0), 3)
    state: dict = {}
    pipeline = InputPipeline(info, torch.device("cpu"))
    seen = []
    for r in range(2):
        algo.server_step(r)
        msg = algo.message_for(0, r)
        assert msg.extras["thresholds"].shape == (3,)
        seen.append(
            predict_probs(
                algo.scratch_model(msg.weights, torch.device("cpu"), "check"),
                pipeline,
                images,
                data.unlabeled_idx,
            )
        )
        reply = algo.client_update(msg, data, state, ClientContext(r, torch.device("cpu"), 0))
        algo.aggregate({0: reply}, r)
    assert state["ensemble_count"] == 2
    assert state["ensemble"].device.type == "cpu"
    assert torch.allclose(state["ensemble"], (seen[0] + seen[1]) / 2, atol=1e-6)


# ---- end to end ---------------------------------------------------------------------------------------
def _digits_config(tmp_path, name: str, train: dict | None = None, tracking: dict | None = None, **ssfl):
    """FedSEAL on digits with 4 clients; ``train`` / ``tracking`` / ``ssfl`` override the defaults."""
    return validate(
        {
            "common_args": {"output_dir": str(tmp_path), "run_name": name, "compare_with": []},
            "data_args": {"dataset": "digits", "num_server_labels": 30, "num_server_val": 50},
            "model_args": {"model": "cnn28", "norm": "bn"},
            "train_args": {
                "client_num_in_total": 4,
                "client_num_per_round": 4,
                "comm_round": 5,
                "local_steps": 8,
                "batch_size": 32,
                "learning_rate": 0.03,
                **(train or {}),
            },
            "device_args": {"num_threads": 1},
            "tracking_args": {"enable_tensorboard": False, "progress_bar": False, **(tracking or {})},
            "ssfl_args": {
                "algorithm": "fedseal",
                "server_steps": 40,
                "bootstrap_steps": 200,
                "lambda_rampup_rounds": 10,
                **ssfl,
            },
        }
    )


def _digits_run(tmp_path, name: str, **ssfl):
    cfg = _digits_config(tmp_path, name, **ssfl)
    result = run_local(cfg, run_dir=tmp_path / name)
    rows = [json.loads(r) for r in (tmp_path / name / "metrics.jsonl").read_text().splitlines()]
    return result, rows


def test_fedseal_end_to_end_beats_the_server_alone(tmp_path) -> None:
    # Control: thresholds no sample can pass (theta 0, tau 1) leave the clients with empty
    # sets, so they send nothing and the same schedule is server-only training from the
    # same bootstrap (measured 83.8%). FedSEAL's clients must add to it (measured 91.4%).
    result, rows = _digits_run(tmp_path, "fedseal")
    control, control_rows = _digits_run(tmp_path, "control", theta=0.0, fixed_threshold=1.0)
    assert rows[0]["test_acc"] == control_rows[0]["test_acc"]  # the same bootstrap and first update
    assert all(r["bytes_up"] == 0 for r in control_rows) and all(r["bytes_up"] > 0 for r in rows)
    assert rows[-1]["client_mask_rate"] > 0.3 and rows[-1]["client_neg_rate"] > 0.3
    assert rows[-1]["client_pseudo_acc"] > 0.9 and rows[-1]["client_neg_label_acc"] > 0.97
    assert result.final_acc >= 0.88, (control.final_acc, result.final_acc)
    assert result.final_acc >= control.final_acc + 0.04, (control.final_acc, result.final_acc)


def test_fedseal_resume_is_exact(tmp_path) -> None:
    cfg = _digits_config(
        tmp_path,
        "r",
        train={"client_num_in_total": 3, "client_num_per_round": 2, "comm_round": 3, "local_steps": 3},
        tracking={"checkpoint_every": 1},
        server_steps=5,
        bootstrap_steps=20,
    )
    a, _ = resume_matches_uninterrupted(cfg, tmp_path)  # global model and every client's ensemble
    assert any(cs.get("ensemble") is not None for cs in a["client_states"].values())
