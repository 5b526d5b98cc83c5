"""SemiFL (Diao et al. 2022): fix/mix sets, mixup loss, server momentum, sBN, end to end."""

from __future__ import annotations

import json
import math

import pytest
import torch
from torch import nn
from torch.nn import functional as F

from fedml_ssfl.algorithms import semifl as semifl_module
from fedml_ssfl.algorithms.base import ClientContext, ClientData, DataInfo, Message, ServerData, TrainSettings
from fedml_ssfl.algorithms.semifl import (
    SemiFL,
    SemiFLConfig,
    apply_bn_sums,
    bn_sums,
    fix_mix_sets,
    merge_bn_sums,
    server_momentum_step,
)
from fedml_ssfl.checkpoint import load_checkpoint
from fedml_ssfl.config import ConfigError, validate
from fedml_ssfl.models import build_model
from fedml_ssfl.runtime.local import run_local
from fedml_ssfl.ssl.mixup import mix_inputs, mixup_loss, sample_mix_lambda
from fedml_ssfl.training import InputPipeline, optimizer_step

INFO = DataInfo(num_classes=3, in_channels=1, image_size=8, mean=(0.5,), std=(0.25,), flip=False)


def _images(n: int, seed: int = 0) -> torch.Tensor:
    return torch.randint(0, 256, (n, 1, 8, 8), generator=torch.Generator().manual_seed(seed), dtype=torch.uint8)


# ---- fix and mix sets --------------------------------------------------------------------------
def test_fix_set_is_exactly_the_confident_samples() -> None:
    probs = torch.tensor(
        [
            [0.96, 0.02, 0.02],  # confident, class 0
            [0.50, 0.40, 0.10],  # not confident
            [0.02, 0.03, 0.95],  # exactly at tau: kept (>=)
            [0.10, 0.10, 0.80],  # not confident
            [0.01, 0.98, 0.01],  # confident, class 1
        ]
    )
    sets = fix_mix_sets(probs, 0.95, torch.Generator().manual_seed(0))
    assert sets.fix.tolist() == [0, 2, 4]
    assert sets.fix_labels.tolist() == [0, 2, 1]
    # mix set: as many draws (with replacement) from all samples, labelled by their argmax
    assert sets.mix.numel() == 3
    assert ((sets.mix >= 0) & (sets.mix < 5)).all()
    assert torch.equal(sets.mix_labels, probs.argmax(dim=1)[sets.mix])


def test_mix_set_draws_with_replacement_from_all_samples() -> None:
    probs = torch.zeros(6, 3)
    probs[:, 0] = 1.0
    probs[5] = torch.tensor([0.2, 0.5, 0.3])
    g = torch.Generator().manual_seed(1)
    drawn = torch.cat([fix_mix_sets(probs, 0.95, g).mix for _ in range(50)])
    assert set(drawn.tolist()) == set(range(6))  # the unconfident sample 5 is drawn too


def test_empty_fix_set() -> None:
    sets = fix_mix_sets(torch.full((4, 3), 1 / 3), 0.95, torch.Generator().manual_seed(0))
    assert sets.fix.numel() == 0 and sets.mix.numel() == 0


# ---- mixup ---------------------------------------------------------------------------------------
def test_mixup_loss_on_a_hand_made_batch() -> None:
    logits = torch.tensor([[math.log(3.0), 0.0, 0.0], [0.0, 0.0, 0.0]])
    y_fix, y_mix = torch.tensor([0, 1]), torch.tensor([1, 1])
    lam = 0.25
    # sample 0: p = (3/5, 1/5, 1/5); sample 1: uniform 1/3
    ce_fix = (-math.log(3 / 5) - math.log(1 / 3)) / 2
    ce_mix = (-math.log(1 / 5) - math.log(1 / 3)) / 2
    expected = lam * ce_fix + (1 - lam) * ce_mix
    assert mixup_loss(logits, y_fix, y_mix, lam).item() == pytest.approx(expected, rel=1e-6)
    x_a, x_b = torch.ones(2, 1, 2, 2), torch.zeros(2, 1, 2, 2)
    assert torch.allclose(mix_inputs(x_a, x_b, lam), torch.full((2, 1, 2, 2), 0.25))


def test_mix_lambda_is_reproducible_beta() -> None:
    a = [sample_mix_lambda(0.75, torch.Generator().manual_seed(3)) for _ in range(2)]
    assert a[0] == a[1]
    g = torch.Generator().manual_seed(4)
    draws = torch.tensor([sample_mix_lambda(0.75, g) for _ in range(2000)])
    assert ((draws >= 0) & (draws <= 1)).all()
    assert draws.mean().item() == pytest.approx(0.5, abs=0.03)
    # Beta(0.75, 0.75) is U-shaped: variance 1 / (4 (2a + 1)) = 0.1 > uniform's 1/12
    assert draws.var().item() == pytest.approx(0.1, abs=0.015)


# ---- server momentum ----------------------------------------------------------------------------
def test_server_momentum_on_hand_made_tensors() -> None:
    keys = {"w"}
    glob = {"w": torch.tensor([1.0, 2.0]), "running_mean": torch.tensor([9.0])}
    avg = {"w": torch.tensor([0.5, 1.0]), "running_mean": torch.tensor([3.0])}
    new, buf = server_momentum_step(glob, avg, {}, lr=1.0, momentum=0.5, param_keys=keys)
    # first step: buf = g = w_global - w_avg; w = w_global - buf = w_avg
    assert torch.allclose(buf["w"], torch.tensor([0.5, 1.0]))
    assert torch.allclose(new["w"], torch.tensor([0.5, 1.0]))
    assert new["running_mean"].item() == 3.0  # buffers come from the average
    # second step: g = (0.5, 1.0) - (0.25, 0.5) = (0.25, 0.5); buf = 0.5 * buf + g = (0.5, 1.0)
    new2, buf2 = server_momentum_step(
        new,
        {"w": torch.tensor([0.25, 0.5]), "running_mean": torch.tensor([1.0])},
        buf,
        lr=1.0,
        momentum=0.5,
        param_keys=keys,
    )
    assert torch.allclose(buf2["w"], torch.tensor([0.5, 1.0]))
    assert torch.allclose(new2["w"], torch.tensor([0.0, 0.0]))
    assert torch.allclose(buf["w"], torch.tensor([0.5, 1.0]))  # inputs untouched


def test_server_momentum_matches_torch_sgd() -> None:
    g = torch.Generator().manual_seed(0)
    w = torch.randn(5, generator=g)
    param = nn.Parameter(w.clone())
    opt = torch.optim.SGD([param], lr=0.7, momentum=0.5)
    state, buf = {"p": w.clone()}, {}
    for _ in range(4):
        avg = {"p": state["p"] + torch.randn(5, generator=g)}
        param.grad = param.data - avg["p"]
        opt.step()
        state, buf = server_momentum_step(state, avg, buf, lr=0.7, momentum=0.5, param_keys={"p"})
        assert torch.allclose(state["p"], param.data, atol=1e-6)


# ---- static BatchNorm ------------------------------------------------------------------------------
def _bn_model() -> nn.Module:
    torch.manual_seed(0)
    return build_model("cnn28", num_classes=3, in_channels=1, image_size=8, norm="bn")


def test_sbn_statistics_equal_those_of_the_data() -> None:
    model = _bn_model()
    images = _images(40)
    pipeline = InputPipeline(INFO, torch.device("cpu"))
    before = {k: v.clone() for k, v in model.state_dict().items()}
    sums = bn_sums(model, pipeline, images, torch.arange(40), batch_size=40)
    for k, v in model.state_dict().items():  # the pass leaves the model's buffers alone
        assert torch.equal(v, before[k]), k
    assert set(sums) == {"norm1", "norm2", "norm3"}

    # the inputs every BN layer sees in one train-mode pass over the same batch
    seen: dict[str, torch.Tensor] = {}
    hooks = [
        getattr(model, n).register_forward_pre_hook(lambda m, i, n=n: seen.__setitem__(n, i[0].detach())) for n in sums
    ]
    model.train()
    with torch.no_grad():
        model(pipeline.plain(images))
    for h in hooks:
        h.remove()
    new_state = apply_bn_sums(model.state_dict(), sums)
    for name, x in seen.items():
        x = x.double()
        assert sums[name]["count"].item() == x.numel() // x.shape[1]
        assert torch.allclose(new_state[f"{name}.running_mean"].double(), x.mean(dim=(0, 2, 3)), atol=1e-5)
        assert torch.allclose(
            new_state[f"{name}.running_var"].double(), x.var(dim=(0, 2, 3), unbiased=False), atol=1e-5
        )


@pytest.mark.parametrize("dtype", [torch.float32, torch.float64])
def test_sbn_sums_are_the_float64_sums_of_each_layers_inputs(dtype) -> None:
    """Bit for bit the float64 sum and sum of squares of what each BN layer saw, and the pass leaves
    those inputs alone (a float64 model's inputs are squared in place nowhere)."""
    model = _bn_model().to(dtype)
    images = _images(24, seed=2)
    plain = InputPipeline(INFO, torch.device("cpu")).plain

    class Pipeline:
        def plain(self, x: torch.Tensor) -> torch.Tensor:
            return plain(x).to(dtype)

    sums = bn_sums(model, Pipeline(), images, torch.arange(24), batch_size=24)
    seen: dict[str, torch.Tensor] = {}
    hooks = [
        getattr(model, n).register_forward_pre_hook(lambda m, i, n=n: seen.__setitem__(n, i[0].detach().clone()))
        for n in sums
    ]
    model.train()
    with torch.no_grad():
        model(Pipeline().plain(images))
    for h in hooks:
        h.remove()
    for name, x in seen.items():
        x = x.double()
        assert torch.equal(sums[name]["sum"], x.sum(dim=(0, 2, 3))), name
        assert torch.equal(sums[name]["sumsq"], (x * x).sum(dim=(0, 2, 3))), name


def test_sbn_sums_add_up_across_parties() -> None:
    model = _bn_model()
    images = _images(30, seed=1)
    pipeline = InputPipeline(INFO, torch.device("cpu"))
    whole = bn_sums(model, pipeline, images, torch.arange(30), batch_size=10)
    parts = [bn_sums(model, pipeline, images, torch.arange(i, i + 10), batch_size=10) for i in (0, 10, 20)]
    merged = merge_bn_sums(parts)
    for name in whole:
        for key in ("sum", "sumsq", "count"):
            assert torch.allclose(merged[name][key], whole[name][key]), (name, key)
    # the first layer's input does not depend on batching: its mean is that of conv1(x)
    x = model.conv1(pipeline.plain(images)).detach().double()
    mean = apply_bn_sums(model.state_dict(), merged)["norm1.running_mean"]
    assert torch.allclose(mean.double(), x.mean(dim=(0, 2, 3)), atol=1e-5)


def test_sbn_is_a_no_op_for_groupnorm() -> None:
    model = build_model("cnn28", num_classes=3, in_channels=1, image_size=8, norm="gn")
    pipeline = InputPipeline(INFO, torch.device("cpu"))
    assert bn_sums(model, pipeline, _images(8), torch.arange(8), batch_size=8) == {}


# ---- the algorithm's protocol ---------------------------------------------------------------------
def _algo(**kw) -> SemiFL:
    images = _images(60, seed=2)
    labels = torch.randint(0, 3, (60,), generator=torch.Generator().manual_seed(5))
    server = ServerData(
        images=images, labels=labels, labeled_idx=torch.arange(0, 12), val_idx=torch.arange(0), num_classes=3
    )
    algo = SemiFL(
        SemiFLConfig(**kw),
        lambda: build_model("cnn28", num_classes=3, in_channels=1, image_size=8, norm="bn"),
        server,
        INFO,
        TrainSettings(local_steps=2, batch_size=8, comm_round=3),
        torch.device("cpu"),
        0,
    )
    algo.setup()
    return algo


def test_empty_fix_set_sends_nothing_and_the_server_copes() -> None:
    algo = _algo(threshold=1.0)  # nothing reaches probability 1 from a fresh model
    algo.server_step(0)
    sent = {k: v.clone() for k, v in algo.global_state.items()}
    data = ClientData(
        client_id=0,
        images=algo.server_data.images,
        labels=algo.server_data.labels,
        unlabeled_idx=torch.arange(12, 60),
        labeled_idx=torch.arange(0),
        num_classes=3,
    )
    reply = algo.client_update(algo.message_for(0, 0), data, {}, ClientContext(0, torch.device("cpu"), 0))
    assert reply.is_empty and reply.weights == {}
    assert set(reply.extras) == {"metrics"} and reply.extras["metrics"]["mask_rate"] == 0.0
    metrics = algo.aggregate({0: reply, 1: Message()}, 0)
    assert metrics["clients_sent"] == 0.0
    assert algo.momentum_buffer == {}
    for k, v in sent.items():
        assert torch.equal(algo.base_state[k], v)
    algo.finalize()  # still works with nothing received


def test_config_errors_name_the_key() -> None:
    base = {"data_args": {"dataset": "digits"}, "model_args": {"model": "cnn28"}}
    for bad, key in [
        ({"sbn": "global"}, "ssfl_args.sbn"),
        ({"threshold": 1.5}, "ssfl_args.threshold"),
        ({"pseudo_labels": "x"}, "ssfl_args.pseudo_labels"),
        ({"mixup_alpha": 0}, "ssfl_args.mixup_alpha"),
        ({"server_momentum": 1.0}, "ssfl_args.server_momentum"),
        ({"local_epochs": 0}, "ssfl_args.local_epochs"),
        ({"server_epochs": -1}, "ssfl_args.server_epochs"),
        ({"server_steps": -1}, "ssfl_args.server_steps"),
        ({"server_batch_size": 0}, "ssfl_args.server_batch_size"),
    ]:
        with pytest.raises(ConfigError, match=key.replace(".", r"\.")):
            validate({**base, "ssfl_args": {"algorithm": "semifl", **bad}})
    cfg = validate({**base, "ssfl_args": {"algorithm": "semifl"}})
    assert cfg.ssfl_args.sbn == "federated" and cfg.ssfl_args.threshold == 0.95
    assert cfg.ssfl_args.mixup_alpha == 0.75 and cfg.ssfl_args.server_momentum == 0.5
    # Algorithm 1's E epochs (the authors' 5) for server and clients, not steps
    assert cfg.ssfl_args.server_epochs == 5 and cfg.ssfl_args.server_steps is None
    assert cfg.ssfl_args.local_epochs == 5


# ---- end to end -----------------------------------------------------------------------------------------
def _digits_cfg(tmp_path, rounds: int, **ssfl):
    return validate(
        {
            "common_args": {"output_dir": str(tmp_path), "run_name": "semifl", "compare_with": []},
            "data_args": {"dataset": "digits", "num_server_labels": 30},
            "model_args": {"model": "cnn28", "norm": "bn"},
            "train_args": {
                "client_num_in_total": 4,
                "client_num_per_round": 4,
                "comm_round": rounds,
                "local_steps": 12,
                "batch_size": 32,
                "learning_rate": 0.05,
            },
            "device_args": {"num_threads": 1},
            "tracking_args": {"enable_tensorboard": False, "progress_bar": False, "checkpoint_every": 1},
            # T = 12 client steps (not 5 epochs) and 40 server steps keep these runs short
            "ssfl_args": {"algorithm": "semifl", "server_steps": 40, "local_epochs": None, "threshold": 0.8, **ssfl},
        }
    )


def test_semifl_end_to_end_beats_the_server_alone(tmp_path) -> None:
    # Control: threshold 1 leaves every fix set empty, so no client sends and the same schedule is
    # the server fine-tuning alone (measured 80.2%). SemiFL's clients must add to it (86.9%).
    result = run_local(_digits_cfg(tmp_path, rounds=4), run_dir=tmp_path / "run")
    control = run_local(_digits_cfg(tmp_path, rounds=4, threshold=1.0), run_dir=tmp_path / "control")
    rows = [json.loads(r) for r in (tmp_path / "run" / "metrics.jsonl").read_text().splitlines()]
    control_rows = [json.loads(r) for r in (tmp_path / "control" / "metrics.jsonl").read_text().splitlines()]
    # (round 0's accuracies differ slightly: with federated sBN the clients' sums enter the statistics)
    assert all(r["bytes_up"] == 0 for r in control_rows) and sum(r["bytes_up"] for r in rows) > 0
    assert rows[-1]["client_pseudo_acc"] > 0.9
    assert result.final_acc >= 0.85, (control.final_acc, result.final_acc)
    assert result.final_acc >= control.final_acc + 0.04, (control.final_acc, result.final_acc)


@pytest.mark.parametrize(
    "ssfl",
    [
        {"pseudo_labels": "batch", "sbn": "server"},
        {"fine_tune": False, "final_fine_tune": False, "sbn": "off", "local_epochs": 1},
        {"sbn": "all_data_nonfederated", "nesterov": False},
    ],
)
def test_semifl_ablations_run(tmp_path, ssfl) -> None:
    cfg = _digits_cfg(tmp_path, rounds=2, **ssfl)
    cfg.train_args.local_steps = 3
    cfg.ssfl_args.server_steps = 30
    result = run_local(cfg, run_dir=tmp_path / "run")
    assert result.rounds_completed == 2 and result.final_acc > 0.15  # smoke test: above chance (10%)


def test_semifl_resume_is_exact(tmp_path) -> None:
    cfg = _digits_cfg(tmp_path, rounds=3)
    cfg.train_args.local_steps = 4
    full = run_local(cfg, run_dir=tmp_path / "full")
    run_local(cfg, run_dir=tmp_path / "part", stop_after=2)
    resumed = run_local(cfg, run_dir=tmp_path / "part", resume=True)
    assert resumed.final_acc == full.final_acc
    a = load_checkpoint(tmp_path / "full" / "checkpoints" / "last.pt")["algorithm"]
    b = load_checkpoint(tmp_path / "part" / "checkpoints" / "last.pt")["algorithm"]
    for k, v in a["global_state"].items():
        assert torch.equal(v, b["global_state"][k]), k
    assert a["momentum_buffer"].keys() == b["momentum_buffer"].keys() and a["momentum_buffer"]


def test_uniform_average_not_sample_weighted() -> None:
    # Diao et al.: W_s = 1/M_t sum_m W_m, whatever the clients' data sizes
    algo = _algo(server_momentum=0.0)
    algo.server_step(0)
    sent = algo.global_state
    w1 = {k: (v + 1.0 if v.is_floating_point() else v) for k, v in sent.items()}
    w2 = {k: (v + 3.0 if v.is_floating_point() else v) for k, v in sent.items()}
    algo.aggregate({0: Message(weights=w1, num_samples=1), 1: Message(weights=w2, num_samples=100)}, 0)
    assert torch.allclose(algo.base_state["fc.weight"], sent["fc.weight"] + 2.0, atol=1e-6)


# ---- the mechanisms inside the algorithm's own code path ------------------------------------------
# The tests above check the helpers; these drive server_step / client_update / aggregate / _step
# and fail when the algorithm stops using a mechanism or feeds it the wrong thing.
def _rows_to_ids(batch: torch.Tensor, images: torch.Tensor) -> list[int]:
    """Which rows of ``images`` (uint8, all distinct) make up ``batch``."""
    flat = images.flatten(1)
    return [int((flat == row).all(dim=1).nonzero().item()) for row in batch.flatten(1)]


def _client(algo: SemiFL) -> ClientData:
    sd = algo.server_data
    return ClientData(0, sd.images, sd.labels, torch.arange(12, 60), torch.arange(0), 3)


def _params(algo: SemiFL) -> list[str]:
    return sorted(algo.param_keys)


def test_server_fine_tunes_e_epochs_over_its_labels(monkeypatch) -> None:
    # Algorithm 1, ServerUpdate: E epochs, each a random split of D_s into batches of B_s
    # (12 labels, B = 8: batches of 8 and 4); the default E is the authors' 5
    assert SemiFLConfig().server_epochs == 5 and SemiFLConfig().server_steps is None
    seen: list[list[int]] = []
    original = InputPipeline.weak

    def spy(self, images, generator):
        seen.append(_rows_to_ids(images, algo.server_data.images))
        return original(self, images, generator)

    monkeypatch.setattr(InputPipeline, "weak", spy)
    algo = _algo()
    assert algo.server_steps == 10
    algo.server_step(0)
    assert [len(b) for b in seen] == [8, 4] * 5
    for e in range(5):  # every epoch visits each labeled sample exactly once
        assert sorted(seen[2 * e] + seen[2 * e + 1]) == list(range(12))
    assert seen[0] != seen[2]  # a fresh split each epoch
    # server_steps overrides the epochs with a fixed number of steps
    seen.clear()
    algo = _algo(server_steps=7)
    algo.server_step(0)
    assert algo.server_steps == 7 and [len(b) for b in seen] == [8] * 7


def test_server_fine_tunes_at_its_own_batch_size_b_s(monkeypatch) -> None:
    # Algorithm 1: "server and client respective batch sizes B_s and B_m": server_batch_size is B_s,
    # train_args.batch_size stays the clients' B_m (12 labels at B_s = 5: batches of 5, 5, 2 an epoch)
    seen: list[int] = []
    original = InputPipeline.weak

    def spy(self, images, generator):
        seen.append(len(images))
        return original(self, images, generator)

    monkeypatch.setattr(InputPipeline, "weak", spy)
    algo = _algo(server_batch_size=5, server_epochs=2, threshold=0.0, local_epochs=None)
    assert algo.server_steps == 6 and algo.train.batch_size == 8
    algo.server_step(0)
    assert seen == [5, 5, 2] * 2
    seen.clear()
    data = _client(algo)
    algo.client_update(algo.message_for(0, 0), data, {}, ClientContext(0, torch.device("cpu"), 0))
    # the pseudo-labelling pass over the client's 48 samples, then the mixtures of its T = 2 steps at
    # B_m = 8 (one chunk): the client's batch is B_m, not B_s
    assert seen == [48, 2 * 8]


def test_cosine_annealing_is_the_authors_schedule() -> None:
    """``lr_schedule: cosine_annealing`` is PyTorch's CosineAnnealingLR to 0 stepped per round (the
    SemiFL authors'): lr (1 + cos(pi t / T)) / 2; Eq. 9's cosine with c = 0.5 is another curve."""
    from fedml_ssfl.training import cosine_lr

    t = TrainSettings(learning_rate=0.03, comm_round=10, local_steps=4, lr_schedule="cosine_annealing")
    opt = torch.optim.SGD([torch.zeros(1, requires_grad=True)], lr=0.03)
    sched = torch.optim.lr_scheduler.CosineAnnealingLR(opt, T_max=10, eta_min=0.0)
    for r in range(10):
        assert cosine_lr(t, r * 4) == pytest.approx(sched.get_last_lr()[0], rel=1e-9, abs=1e-12), r
        assert cosine_lr(t, r * 4) == pytest.approx(0.03 * (1 + math.cos(math.pi * r / 10)) / 2)
        opt.step()
        sched.step()
    half = TrainSettings(learning_rate=0.03, comm_round=10, local_steps=4, lr_schedule="cosine", lr_cosine_c=0.5)
    assert cosine_lr(half, 20) == pytest.approx(0.03 * math.cos(math.pi / 4))  # 0.71 lr, not the 0.5 lr above
    assert validate({"train_args": {"lr_schedule": "cosine_annealing"}}).train_args.lr_schedule == "cosine_annealing"


def test_persistent_optimizer_carries_every_partys_momentum_across_rounds() -> None:
    """The authors keep each client's and the server's SGD across rounds (``persistent_optimizer``):
    the client's buffers go into its state and the next round starts from them; without the option
    every round starts fresh (Algorithm 1's plain steps)."""
    ctx0, ctx1 = ClientContext(0, torch.device("cpu"), 0), ClientContext(1, torch.device("cpu"), 0)
    for persistent in (False, True):
        algo = _algo(threshold=0.0, persistent_optimizer=persistent)
        data = _client(algo)
        algo.server_step(0)
        assert bool(algo.fine_tune_momentum) == persistent  # the fine-tune's buffers, kept for round 1
        state: dict = {}
        algo.client_update(algo.message_for(0, 0), data, state, ctx0)
        assert set(state) == ({"momentum"} if persistent else set())
        if persistent:
            assert set(state["momentum"]) == set(algo.param_keys)
        msg = algo.message_for(0, 1)
        carried = algo.client_update(msg, data, dict(state), ctx1)
        fresh = algo.client_update(msg, data, {}, ctx1)
        same = all(torch.equal(carried.weights[k], fresh.weights[k]) for k in carried.weights)
        assert same != persistent  # the carried buffers change the step exactly when the option is on


def test_persistent_optimizer_resumes_exactly(tmp_path) -> None:
    from tests.conftest import resume_matches_uninterrupted

    cfg = _digits_cfg(tmp_path, rounds=3, persistent_optimizer=True, threshold=0.3)
    cfg.train_args.local_steps = 3
    cfg.ssfl_args.server_steps = 4
    full, _ = resume_matches_uninterrupted(cfg, tmp_path)
    assert full["algorithm"]["fine_tune_momentum"] and any("momentum" in s for s in full["client_states"].values())


def test_sbn_recomputes_the_statistics_the_clients_pseudo_label_with() -> None:
    # Sec. 3.4 / Appendix B: after the fine-tune the server sets the BN running statistics of the
    # model it sends from its own data (federated sBN); after the round it pools the clients' sums
    algo = _algo(threshold=0.0, local_epochs=1)
    before = dict(algo.base_state)
    algo.server_step(0)
    tuned = algo._fine_tune(before, 0, "round")  # the same fine-tune again (seeded)
    sd = algo.server_data
    pipeline = InputPipeline(INFO, torch.device("cpu"))
    scratch = build_model("cnn28", num_classes=3, in_channels=1, image_size=8, norm="bn")
    scratch.load_state_dict(tuned)
    server_sums = bn_sums(scratch, pipeline, sd.images, sd.labeled_idx, 8)
    expected = apply_bn_sums(tuned, server_sums)
    msg = algo.message_for(0, 0)
    for k, v in msg.weights.items():
        assert torch.allclose(v.float(), expected[k].float(), atol=1e-5), k
    # the statistics changed: the fine-tune's own running averages are not what is sent
    assert not torch.allclose(tuned["norm1.running_var"], expected["norm1.running_var"], atol=1e-3)

    # the client reports the sums of the received model over its data; the server pools them
    data = _client(algo)
    reply = algo.client_update(msg, data, {}, ClientContext(0, torch.device("cpu"), 0))
    scratch.load_state_dict(msg.weights)
    client_sums = bn_sums(scratch, pipeline, data.images, data.unlabeled_idx, 8)
    for name, entry in client_sums.items():
        for key in ("sum", "sumsq", "count"):
            assert torch.allclose(reply.extras["bn_sums"][name][key], entry[key]), (name, key)
    algo.aggregate({0: reply}, 0)
    pooled = apply_bn_sums(msg.weights, merge_bn_sums([server_sums, client_sums]))
    for name in client_sums:
        for stat in ("running_mean", "running_var"):
            key = f"{name}.{stat}"
            assert torch.allclose(algo.global_state[key], pooled[key], atol=1e-5), key
            assert not torch.allclose(algo.global_state[key], expected[key], atol=1e-4), key


def test_client_fix_set_is_the_confident_samples_of_the_received_model(monkeypatch) -> None:
    # Eq. 2-4: pseudo-labels from the received model (eval mode, running statistics = sBN) on
    # alpha(x); fix = confidence >= tau; mix = |fix| draws with their own pseudo-labels
    algo = _algo(local_epochs=1)
    algo.server_step(0)
    msg = algo.message_for(0, 0)
    data = _client(algo)
    ctx = ClientContext(0, torch.device("cpu"), 0)
    model = build_model("cnn28", num_classes=3, in_channels=1, image_size=8, norm="bn")
    model.load_state_dict(msg.weights)
    model.eval()
    pipeline = InputPipeline(INFO, torch.device("cpu"))
    with torch.no_grad():
        probs = model(pipeline.weak(data.images[data.unlabeled_idx], ctx.generator(0))).softmax(dim=1)
    conf, pseudo = probs.max(dim=1)
    tau = float(conf.median())
    algo.config.threshold = tau
    expected_fix = {int(data.unlabeled_idx[i]) for i in torch.nonzero(conf >= tau).flatten()}
    assert 0 < len(expected_fix) < data.num_unlabeled
    label_of = {int(data.unlabeled_idx[i]): int(pseudo[i]) for i in range(data.num_unlabeled)}

    indices, labels = [], []  # per step: (fix_idx, mix_idx) as views are made, (y_fix, y_mix) as trained
    original_views, original_loss = SemiFL._views, SemiFL._loss

    def spy_views(self, pipeline, images, steps, gen):
        indices.extend((f.clone(), m.clone()) for f, m in steps)
        return original_views(self, pipeline, images, steps, gen)

    def spy_loss(self, model, x_strong, x_weak, y_fix, y_mix, lam):
        labels.append((y_fix.clone(), y_mix.clone()))
        return original_loss(self, model, x_strong, x_weak, y_fix, y_mix, lam)

    monkeypatch.setattr(SemiFL, "_views", spy_views)
    monkeypatch.setattr(SemiFL, "_loss", spy_loss)
    reply = algo.client_update(msg, data, {}, ctx)
    assert not reply.is_empty
    assert len(indices) == len(labels) > 1
    calls = [(f, yf, m, ym) for (f, m), (yf, ym) in zip(indices, labels)]
    assert reply.extras["metrics"]["mask_rate"] == pytest.approx(len(expected_fix) / data.num_unlabeled)
    fixed = [int(i) for c in calls for i in c[0]]
    assert sorted(fixed) == sorted(expected_fix)  # one epoch: each fix sample once
    for fix_idx, y_fix, mix_idx, y_mix in calls:
        assert fix_idx.numel() == mix_idx.numel()
        assert y_fix.tolist() == [label_of[int(i)] for i in fix_idx]
        assert y_mix.tolist() == [label_of[int(i)] for i in mix_idx]
    mixed = {int(i) for c in calls for i in c[2]}
    assert mixed <= set(data.unlabeled_idx.tolist()) and not mixed <= expected_fix


@pytest.mark.parametrize("chunk_values", [2**20, 3 * 8 * 64, 1])
def test_views_made_a_chunk_at_a_time_follow_eq5_step_by_step(monkeypatch, chunk_values) -> None:
    # A client's steps get their views together (one strong and one weak call a chunk of steps):
    # each step still gets A of its own fix batch and alpha of lambda x_fix + (1 - lambda) x_mix
    # with its own lambda (Eq. 5). Augmentation is replaced by normalisation so that each view can
    # be recomputed from its step's indices; chunks of all 30 steps, of 3 and of 1.
    monkeypatch.setattr(InputPipeline, "strong", lambda self, x, gen: self.plain(x))
    monkeypatch.setattr(InputPipeline, "weak", lambda self, x, gen: self.plain(x))
    monkeypatch.setattr(semifl_module, "VIEW_CHUNK_VALUES", chunk_values)
    algo = _algo(threshold=0.0)  # every sample in the fix set: 48 of them, 6 batches of 8 an epoch, 5 epochs
    data = _client(algo)
    pipeline = InputPipeline(INFO, torch.device("cpu"))
    gen = torch.Generator().manual_seed(4)
    sets = fix_mix_sets(torch.softmax(torch.randn(48, 3, generator=gen), dim=1), 0.0, gen)
    ux = data.unlabeled_idx
    label_of = {int(ux[p]): int(y) for p, y in zip(sets.fix, sets.fix_labels)}
    label_of.update({int(ux[p]): int(y) for p, y in zip(sets.mix, sets.mix_labels)})
    chunks, original = [], SemiFL._views

    def spy(self, p, images, steps, g):
        chunks.append(list(steps))
        return original(self, p, images, steps, g)

    monkeypatch.setattr(SemiFL, "_views", spy)
    steps = list(algo._global_label_steps(pipeline, data, sets, gen))
    assert len(steps) == 30 and [len(c) for c in chunks] == {2**20: [30], 1536: [3] * 10, 1: [1] * 30}[chunk_values]
    lams = []
    for (fix_idx, mix_idx), (y_fix, y_mix, (lam, x_strong, x_weak)) in zip([s for c in chunks for s in c], steps):
        assert y_fix.tolist() == [label_of[int(i)] for i in fix_idx]
        assert y_mix.tolist() == [label_of[int(i)] for i in mix_idx]
        assert torch.equal(x_strong, pipeline.plain(data.images[fix_idx]))
        mixed = lam * pipeline.raw(data.images[fix_idx]) + (1 - lam) * pipeline.raw(data.images[mix_idx])
        assert torch.equal(x_weak, pipeline.plain(mixed))
        lams.append(lam)
    assert len(set(lams)) == 30 and all(0 < lam < 1 for lam in lams)


def test_client_step_is_eq5_and_eq6() -> None:
    # One local step replayed by hand: L_fix = CE(f(A(x_fix)), y_fix); x_mix = lam x_fix + (1 -
    # lam) x_mix; L_mix = lam CE(f(alpha(x_mix)), y_fix) + (1 - lam) CE(f(alpha(x_mix)), y_mix);
    # SGD (Nesterov) on L_fix + lambda L_mix with the gradient clipped. Draw order: lam, A, alpha.
    algo = _algo(loss_lambda=0.7, clip_norm=0.5)
    images = algo.server_data.images
    fix_idx, mix_idx = torch.arange(20, 28), torch.tensor([30, 31, 32, 30, 40, 41, 42, 43])
    y_fix = torch.tensor([0, 1, 2, 0, 1, 2, 0, 1])
    y_mix = (y_fix + 1) % 3
    pipeline = InputPipeline(INFO, torch.device("cpu"))
    weights = {k: v.clone() for k, v in algo.global_state.items()}
    seed = 11
    lam = sample_mix_lambda(0.75, torch.Generator().manual_seed(seed))
    assert abs(lam - 0.5) > 0.15  # a swap of the two label terms changes the loss

    model = algo.scratch_model(weights, torch.device("cpu"))
    model.train()
    opt = algo.make_sgd(model, 0.1)
    step = algo._step(model, pipeline, images, fix_idx, y_fix, mix_idx, y_mix, torch.Generator().manual_seed(seed))
    optimizer_step(opt, step.loss, 0, "t", algo.config.clip_norm)  # what the client's step loop does with it
    loss, got_lam = float(step.loss.detach()), step.metrics["mix_lambda"]
    assert got_lam == lam

    ref = build_model("cnn28", num_classes=3, in_channels=1, image_size=8, norm="bn")
    ref.load_state_dict(weights)
    ref.train()
    gen = torch.Generator().manual_seed(seed)
    sample_mix_lambda(0.75, gen)
    x_strong = pipeline.strong(images[fix_idx], gen)
    x_mixed = lam * pipeline.raw(images[fix_idx]) + (1 - lam) * pipeline.raw(images[mix_idx])
    x_weak = pipeline.weak(x_mixed, gen)
    logits_fix, logits_mix = ref(x_strong), ref(x_weak)
    loss_fix = F.cross_entropy(logits_fix, y_fix)
    loss_mix = lam * F.cross_entropy(logits_mix, y_fix) + (1 - lam) * F.cross_entropy(logits_mix, y_mix)
    total = loss_fix + 0.7 * loss_mix
    assert loss == pytest.approx(total.item(), rel=1e-5)
    total.backward()
    norm = torch.sqrt(sum(p.grad.pow(2).sum() for p in ref.parameters()))
    assert norm > 0.5  # clipping is active
    nn.utils.clip_grad_norm_(ref.parameters(), 0.5)
    t = algo.train
    torch.optim.SGD(ref.parameters(), lr=0.1, momentum=t.momentum, weight_decay=t.weight_decay, nesterov=True).step()
    got = dict(model.named_parameters())
    for name, p in ref.named_parameters():
        assert torch.allclose(got[name], p, atol=1e-6), name


def test_server_momentum_carries_across_rounds() -> None:
    # The authors' global SGD (lr 1, momentum 0.5) on g = w_sent - w_avg: round 0 moves to the
    # average (buf = g); round 1 moves by 0.5 buf + g, past the average. Momentum 0 is Algorithm 1.
    def shifted(state, c):
        return {k: (v + c if v.is_floating_point() else v.clone()) for k, v in state.items()}

    for momentum, overshoot in [(0.5, 2.5), (0.0, 2.0)]:
        algo = _algo(server_momentum=momentum)
        algo.server_step(0)
        sent0 = algo.global_state
        algo.aggregate({0: Message(weights=shifted(sent0, 1.0), num_samples=5)}, 0)
        for k in _params(algo):
            assert torch.allclose(algo.base_state[k], sent0[k] + 1.0, atol=1e-5), k
        algo.server_step(1)
        sent1 = algo.global_state
        replies = {0: Message(weights=shifted(sent1, 1.0), num_samples=5), 1: Message(weights=shifted(sent1, 3.0))}
        algo.aggregate(replies, 1)
        for k in _params(algo):
            assert torch.allclose(algo.base_state[k], sent1[k] + overshoot, atol=1e-5), (momentum, k)
            assert torch.allclose(algo.state_dict()["momentum_buffer"][k], torch.full_like(sent1[k], -overshoot))


# ---- Table 2's ablations as the authors ran them (issue 37) -------------------------------------------
def _shifted(state: dict[str, torch.Tensor], by: float) -> dict[str, torch.Tensor]:
    return {k: (v + by if v.is_floating_point() else v.clone()) for k, v in state.items()}


@pytest.mark.parametrize("weight", [0.5, None])
def test_parallel_server_is_half_of_the_average_as_the_authors(weight) -> None:
    # fine_tune: false (Table 2): the authors' update_parallel weighs the parallel server 1/2 and the M_t
    # clients 1/(2 M_t) each; null: the server is one of M_t + 1 equal models. Plain average (momentum 0).
    algo = _algo(fine_tune=False, server_momentum=0.0, parallel_server_weight=weight)
    algo.server_step(0)
    parallel, sent = algo._parallel_state, algo.global_state
    assert parallel is not None
    w1, w2 = _shifted(sent, 1.0), _shifted(sent, 4.0)
    algo.aggregate({0: Message(weights=w1, num_samples=5), 1: Message(weights=w2, num_samples=50)}, 0)
    k = "fc.weight"
    if weight == 0.5:  # 1/2 P + 1/4 w1 + 1/4 w2
        expected = 0.5 * parallel[k] + 0.25 * w1[k] + 0.25 * w2[k]
    else:  # (P + w1 + w2) / 3
        expected = (parallel[k] + w1[k] + w2[k]) / 3.0
    assert torch.allclose(algo.base_state[k], expected, atol=1e-6)
    # no client sent: the server's model alone (weight 1)
    algo.server_step(1)
    parallel = algo._parallel_state
    algo.aggregate({0: Message()}, 1)
    assert torch.allclose(algo.base_state[k], parallel[k], atol=1e-6)


def test_parallel_server_weight_is_checked() -> None:
    base = {"data_args": {"dataset": "digits"}, "model_args": {"model": "cnn28"}}
    for bad in (0.0, 1.0, 1.5):
        with pytest.raises(ConfigError, match=r"ssfl_args\.parallel_server_weight"):
            validate({**base, "ssfl_args": {"algorithm": "semifl", "parallel_server_weight": bad}})
    with pytest.raises(ConfigError, match=r"ssfl_args\.batch_loss"):
        validate({**base, "ssfl_args": {"algorithm": "semifl", "batch_loss": "mix"}})
    cfg = validate({**base, "ssfl_args": {"algorithm": "semifl"}})
    assert cfg.ssfl_args.parallel_server_weight == 0.5 and cfg.ssfl_args.batch_loss == "fix"


@pytest.mark.parametrize("batch_loss", ["fix", "fix_mix"])
def test_batch_pseudo_labels_train_l_fix_only_as_the_authors(monkeypatch, batch_loss) -> None:
    # pseudo_labels: batch (Table 2) as the authors' fix-batch: each batch is pseudo-labelled by the model
    # being trained (weak view), then one step on CE(f(A(x_conf)), y_hat) alone: no mixup term, and the
    # only weak views are the pseudo-labelling passes (fix_mix adds the mixtures' weak views and L_mix).
    mix_calls: list[int] = []
    weak_sizes: list[int] = []
    original_mix, original_weak = semifl_module.mixup_loss, InputPipeline.weak

    def mix_spy(*args, **kw):
        mix_calls.append(1)
        return original_mix(*args, **kw)

    def weak_spy(self, images, generator):
        weak_sizes.append(len(images))
        return original_weak(self, images, generator)

    monkeypatch.setattr(semifl_module, "mixup_loss", mix_spy)
    monkeypatch.setattr(InputPipeline, "weak", weak_spy)
    algo = _algo(threshold=0.0, pseudo_labels="batch", local_epochs=None, batch_loss=batch_loss, sbn="off")
    algo.server_step(0)
    weak_sizes.clear()
    msg = algo.message_for(0, 0)
    reply = algo.client_update(msg, _client(algo), {}, ClientContext(0, torch.device("cpu"), 0))
    assert not reply.is_empty
    assert any(not torch.equal(reply.weights[k], msg.weights[k]) for k in algo.param_keys)  # it trained
    if batch_loss == "fix":
        assert mix_calls == [] and weak_sizes == [8, 8]  # T = 2 pseudo-labelling passes of B = 8
    else:
        assert len(mix_calls) == 2 and weak_sizes == [8, 8, 8, 8]


def test_persistent_optimizer_keeps_the_parallel_servers_momentum() -> None:
    # The authors keep one server SGD whether it fine-tunes or trains in parallel (fine_tune: false)
    for persistent in (False, True):
        algo = _algo(fine_tune=False, persistent_optimizer=persistent)
        algo.server_step(0)
        assert bool(algo.fine_tune_momentum) == persistent
        if persistent:
            first = {k: v.clone() for k, v in algo.fine_tune_momentum.items()}
            algo.aggregate({0: Message()}, 0)
            algo.server_step(1)
            assert any(not torch.equal(first[k], algo.fine_tune_momentum[k]) for k in first)


@pytest.mark.parametrize("sbn_batch", [None, 5])
def test_sbn_pass_runs_at_its_own_batch(monkeypatch, sbn_batch) -> None:
    # The authors' sBN pass runs at 250 while the clients train at 10: sbn_batch_size sets it for the
    # server's and the clients' sums (null: train_args.batch_size, B_m = 8 here)
    batches: list[int] = []
    original = semifl_module.bn_sums

    def spy(model, pipeline, images, idx, batch_size):
        batches.append(batch_size)
        return original(model, pipeline, images, idx, batch_size)

    monkeypatch.setattr(semifl_module, "bn_sums", spy)
    algo = _algo(threshold=0.0, sbn_batch_size=sbn_batch)
    algo.server_step(0)
    algo.client_update(algo.message_for(0, 0), _client(algo), {}, ClientContext(0, torch.device("cpu"), 0))
    assert batches == [sbn_batch or 8] * 2  # the server's sums, then the client's
