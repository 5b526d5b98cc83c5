"""FedSEAL (Bian et al. 2021): thresholds, self-ensemble, positive/negative sets, negative loss, e2e."""

from __future__ import annotations

import json
import math

import pytest
import torch
from torch import nn
from torch.nn import functional as F

from fedml_ssfl.algorithms.base import ClientContext, ClientData, DataInfo, Message, ServerData, TrainSettings
from fedml_ssfl.algorithms.fedseal import (
    FedSEAL,
    FedSEALConfig,
    PositiveNegativeLoss,
    classwise_thresholds,
    filter_sets,
    predict_probs,
    update_ensemble,
)
from fedml_ssfl.config import ConfigError, validate
from fedml_ssfl.models import build_model
from fedml_ssfl.runtime.local import run_local
from fedml_ssfl.ssl.negative import complementary_loss, sample_complementary_labels
from fedml_ssfl.training import InputPipeline, cosine_lr
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
    # tau_m = (sum of confidences of samples predicted m) / (number of true class-m samples), in [0, 1]
    assert tau[0].item() == 1.0  # over-predicted: (0.9 + 0.7 + 0.6) / 2 = 1.1, clipped (Sec. 4.1.2)
    assert tau[1].item() == pytest.approx((0.8 + 0.5) / 2)
    assert tau[2].item() == pytest.approx(0.6 / 2)
    assert tau[3].item() == 1.0 and tau[4].item() == 1.0  # no validation sample of the class


def test_threshold_of_a_never_predicted_class_is_zero_and_every_threshold_lies_in_0_1() -> None:
    probs = torch.tensor([[0.8, 0.2], [0.6, 0.4]])
    tau = classwise_thresholds(probs, torch.tensor([0, 1]), 2)
    assert tau.tolist() == pytest.approx([1.0, 0.0])  # 1.4 as a ratio: clipped
    g = torch.Generator().manual_seed(1)
    for _ in range(20):  # any validation set: tau_m in [0, 1]
        probs = torch.rand(30, 4, generator=g).pow(4).softmax(dim=1)
        tau = classwise_thresholds(probs, torch.randint(0, 4, (30,), generator=g), 6)
        assert bool(((tau >= 0) & (tau <= 1)).all())


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
    # same bootstrap (measured 83.8%). FedSEAL's clients must add to it (measured 88.9% with the
    # paper's per-round decay, 90.3% with the cosine on top). On this short run the Sec. 5.2
    # ablations do as well (no negatives 89.7%, no ensemble 90.0%): the tests above guard those
    # mechanisms exactly, this one only that the clients' training helps.
    result, rows = _digits_run(tmp_path, "fedseal")
    control, control_rows = _digits_run(tmp_path, "control", theta=0.0, fixed_threshold=1.0)
    assert rows[0]["test_acc"] == control_rows[0]["test_acc"]  # the same bootstrap and first update
    assert all(r["bytes_up"] == 0 for r in control_rows) and all(r["bytes_up"] > 0 for r in rows)
    assert rows[-1]["client_mask_rate"] > 0.3 and rows[-1]["client_neg_rate"] > 0.3
    assert rows[-1]["client_pseudo_acc"] > 0.9 and rows[-1]["client_neg_label_acc"] > 0.97
    assert result.final_acc >= 0.86, (control.final_acc, result.final_acc)
    assert result.final_acc >= control.final_acc + 0.03, (control.final_acc, result.final_acc)


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


# ---- the mechanisms inside the algorithm's own code path ----------------------------------------
# The tests above check the helpers; these drive server_step / client_update with hand-made
# messages and fail when the algorithm stops using a mechanism or feeds it the wrong thing.
INFO = DataInfo(num_classes=3, in_channels=1, image_size=8, mean=(0.5,), std=(0.25,), flip=False)
CPU = torch.device("cpu")


class _Linear(nn.Module):
    """Softmax regression on the 64 pixels: varied, class-balanced predictions on noise images."""

    def __init__(self):
        super().__init__()
        self.fc = nn.Linear(64, 3)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.fc(x.flatten(1))


def _model(seed: int = 0, scale: float = 1.0) -> nn.Module:
    """A random model; ``scale`` sharpens its softmax."""
    torch.manual_seed(seed)
    model = _Linear()
    with torch.no_grad():
        model.fc.weight.mul_(scale)
    return model


def _setup(train: dict | None = None, **cfg):
    gen = torch.Generator().manual_seed(0)
    images = torch.randint(0, 256, (80, 1, 8, 8), generator=gen, dtype=torch.uint8)
    labels = torch.randint(0, 3, (80,), generator=gen)
    server = ServerData(images, labels, torch.arange(0, 10), torch.arange(10, 30), 3)
    settings = {"local_steps": 1, "batch_size": 64, "comm_round": 10, **(train or {})}
    algo = FedSEAL(
        FedSEALConfig(**cfg),
        _Linear,
        server,
        INFO,
        TrainSettings(**settings),
        CPU,
        0,
    )
    algo.setup()
    return algo, ClientData(0, images, labels, torch.arange(30, 80), torch.arange(0), 3)


def _probs(model, data: ClientData) -> torch.Tensor:
    """p(x; w) on the client's unaugmented samples, computed here independently of the algorithm."""
    model.eval()
    with torch.no_grad():
        return model(InputPipeline(INFO, CPU).plain(data.images[data.unlabeled_idx])).softmax(dim=1)


class _Spy:
    """Records, per local step, which client samples (in batch order) the positive loss (on A(x))
    and the negative loss (on plain x) train on, and the complementary labels of that step."""

    def __init__(self, monkeypatch, images: torch.Tensor):
        import fedml_ssfl.algorithms.fedseal as fedseal_module

        self.images, self.pos, self.neg, self.neg_labels = images.flatten(1), [], [], []
        strong, plain, comp = InputPipeline.strong, InputPipeline.plain, fedseal_module.complementary_loss

        def spy_strong(pipe, x, generator):
            self.pos.append(self._ids(x))
            return strong(pipe, x, generator)

        def spy_plain(pipe, x):
            if torch.is_grad_enabled():  # training, not the no-grad prediction pass
                self.neg.append(self._ids(x))
            return plain(pipe, x)

        def spy_comp(logits, neg_labels, *args, **kwargs):
            self.neg_labels.append(neg_labels.tolist())
            return comp(logits, neg_labels, *args, **kwargs)

        monkeypatch.setattr(InputPipeline, "strong", spy_strong)
        monkeypatch.setattr(InputPipeline, "plain", spy_plain)
        monkeypatch.setattr(fedseal_module, "complementary_loss", spy_comp)

    def _ids(self, x: torch.Tensor) -> list[int]:
        return [int((self.images == row).all(dim=1).nonzero().item()) for row in x.flatten(1)]

    def sets(self) -> tuple[list[set[int]], list[set[int]]]:
        return [set(b) for b in self.pos], [set(b) for b in self.neg]

    def reset(self) -> None:
        self.pos, self.neg, self.neg_labels = [], [], []


def _expected_sets(ens: torch.Tensor, tau: torch.Tensor, theta: float, data: ClientData):
    """Eq. 10 and 12 by hand: the ids of the positive and the negative set."""
    conf, arg = ens.max(dim=1)
    pos = conf >= tau[arg]
    neg = (ens <= theta).any(dim=1) & ~pos
    ids = data.unlabeled_idx
    return {int(i) for i in ids[pos]}, {int(i) for i in ids[neg]}


def _message(model, tau: torch.Tensor):
    from fedml_ssfl.algorithms.base import Message

    return Message(weights={k: v.clone() for k, v in model.state_dict().items()}, extras={"thresholds": tau})


def _row(data: ClientData) -> dict[int, int]:
    return {int(i): r for r, i in enumerate(data.unlabeled_idx)}


def test_server_sends_the_eq5_thresholds_of_the_model_it_sends() -> None:
    algo, _ = _setup(bootstrap_steps=3, server_steps=2)
    algo.server_step(0)
    msg = algo.message_for(0, 0)
    model = _Linear()
    model.load_state_dict(msg.weights)
    sd = algo.server_data
    val = ClientData(0, sd.images, sd.labels, sd.val_idx, torch.arange(0), 3)
    expected = classwise_thresholds(_probs(model, val), sd.labels[sd.val_idx], 3)
    assert torch.allclose(msg.extras["thresholds"], expected)
    assert not torch.allclose(expected, torch.ones(3))


def test_client_positive_set_uses_the_classwise_thresholds(monkeypatch) -> None:
    # Eq. 10: y+ = argmax p_bar, kept where p_bar_{y+} >= tau_{y+} (class-wise); Eq. 12: the
    # negative set is the rest with some p_bar_m <= theta; Eq. 11: y- is such a class
    algo, data = _setup(theta=0.2)
    model = _model(1, scale=2.0)
    probs = _probs(model, data)
    conf, arg = probs.max(dim=1)
    tau = torch.stack([conf[arg == c].median() for c in range(3)])
    tau[0] = 0.0  # class 0: every sample predicted as 0 is positive
    pos, neg = _expected_sets(probs, tau, 0.2, data)
    assert pos and neg
    for scalar in tau.tolist():  # the class-wise rule is not any one threshold for all classes
        assert pos != _expected_sets(probs, torch.full((3,), scalar), 0.2, data)[0]
    spy = _Spy(monkeypatch, data.images)
    reply = algo.client_update(_message(model, tau), data, {}, ClientContext(0, CPU, 0))
    assert spy.sets() == ([pos], [neg])  # one step, the whole of each set (batch 64 > 50 samples)
    assert reply.extras["metrics"]["mask_rate"] == pytest.approx(len(pos) / 50)
    row = _row(data)
    (ids,), (labels,) = spy.neg, spy.neg_labels
    assert all(probs[row[i], y] <= 0.2 for i, y in zip(ids, labels))


def test_self_ensemble_is_carried_across_rounds_and_filters(monkeypatch) -> None:
    # Eq. 8: the client's state holds the running mean of the received models' probabilities;
    # round 2's sets come from (p1 + p2) / 2, not from the current model's p2
    algo, data = _setup(theta=0.2)
    tau = torch.full((3,), 0.6)
    first, second = _model(1, scale=2.0), _model(2, scale=2.0)
    p1, p2 = _probs(first, data), _probs(second, data)
    state: dict = {}
    spy = _Spy(monkeypatch, data.images)
    algo.client_update(_message(first, tau), data, state, ClientContext(0, CPU, 0))
    assert spy.sets() == ([_expected_sets(p1, tau, 0.2, data)[0]], [_expected_sets(p1, tau, 0.2, data)[1]])
    spy.reset()
    algo.client_update(_message(second, tau), data, state, ClientContext(1, CPU, 0))
    assert state["ensemble_count"] == 2 and torch.allclose(state["ensemble"], (p1 + p2) / 2, atol=1e-6)
    pos, neg = _expected_sets((p1 + p2) / 2, tau, 0.2, data)
    current = _expected_sets(p2, tau, 0.2, data)
    assert pos != current[0] and neg != current[1]  # the test tells the two apart
    assert spy.sets() == ([pos], [neg])


def test_negative_learning_lowers_the_complementary_probability(monkeypatch) -> None:
    # Eq. 15: -log(1 - p_{y-}) on the negative set; descending it must LOWER each sample's p_{y-}
    # (no positives: thresholds above 1; plain SGD, so the update is the loss's gradient)
    algo, data = _setup(theta=0.2, train={"local_steps": 3, "learning_rate": 0.2, "momentum": 0.0})
    model = _model(1, scale=2.0)
    spy = _Spy(monkeypatch, data.images)
    reply = algo.client_update(_message(model, torch.full((3,), 2.0)), data, {}, ClientContext(0, CPU, 0))
    metrics = reply.extras["metrics"]
    assert spy.pos == [] and len(spy.neg) == len(spy.neg_labels) == 3
    assert metrics["mask_rate"] == 0.0 and metrics["neg_rate"] > 0.3
    before = _probs(model, data)
    trained = _model(0)
    trained.load_state_dict(reply.weights)
    after = _probs(trained, data)
    row = _row(data)
    ids, labels = spy.neg[0], spy.neg_labels[0]
    p_before = torch.tensor([float(before[row[i], y]) for i, y in zip(ids, labels)])
    p_after = torch.tensor([float(after[row[i], y]) for i, y in zip(ids, labels)])
    assert metrics["loss"] == pytest.approx(float(-torch.log1p(-p_before).mean()), rel=0.2)
    assert (p_after < p_before).float().mean() > 0.8 and (p_before - p_after).mean() > 0.01, (
        p_before.mean(),
        p_after.mean(),
    )


def test_step_loss_is_lambda_ce_on_positives_plus_the_complementary_loss_on_negatives() -> None:
    """Eq. 13-15 as the step loss both training paths call: lambda CE(y+, f(A(x))) + l(y-, 1 - f(x)),
    each term only where its batch exists."""
    torch.manual_seed(0)
    net = nn.Linear(4, 3)
    batch = {"x_pos": torch.randn(5, 4), "y_pos": torch.tensor([0, 1, 2, 0, 1])}
    batch |= {"x_neg": torch.randn(6, 4), "y_neg": torch.tensor([2, 2, 1, 0, 0, 1])}
    pos = 0.3 * F.cross_entropy(net(batch["x_pos"]), batch["y_pos"])
    neg = complementary_loss(net(batch["x_neg"]), batch["y_neg"])
    loss = PositiveNegativeLoss(0.3)
    assert float(loss(net, {}, {}, batch, 0)[0]) == pytest.approx(float(pos + neg), rel=1e-6)
    only_neg = {k: v for k, v in batch.items() if k.endswith("neg")}
    only_pos = {k: v for k, v in batch.items() if k.endswith("pos")}
    assert float(loss(net, {}, {}, only_neg, 0)[0]) == pytest.approx(float(neg), rel=1e-6)
    assert float(loss(net, {}, {}, only_pos, 0)[0]) == pytest.approx(float(pos), rel=1e-6)


def test_positive_loss_is_weighted_by_the_rounds_lambda() -> None:
    # Eq. 13: lambda L+ with lambda ramping up over the rounds; with plain SGD and no negatives,
    # one step in round 5 of a 0.1 -> 1 ramp over 10 rounds moves the weights 0.55 times as far
    # as with lambda = 1
    deltas = []
    for ramp in ({"lambda_start": 0.1, "lambda_rampup_rounds": 10}, {"lambda_rampup_rounds": 0}):
        train = {"momentum": 0.0, "weight_decay": 0.0, "learning_rate": 0.1}
        algo, data = _setup(theta=0.0, lambda_end=1.0, train=train, **ramp)
        model = _model(1, scale=2.0)
        reply = algo.client_update(_message(model, torch.full((3,), 0.5)), data, {}, ClientContext(5, CPU, 0))
        assert reply.extras["metrics"]["neg_rate"] == 0.0 and reply.extras["metrics"]["mask_rate"] > 0.3
        deltas.append(reply.weights["fc.weight"] - model.fc.weight.detach())
    assert deltas[1].abs().max() > 1e-3
    assert torch.allclose(deltas[0], 0.55 * deltas[1], atol=1e-6)


def test_round_lr_is_the_papers_per_round_decay(monkeypatch) -> None:
    # Sec. 5.2.1: lr x 0.995 per round for server and clients, constant within a round; the
    # cosine of train_args.lr_schedule applies only with lr_times_train_schedule
    from fedml_ssfl import training

    train = {"learning_rate": 0.03, "lr_schedule": "cosine", "comm_round": 20, "local_steps": 2}
    algo, data = _setup(bootstrap_steps=0, server_steps=3, train=train)
    assert FedSEALConfig().lr_decay == 0.995 and not FedSEALConfig().lr_times_train_schedule
    for t in (0, 7, 19):
        assert algo.round_lr(t) == pytest.approx(0.03 * 0.995**t)
    both, _ = _setup(lr_times_train_schedule=True, train=train)
    assert both.round_lr(19) == pytest.approx(cosine_lr(both.train, 19 * 2) * 0.995**19)
    assert both.round_lr(19) < 0.5 * algo.round_lr(19)
    # the rates the server's and the client's optimisers are set to in round 7 (the client's job trains
    # through training.run_steps, which sets its rate every step)
    rates: list[tuple[str, float]] = []
    who = ["server"]
    original = training.set_lr
    monkeypatch.setattr(training, "set_lr", lambda opt, lr: (rates.append((who[0], lr)), original(opt, lr)))
    algo.server_step(7)
    who[0] = "client"
    algo.client_update(_message(_model(1, scale=2.0), torch.full((3,), 0.5)), data, {}, ClientContext(7, CPU, 0))
    assert {who for who, _ in rates} == {"server", "client"}
    assert all(lr == pytest.approx(0.03 * 0.995**7) for _, lr in rates), rates


def test_each_classs_threshold_is_logged_every_round_as_fig4(tmp_path) -> None:
    # Fig. 4 plots tau_m^t per class over the rounds: each round's metrics carry the thresholds the
    # round's clients received (the server's Eq. 5 on its validation set), one key per class
    algo, data = _setup(bootstrap_steps=3, server_steps=2)
    for r in range(2):
        algo.server_step(r)
        sent = algo.message_for(0, r).extras["thresholds"]
        metrics = algo.aggregate({0: Message()}, r)
        assert [metrics[f"threshold_c{m}"] for m in range(3)] == pytest.approx(sent.tolist())
        assert metrics["threshold_mean"] == pytest.approx(sum(sent.tolist()) / 3)
    assert len({metrics[f"threshold_c{m}"] for m in range(3)}) > 1  # class-wise, not one number
    quiet, _ = _setup(bootstrap_steps=3, server_steps=2, log_class_thresholds=False)
    quiet.server_step(0)
    assert not any(k.startswith("threshold_c") for k in quiet.aggregate({0: Message()}, 0))
    # in a run's metrics.jsonl, every round, every class (10 digits): the fixed threshold here
    cfg = _digits_config(
        tmp_path,
        "fixed",
        train={"comm_round": 2, "local_steps": 2},
        fixed_threshold=0.7,
        bootstrap_steps=4,
        server_steps=2,
    )
    run_local(cfg, run_dir=tmp_path / "fixed")
    rows = [json.loads(r) for r in (tmp_path / "fixed" / "metrics.jsonl").read_text().splitlines()]
    assert len(rows) == 2
    for row in rows:
        assert [row[f"threshold_c{m}"] for m in range(10)] == pytest.approx([0.7] * 10)


@pytest.mark.parametrize("augment", ["weak", "plain"])
def test_server_only_without_data_augmentation_is_fedseals_server_sl_wo_da(monkeypatch, augment) -> None:
    # FedSEAL Table 2's "Server-SL w/o DA": server_only on the original images (augment: plain); the
    # default keeps the weak view. The T = 2 steps of batch 8 see which view?
    from fedml_ssfl.algorithms.bounds import ServerOnly, ServerOnlyConfig
    from fedml_ssfl.training import InputPipeline

    calls: list[str] = []
    weak, plain = InputPipeline.weak, InputPipeline.plain
    monkeypatch.setattr(InputPipeline, "weak", lambda self, x, g: calls.append("weak") or weak(self, x, g))
    monkeypatch.setattr(InputPipeline, "plain", lambda self, x: calls.append("plain") or plain(self, x))
    _, data = _setup()
    server = ServerData(data.images, data.labels, torch.arange(0, 10), torch.arange(0), 3)
    algo = ServerOnly(
        ServerOnlyConfig(augment=augment),
        _Linear,
        server,
        INFO,
        TrainSettings(local_steps=2, batch_size=8, comm_round=2),
        CPU,
        0,
    )
    algo.setup()
    before = {k: v.clone() for k, v in algo.global_state.items()}
    algo.server_step(0)
    assert calls == [augment, augment]
    assert any(not torch.equal(before[k], algo.global_state[k]) for k in before)
    with pytest.raises(ConfigError, match=r"ssfl_args\.augment"):
        validate({"data_args": {"dataset": "digits"}, "ssfl_args": {"algorithm": "server_only", "augment": "strong"}})
