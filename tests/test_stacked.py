"""Stacked clients (``train_args.stack_clients``, fedml_ssfl/stacked.py): the same results as one after another.

The stacked path trains a round's clients together (torch.func.vmap over a functional loss and
gradient, a hand-written SGD step); the one-after-another path is ``torch.optim.SGD`` through
``run_steps``. Both must end with the same models, states and metrics up to floating-point
summation order (1e-4 here), for every algorithm that supports stacking, with GroupNorm and with
BatchNorm (running statistics included). Tiny sizes: the same code a GPU runs.
"""

from __future__ import annotations

import math

import pytest
import torch
from torch import nn

from fedml_ssfl import stacked
from fedml_ssfl.algorithms import fedmatch as fedmatch_module
from fedml_ssfl.algorithms import jobs as algorithm_jobs
from fedml_ssfl.algorithms import semifl as semifl_module
from fedml_ssfl.algorithms.base import NonFiniteLossError
from fedml_ssfl.client_state import ClientStateStore
from fedml_ssfl.config import ConfigError
from fedml_ssfl.contract import DataInfo, TrainSettings
from fedml_ssfl.experiment import build_experiment
from fedml_ssfl.models.cnn import CNN28
from fedml_ssfl.runtime.local import run_round
from fedml_ssfl.stacked import LocalJob, run_job, run_stacked, sgd_update, stack_groups, supervised_job
from fedml_ssfl.training import InputPipeline

TOL = 1e-4

CASES = {
    "fedavg_sl-gn": ["ssfl_args.algorithm=fedavg_sl", "model_args.norm=gn"],
    "fedavg_sl-bn": ["ssfl_args.algorithm=fedavg_sl", "model_args.norm=bn"],
    # labels-at-server FixMatch on flip-and-shift views, BatchNorm
    "fedavg_fixmatch-bn": [
        "ssfl_args.algorithm=fedavg_fixmatch",
        "model_args.norm=bn",
        "ssfl_args.unlabeled_batch_size=12",
        "ssfl_args.weak_view=weak",
        "ssfl_args.threshold=0.15",
    ],
    # labels-at-client UDA (TSA) with FedProx's term
    "fedprox_uda-gn": [
        "ssfl_args.algorithm=fedprox_uda",
        "data_args.label_scenario=client",
        "data_args.num_server_labels=0",
        "ssfl_args.unlabeled_batch_size=12",
        "ssfl_args.mu=0.5",
        "ssfl_args.threshold=0.12",
    ],
    # Nesterov momentum kept by each client across rounds, the clients' own BatchNorm statistics
    "fedavg_ssl-bn": ["ssfl_args.algorithm=fedavg_ssl", "model_args.norm=bn", "ssfl_args.threshold=0.12"],
    # self-training (Eq. 3): the pseudo-label from the eval-mode forward (running statistics), the loss in train mode
    "self_training-bn": [
        "ssfl_args.algorithm=fedavg_ssl",
        "ssfl_args.user_loss=self_training",
        "model_args.norm=bn",
        "ssfl_args.threshold=0.12",
    ],
    # SemiFL's fix + mix steps (the papers' batch-10 setting): BatchNorm, Nesterov, clipping, the round's fixed
    # rate; an untrained model is never 0.95-sure, so a low threshold
    "semifl-bn": [
        "ssfl_args.algorithm=semifl",
        "model_args.norm=bn",
        "ssfl_args.threshold=0.1",
        "ssfl_args.local_epochs=null",
        "ssfl_args.server_steps=2",
    ],
    # ... with the authors' optimiser kept across rounds (each client's Nesterov buffers in its state)
    "semifl-bn-persistent": [
        "ssfl_args.algorithm=semifl",
        "model_args.norm=bn",
        "ssfl_args.threshold=0.1",
        "ssfl_args.local_epochs=null",
        "ssfl_args.server_steps=2",
        "ssfl_args.persistent_optimizer=true",
    ],
    # FedSiam's online net with its EMA target (a Follower, Eq. 9): BatchNorm (the target's own statistics), the
    # step-counted alpha (each client its own within a stack in round 2), per-step beta and the constant rate
    "fedsiam-mt-bn": [
        "ssfl_args.algorithm=fedsiam",
        "data_args.label_scenario=client",
        "data_args.num_server_labels=0",
        "data_args.labels_per_class_client=2",
        "ssfl_args.variant=mt",
        "ssfl_args.ramp_unit=step",
        "model_args.norm=bn",
        "train_args.lr_schedule=constant",
    ],
    # labels-at-server FedSiam-Pi (alpha 0: the target copies), KL consistency, GroupNorm
    "fedsiam-pi-gn": ["ssfl_args.algorithm=fedsiam", "ssfl_args.variant=pi", "ssfl_args.consistency=kl"],
    # FedSEAL's positive (strong view, lambda CE) and negative (complementary) batches from its self-ensemble:
    # class-wise thresholds (GroupNorm), and a fixed low one (BatchNorm); clients whose sets differ in size
    # train in separate stacks
    "fedseal-gn": [
        "ssfl_args.algorithm=fedseal",
        "data_args.num_server_val=40",
        "ssfl_args.bootstrap_steps=20",
        "ssfl_args.theta=0.2",
    ],
    "fedseal-bn": [
        "ssfl_args.algorithm=fedseal",
        "model_args.norm=bn",
        "data_args.num_server_val=40",
        "ssfl_args.bootstrap_steps=20",
        "ssfl_args.theta=0.2",
        "ssfl_args.fixed_threshold=0.3",
    ],
    # FedMatch's disjoint learning: a sigma step (Eq. 4) then a psi step (Eq. 5) a step, two optimisers, the
    # helpers (every round here, from round 1) in eval mode; labels-at-client with BatchNorm and momentum,
    # labels-at-server (psi only) with GroupNorm
    "fedmatch-client-bn": [
        "ssfl_args.algorithm=fedmatch",
        "data_args.label_scenario=client",
        "data_args.num_server_labels=0",
        "data_args.labels_per_class_client=2",
        "model_args.norm=bn",
        "ssfl_args.unlabeled_batch_size=12",
        "ssfl_args.tau=0.2",
        "ssfl_args.helper_interval=1",
        "ssfl_args.momentum=0.5",
        "ssfl_args.lambda_l2=1.0",
        "train_args.weight_decay=0.01",  # sigma's optimiser only
    ],
    "fedmatch-server-gn": [
        "ssfl_args.algorithm=fedmatch",
        "ssfl_args.unlabeled_batch_size=12",
        "ssfl_args.tau=0.2",
        "ssfl_args.helper_interval=1",
    ],
    # ... with Phi averaged over the confident samples (the authors' code; a data-dependent divisor under vmap)
    "fedmatch-server-gn-confident": [
        "ssfl_args.algorithm=fedmatch",
        "ssfl_args.unlabeled_batch_size=12",
        "ssfl_args.tau=0.2",
        "ssfl_args.helper_interval=1",
        "ssfl_args.phi_average=confident",
    ],
    "local_fixmatch-gn": [
        "ssfl_args.algorithm=local_fixmatch",
        "data_args.label_scenario=client",
        "data_args.num_server_labels=0",
        "ssfl_args.unlabeled_batch_size=12",
        "ssfl_args.threshold=0.15",
    ],
}

SIZE = [
    "train_args.client_num_in_total=4",
    "train_args.client_num_per_round=3",
    "train_args.batch_size=10",
    "train_args.local_steps=3",
]


def max_diff(a, b, path: str = "") -> float:
    """The largest absolute difference between two nested structures of tensors and numbers."""
    if isinstance(a, torch.Tensor):
        assert isinstance(b, torch.Tensor) and a.shape == b.shape and a.dtype == b.dtype, path
        if not a.is_floating_point():
            assert torch.equal(a, b), path
            return 0.0
        return float((a - b).abs().max()) if a.numel() else 0.0
    if isinstance(a, dict):
        assert isinstance(b, dict) and a.keys() == b.keys(), (path, set(a) ^ set(b))
        return max([max_diff(a[k], b[k], f"{path}.{k}") for k in a], default=0.0)
    if isinstance(a, (list, tuple)):
        assert len(a) == len(b), path
        return max([max_diff(x, y, f"{path}[{i}]") for i, (x, y) in enumerate(zip(a, b))], default=0.0)
    if isinstance(a, float) and isinstance(b, float):
        if math.isnan(a):
            assert math.isnan(b), path
            return 0.0
        return abs(a - b) / max(1.0, abs(a))
    assert a == b, path
    return 0.0


def moved(a: dict, b: dict) -> float:
    """How far the floating tensors of state dict ``b`` are from ``a`` (max absolute difference)."""
    return max(float((a[k] - b[k]).abs().max()) for k in a if a[k].is_floating_point())


def two_rounds(small_config, overrides: list[str], stack: bool, states=None):
    cfg = small_config(*SIZE, *overrides, f"train_args.stack_clients={str(stack).lower()}")
    exp = build_experiment(cfg)
    exp.algorithm.setup()
    start = {k: v.clone() for k, v in exp.algorithm.global_state.items()}
    if states is None:
        states = {k: {} for k in range(cfg.train_args.client_num_in_total)}
    rows = [run_round(exp, r, states) for r in range(2)]
    for row in rows:
        row.pop("seconds")
    return exp.algorithm.state_dict(), states, rows, start


@pytest.mark.parametrize("case", list(CASES))
def test_stacked_rounds_equal_one_after_another(small_config, case: str) -> None:
    algo_a, states_a, rows_a, start = two_rounds(small_config, CASES[case], stack=False)
    algo_b, states_b, rows_b, _ = two_rounds(small_config, CASES[case], stack=True)
    assert max_diff(algo_a, algo_b) <= TOL
    assert max_diff(states_a, states_b) <= TOL
    assert max_diff(rows_a, rows_b) <= TOL  # client metrics (loss, mask rate, pseudo-label accuracy), bytes
    assert any(k.startswith("client_") for k in rows_b[-1]), rows_b[-1]
    # the clients trained: the models moved far beyond the tolerance
    trained = algo_b.get("client_models") or {0: algo_b["global_state"]}
    assert max(moved(start, w) for w in trained.values()) > 100 * TOL


def test_stacked_states_survive_a_spilling_store(small_config, tmp_path) -> None:
    """Under a tiny state budget the store spills every state it is not handing out; the stacked
    round holds all its clients' states at once, so it must hand them back (momentum, own BN stats)."""
    _, plain, rows_a, _ = two_rounds(small_config, CASES["fedavg_ssl-bn"], stack=True)
    store = ClientStateStore(1, tmp_path / "spill", fresh=range(4))
    _, _, rows_b, _ = two_rounds(small_config, CASES["fedavg_ssl-bn"], stack=True, states=store)
    assert store.spills > 0
    assert max_diff(plain, {k: store[k] for k in plain}) == 0.0
    assert any(plain[k].get("momentum") for k in plain)
    assert max_diff(rows_a, rows_b) == 0.0


@pytest.mark.parametrize(
    ("case", "module", "stacked_name", "plain_owner", "plain_name", "loss_key"),
    [
        ("fedavg_sl-gn", algorithm_jobs, "run_stacked", algorithm_jobs, "run_job", "client_loss"),
        # SemiFL's own step loop
        ("semifl-bn", semifl_module, "run_stacked", semifl_module.SemiFL, "_train", "client_loss"),
        ("fedsiam-mt-bn", algorithm_jobs, "run_stacked", algorithm_jobs, "run_job", "client_loss"),
        ("fedseal-bn", algorithm_jobs, "run_stacked", algorithm_jobs, "run_job", "client_loss"),
        # FedMatch's disjoint learning: two phases a step
        ("fedmatch-client-bn", fedmatch_module, "run_disjoint_stacked", fedmatch_module, "run_disjoint", "client_l2"),
    ],
)
def test_stacking_is_not_bypassed(
    small_config, monkeypatch, case, module, stacked_name, plain_owner, plain_name, loss_key
) -> None:
    """With the option on, the round's clients go through the stacked trainer once, never one after another."""
    calls: list[int] = []
    real = getattr(module, stacked_name)

    def counting(jobs, *args, **kwargs):
        calls.append(len(jobs))
        return real(jobs, *args, **kwargs)

    def refused(*args, **kwargs):
        raise AssertionError("a client trained one after another although train_args.stack_clients is true")

    monkeypatch.setattr(module, stacked_name, counting)
    monkeypatch.setattr(plain_owner, plain_name, refused)
    cfg = small_config(*SIZE, *CASES[case], "train_args.stack_clients=true")
    exp = build_experiment(cfg)
    exp.algorithm.setup()
    row = run_round(exp, 0, {k: {} for k in range(4)})
    assert calls == [3] and row[loss_key] > 0  # the clients trained


def test_clients_that_do_not_train_reply_their_metrics_stacked_too(small_config) -> None:
    """A FedSEAL client whose filter keeps no sample (threshold 1, theta 0) replies its filter metrics
    without training, stacked as alone."""
    case = [*CASES["fedseal-gn"], "ssfl_args.fixed_threshold=1.0", "ssfl_args.theta=0.0"]
    _, _, rows_a, _ = two_rounds(small_config, case, stack=False)
    _, _, rows_b, _ = two_rounds(small_config, case, stack=True)
    assert rows_a == rows_b
    assert rows_b[0]["client_mask_rate"] == rows_b[0]["client_neg_rate"] == 0.0 and rows_b[0]["clients_sent"] == 0


def test_stack_size_bounds_each_stack(small_config, monkeypatch) -> None:
    """``train_args.stack_size: 2`` trains the round's 3 clients as stacks of 2 and 1."""
    sizes: list[int] = []
    real = stacked._train_group

    def counting(jobs, *args, **kwargs):
        sizes.append(len(jobs))
        return real(jobs, *args, **kwargs)

    monkeypatch.setattr(stacked, "_train_group", counting)
    cfg = small_config(
        *SIZE, "ssfl_args.algorithm=fedavg_sl", "train_args.stack_clients=true", "train_args.stack_size=2"
    )
    exp = build_experiment(cfg)
    exp.algorithm.setup()
    run_round(exp, 0, {k: {} for k in range(4)})
    assert sizes == [2, 1]


def test_stacking_off_trains_one_after_another(small_config, monkeypatch) -> None:
    def refused(*args, **kwargs):
        raise AssertionError("stacked although train_args.stack_clients is false")

    monkeypatch.setattr(algorithm_jobs, "run_stacked", refused)
    exp = build_experiment(small_config(*SIZE, "ssfl_args.algorithm=fedavg_sl"))
    exp.algorithm.setup()
    assert run_round(exp, 0, {k: {} for k in range(4)})["clients"] == 3


# ---- the stacked trainer on its own --------------------------------------------------------------


def tiny_jobs(
    sizes: list[int], train: TrainSettings, norm: str, momentum_for: frozenset = frozenset(), clip: float = 0.0
) -> list[LocalJob]:
    """One supervised job per entry of ``sizes`` (samples), on random 8x8 images, each from its own model."""
    gen = torch.Generator().manual_seed(0)
    images = torch.randint(0, 256, (sum(sizes), 1, 8, 8), dtype=torch.uint8, generator=gen)
    labels = torch.randint(0, 3, (sum(sizes),), generator=gen)
    info = DataInfo(num_classes=3, in_channels=1, image_size=8, mean=(0.5,), std=(0.25,), flip=False)
    pipeline = InputPipeline(info, torch.device("cpu"))
    out, start = [], 0
    for i, n in enumerate(sizes):
        torch.manual_seed(10 + i)
        model = CNN28(3, 1, norm)
        weights = {k: v.detach().clone() for k, v in model.state_dict().items()}
        idx = torch.arange(start, start + n)
        start += n
        job = supervised_job(
            pipeline, images, labels, idx, train, torch.Generator().manual_seed(i), f"client {i}", weights
        )
        if i in momentum_for:
            job.momentum = {k: torch.randn_like(v) * 0.1 for k, v in model.named_parameters()}
        job.nesterov, job.clip_norm = train.momentum > 0, clip
        out.append(job)
    return out


def run_job_alone(job: LocalJob, norm: str, train: TrainSettings) -> stacked.JobResult:
    model = CNN28(3, 1, norm)
    model.load_state_dict(job.weights)
    return run_job(job, model, train, 0)


@pytest.mark.parametrize("norm", ["gn", "bn"])
def test_run_stacked_equals_run_job_in_groups(norm: str) -> None:
    """Unequal batches and momentum sets train as separate stacks; clipping and Nesterov match torch's."""
    train = TrainSettings(local_steps=4, batch_size=8, learning_rate=0.05, momentum=0.9, weight_decay=1e-3)
    sizes = [20, 20, 5, 20]  # client 2 has fewer samples than the batch: batch 5; client 3 continues momentum
    alone = [run_job_alone(job, norm, train) for job in tiny_jobs(sizes, train, norm, frozenset({3}), clip=0.5)]
    jobs = tiny_jobs(sizes, train, norm, frozenset({3}), clip=0.5)
    firsts = [job.draw(0) for job in tiny_jobs(sizes, train, norm, frozenset({3}), clip=0.5)]
    assert stack_groups(jobs, firsts) == [[0, 1], [2], [3]]
    assert stack_groups(jobs, firsts, max_stack=1) == [[0], [1], [2], [3]]
    together = run_stacked(jobs, CNN28(3, 1, norm), train, 0)
    for job, a, b in zip(jobs, alone, together):
        assert max_diff(a.weights, b.weights) <= TOL
        assert a.momentum.keys() == b.momentum.keys() and a.momentum
        assert max_diff(a.momentum, b.momentum) <= TOL
        assert a.metrics.keys() == b.metrics.keys() == {"loss"}
        assert max_diff(a.metrics, b.metrics) <= TOL
        assert moved(job.weights, b.weights) > 10 * TOL  # trained
    if norm == "bn":  # the running statistics moved, alike
        assert not torch.equal(together[0].weights["norm1.running_mean"], jobs[0].weights["norm1.running_mean"])


def test_per_step_rates_set_each_step_alone_and_stacked() -> None:
    """A job's rate tuple sets each step's rate: rates (r, 0, 0) without momentum or weight decay end
    where one step at r ends, alone and stacked; a job's float rate is every step's."""
    train = TrainSettings(local_steps=3, batch_size=8, learning_rate=0.05, momentum=0.0, weight_decay=0.0)
    one = TrainSettings(local_steps=1, batch_size=8, learning_rate=0.05, momentum=0.0, weight_decay=0.0)
    first_only = tiny_jobs([20, 20], one, "gn")
    for job in first_only:
        job.lr = 0.3
    reference = [run_job_alone(job, "gn", one) for job in first_only]
    jobs, fresh = tiny_jobs([20, 20], train, "gn"), tiny_jobs([20, 20], train, "gn")
    for job in jobs + fresh:
        job.lr = (0.3, 0.0, 0.0)
    assert jobs[0].rate(train, 4, 0) == 0.3 and jobs[0].rate(train, 4, 1) == 0.0
    alone = [run_job_alone(job, "gn", train) for job in jobs]
    together = run_stacked(fresh, CNN28(3, 1, "gn"), train, 0)
    for ref, a, b in zip(reference, alone, together):
        assert max_diff(ref.weights, a.weights) <= 1e-6 and max_diff(ref.weights, b.weights) <= TOL
        assert moved(first_only[0].weights, a.weights) > 10 * TOL
    fixed = LocalJob("client 0", {}, lambda s: {}, stacked.CrossEntropyLoss(), 3, lr=0.2)
    assert [fixed.rate(train, 4, s) for s in range(3)] == [0.2] * 3


@pytest.fixture(autouse=True)
def _one_thread():
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(threads)


@pytest.mark.parametrize(("momentum", "nesterov", "wd"), [(0.0, False, 0.0), (0.9, False, 1e-2), (0.9, True, 5e-4)])
def test_sgd_update_is_torch_sgd(momentum: float, nesterov: bool, wd: float) -> None:
    """The functional step on stacked tensors gives each client exactly torch.optim.SGD's step."""
    train = TrainSettings(momentum=momentum, weight_decay=wd)
    torch.manual_seed(0)
    models = [nn.Linear(4, 3) for _ in range(2)]
    names = [n for n, _ in models[0].named_parameters()]
    stacked_params = {n: torch.stack([dict(m.named_parameters())[n].detach().clone() for m in models]) for n in names}
    opts = [
        torch.optim.SGD(m.parameters(), lr=0.1, momentum=momentum, weight_decay=wd, nesterov=nesterov) for m in models
    ]
    buffers: dict[str, torch.Tensor] = {}
    for step in range(3):
        grads = {n: torch.randn_like(p) for n, p in stacked_params.items()}
        lr = 0.1 / (step + 1)
        for i, (m, opt) in enumerate(zip(models, opts)):
            for group in opt.param_groups:
                group["lr"] = lr
            for n, p in m.named_parameters():
                p.grad = grads[n][i].clone()
            opt.step()
        sgd_update(stacked_params, grads, buffers, lr, train, nesterov)
        for i, m in enumerate(models):
            for n, p in m.named_parameters():
                assert torch.equal(stacked_params[n][i], p.detach()), (step, n)
    assert bool(buffers) == (momentum > 0)


# ---- refusals ----------------------------------------------------------------------------------


def test_config_refuses_unsupported_algorithms_and_runtimes(small_config) -> None:
    refused = r"^train_args\.stack_clients: algorithm 'server_only'.*supported: .*fedmatch"
    with pytest.raises(ConfigError, match=refused):
        small_config("ssfl_args.algorithm=server_only", "train_args.stack_clients=true")
    for semifl in (["ssfl_args.local_epochs=5"], ["ssfl_args.local_epochs=null", "ssfl_args.pseudo_labels=batch"]):
        with pytest.raises(ConfigError, match=r"^train_args\.stack_clients: semifl trains clients stacked only with"):
            small_config("ssfl_args.algorithm=semifl", *semifl, "train_args.stack_clients=true")
    with pytest.raises(ConfigError, match=r"^train_args\.stack_clients: only the local runtime"):
        small_config(
            "ssfl_args.algorithm=fedavg_sl",
            "train_args.stack_clients=true",
            "comm_args.backend=MPI",
            "common_args.training_type=cross_silo",
        )
    assert small_config("ssfl_args.algorithm=fedavg_sl", "train_args.stack_clients=true").train_args.stack_clients


def test_dropout_is_refused() -> None:
    """Dropout masks are drawn per client from its own stream one after another; stacked, they could not be."""
    with pytest.raises(ConfigError, match=r"train_args\.stack_clients: the model has dropout \(1\)"):
        stacked.refuse_random_layers(nn.Sequential(nn.Linear(2, 2), nn.Dropout(0.5)))
    stacked.refuse_random_layers(nn.Sequential(nn.Linear(2, 2), nn.Dropout(0.0)))


def test_a_dropout_model_is_refused_before_the_run_starts(small_config, tmp_path) -> None:
    """``emnist_cnn`` has dropout: the experiment is not built, so no run folder is made."""
    from fedml_ssfl.runtime.local import run_local

    cfg = small_config(
        "ssfl_args.algorithm=fedavg_sl",
        "data_args.dataset=mnist5k",
        "model_args.model=emnist_cnn",
        "model_args.norm=none",
        "train_args.stack_clients=true",
    )
    with pytest.raises(ConfigError, match=r"train_args\.stack_clients: the model has dropout"):
        build_experiment(cfg)
    with pytest.raises(ConfigError, match=r"the model has dropout"):
        run_local(cfg)
    assert not (tmp_path / "runs").exists() or not any((tmp_path / "runs").iterdir())


def test_non_finite_loss_names_the_client() -> None:
    train = TrainSettings(local_steps=2, batch_size=4, momentum=0.0)
    jobs = tiny_jobs([8, 8, 8], train, "gn")
    scaled = []
    for i, job in enumerate(jobs):
        job.consts = {"scale": torch.tensor(float("inf") if i == 1 else 1.0)}
        scaled.append(job)

    def loss(forward, params, consts, batch, s):
        out, aux = stacked.CrossEntropyLoss()(forward, params, consts, batch, s)
        return out * consts["scale"], aux

    for job in scaled:
        job.loss = loss
    with pytest.raises(NonFiniteLossError, match="on client 1"):
        run_stacked(scaled, CNN28(3, 1, "gn"), train, 0)
