"""``device_args.autocast`` (fedml_ssfl/models/precision.py): bf16 forward passes, float32 everything else.

The GPU path's code run on CPU at tiny sizes: ``off`` is bit for bit the code without the key; under
``bf16`` the convolutions and linear layers compute in bfloat16 in every pass of every algorithm
(local steps, the server's steps, no-gradient passes, the stacked clients' vmapped objective,
evaluation) while the models' outputs, weights and optimiser state stay float32; a bf16 run still
trains; the stacked path matches the one-after-another path; bad values are refused.
"""

from __future__ import annotations

import copy
import math
import pickle

import pytest
import torch
from torch import nn
from torch.nn.modules import module as module_hooks

from fedml_ssfl import experiment
from fedml_ssfl.config import CHOICES, ConfigError
from fedml_ssfl.experiment import build_experiment, resolve_device
from fedml_ssfl.metrics import evaluate
from fedml_ssfl.models.cnn import CNN28
from fedml_ssfl.models.precision import AUTOCAST_CHOICES, apply_precision, check_autocast_device, to_float32
from fedml_ssfl.runtime.local import run_round
from tests.conftest import assert_same_state
from tests.test_stacked import CASES, SIZE, max_diff

TINY = [
    "train_args.client_num_in_total=2",
    "train_args.client_num_per_round=2",
    "train_args.local_steps=1",
    "train_args.batch_size=8",
    "model_args.norm=bn",
]
EXTRA = {
    # an untrained model is never 0.95-sure: its clients would not train; one step, not 5 epochs
    "semifl": ["ssfl_args.threshold=0.0", "ssfl_args.local_epochs=null", "ssfl_args.server_steps=1"],
    "fedseal": ["data_args.num_server_val=20"],
}


class DtypeLog:
    """Output dtypes, by phase, of every forward of a Conv2d / Linear (a global hook) and of every
    model the experiment builds (a hook added after the model's own: what its caller receives)."""

    def __init__(self, monkeypatch: pytest.MonkeyPatch) -> None:
        self.layers: dict[str, set[torch.dtype]] = {}
        self.models: dict[str, set[torch.dtype]] = {}
        self.phase = "train"
        real = experiment.apply_precision

        def logged(model: nn.Module, choice: str) -> nn.Module:
            model = real(model, choice)
            model.register_forward_hook(self.model_output)
            return model

        monkeypatch.setattr(experiment, "apply_precision", logged)

    def layer_output(self, module: nn.Module, args, output) -> None:
        if isinstance(module, (nn.Conv2d, nn.Linear)):
            self.layers.setdefault(self.phase, set()).add(output.dtype)

    def model_output(self, module: nn.Module, args, output) -> None:
        self.models.setdefault(self.phase, set()).add(output.dtype)

    def __enter__(self) -> DtypeLog:
        self.handle = module_hooks.register_module_forward_hook(self.layer_output)
        return self

    def __exit__(self, *exc) -> None:
        self.handle.remove()


def rounds(cfg, n: int = 2, log: DtypeLog | None = None):
    """``n`` rounds of ``cfg``, then evaluation of the global model on the test set."""
    if log is not None:
        log.phase = "build"  # a float32 probe of the model (its classifier head) while the experiment is built
    exp = build_experiment(cfg)
    exp.algorithm.setup()
    start = {k: v.clone() for k, v in exp.algorithm.global_state.items()}
    states = {k: {} for k in range(cfg.train_args.client_num_in_total)}
    if log is not None:
        log.phase = "train"
    rows = [run_round(exp, r, states) for r in range(n)]
    for row in rows:
        row.pop("seconds")
    if log is not None:
        log.phase = "eval"
    ev = evaluate(
        exp.algorithm.global_model(), exp.dataset.test_images, exp.dataset.test_labels, exp.data_info, exp.device
    )
    return exp, start, states, rows, ev


def full_precision(tree, path: str = "") -> int:
    """Assert no floating tensor in a nested structure is bfloat16 or float16; returns how many there were."""
    if isinstance(tree, torch.Tensor):
        if tree.is_floating_point():
            assert tree.dtype in (torch.float32, torch.float64), path
            return 1
        return 0
    if isinstance(tree, dict):
        return sum(full_precision(v, f"{path}.{k}") for k, v in tree.items())
    if isinstance(tree, (list, tuple)):
        return sum(full_precision(v, f"{path}[{i}]") for i, v in enumerate(tree))
    return 0


# (1) off is the code without the key, bit for bit -------------------------------------------------------
def test_off_is_bit_identical_to_the_code_without_autocast(small_config, monkeypatch):
    default = rounds(small_config("ssfl_args.algorithm=fedavg_ssl", *TINY))
    explicit = rounds(small_config("ssfl_args.algorithm=fedavg_ssl", *TINY, "device_args.autocast=off"))
    monkeypatch.setattr(experiment, "apply_precision", lambda model, choice: model)  # the code before the key
    before = rounds(small_config("ssfl_args.algorithm=fedavg_ssl", *TINY))
    for run in (default, explicit):
        assert_same_state(run[0].algorithm.state_dict(), before[0].algorithm.state_dict())
        assert_same_state(run[2], before[2])
        assert run[3] == before[3] and run[4] == before[4]
    assert default[0].config.device_args.autocast == "off"


def test_off_leaves_the_model_untouched():
    model = CNN28(num_classes=3, in_channels=1, norm="bn")
    assert apply_precision(model, "off") is model
    assert "forward" not in vars(model) and not hasattr(model, "autocast_precision")
    assert not any(m._forward_pre_hooks or m._forward_hooks for m in model.modules())


def test_a_bf16_model_deep_copies_and_pickles_with_its_precision():
    model = apply_precision(CNN28(num_classes=3, in_channels=1, norm="bn"), "bf16")
    seen: list[torch.dtype] = []
    for twin in (copy.deepcopy(model), pickle.loads(pickle.dumps(model))):
        assert twin.forward.args[1] is twin  # its own forward, not the original's
        twin.conv1.register_forward_hook(lambda m, a, out: seen.append(out.dtype))
        assert twin(torch.randn(2, 1, 28, 28)).dtype == torch.float32
    assert seen == [torch.bfloat16, torch.bfloat16]


# (2) bf16: convolutions and linear layers in bf16 in every pass, weights / optimiser state float32 --------
@pytest.mark.parametrize("algorithm", ["fedavg_ssl", "semifl", "fedmatch", "fedsiam", "fedseal", "fedavg_sl"])
def test_bf16_layers_compute_in_bf16_and_models_return_float32(small_config, monkeypatch, algorithm):
    cfg = small_config(
        f"ssfl_args.algorithm={algorithm}", *TINY, *EXTRA.get(algorithm, []), "device_args.autocast=bf16"
    )
    with DtypeLog(monkeypatch) as log:
        exp, start, states, rows, ev = rounds(cfg, n=2, log=log)
    # training (clients and server, with and without gradient) and evaluation: every conv / linear in bf16
    assert log.layers == {"train": {torch.bfloat16}, "eval": {torch.bfloat16}}, log.layers
    # what the losses, softmax and thresholds see: float32 logits
    assert log.models == {"train": {torch.float32}, "eval": {torch.float32}}, log.models
    assert full_precision(exp.algorithm.state_dict()) > 0  # weights (and FedSiam's targets, etc.)
    full_precision(states)  # the clients' own state: momentum buffers, models
    assert math.isfinite(ev["loss"]) and math.isfinite(rows[-1].get("client_loss", 0.0))


def test_bf16_optimizer_state_and_gradients_stay_float32():
    model = apply_precision(CNN28(num_classes=3, in_channels=1, norm="bn"), "bf16")
    opt = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9)
    x, y = torch.randn(4, 1, 28, 28), torch.tensor([0, 1, 2, 0])
    logits = model(x)
    assert logits.dtype == torch.float32
    nn.functional.cross_entropy(logits, y).backward()
    opt.step()
    assert all(p.dtype == torch.float32 and p.grad.dtype == torch.float32 for p in model.parameters())
    assert all(s["momentum_buffer"].dtype == torch.float32 for s in opt.state.values()) and opt.state
    assert not torch.is_autocast_enabled("cpu")  # the forward closed its autocast region


def test_autocast_region_closes_when_the_forward_raises():
    model = apply_precision(CNN28(num_classes=3, in_channels=1, norm="bn"), "bf16")
    with pytest.raises(RuntimeError):
        model(torch.randn(2, 5, 28, 28))  # wrong channel count
    assert not torch.is_autocast_enabled("cpu")
    assert model(torch.randn(2, 1, 28, 28)).dtype == torch.float32


def test_outputs_cast_to_float32_in_nested_structures():
    half = torch.zeros(2, dtype=torch.bfloat16)
    out = to_float32({"a": (half, [half, torch.zeros(1, dtype=torch.long)])})
    assert out["a"][0].dtype == torch.float32 and out["a"][1][0].dtype == torch.float32
    assert out["a"][1][1].dtype == torch.long


# (3) a bf16 run still trains, near fp32 --------------------------------------------------------------
def test_bf16_run_trains_close_to_fp32_on_digits(small_config):
    opts = ["ssfl_args.algorithm=fedavg_sl", "model_args.norm=bn", "train_args.local_steps=8"]
    exp16, start, _, rows16, ev16 = rounds(small_config(*opts, "device_args.autocast=bf16"))
    exp32, _, _, rows32, ev32 = rounds(small_config(*opts))
    w16, w32 = exp16.algorithm.global_state, exp32.algorithm.global_state
    moved = max(float((w16[k] - start[k]).abs().max()) for k in w16 if w16[k].is_floating_point())
    assert moved > 1e-2  # it trained
    assert all(math.isfinite(r["client_loss"]) for r in rows16)
    assert ev32["acc"] > 0.3  # fp32 learned something in two rounds, so the comparison means something
    assert abs(ev16["acc"] - ev32["acc"]) <= 0.1, (ev16, ev32)
    assert max_diff(w16, w32) > 1e-4  # and it did compute in bf16: not the fp32 run


# (4) the stacked clients under bf16 match the one-after-another clients under bf16 -------------------------
@pytest.mark.parametrize("case", ["fedavg_sl-gn", "fedavg_sl-bn", "fedavg_fixmatch-bn"])
def test_stacked_bf16_equals_one_after_another_bf16(small_config, monkeypatch, case):
    def run(stack: bool, autocast: str, log: DtypeLog | None = None):
        cfg = small_config(
            *SIZE, *CASES[case], f"train_args.stack_clients={str(stack).lower()}", f"device_args.autocast={autocast}"
        )
        return rounds(cfg, log=log)

    with DtypeLog(monkeypatch) as log:
        stacked = run(True, "bf16", log)
    plain = run(False, "bf16")
    assert log.layers["train"] == {torch.bfloat16}  # the vmapped objective ran in bf16
    assert max_diff(stacked[0].algorithm.state_dict(), plain[0].algorithm.state_dict()) <= 2e-2
    assert max_diff(stacked[3], plain[3]) <= 2e-2  # client metrics
    stacked32 = run(True, "off")
    assert max_diff(stacked[0].algorithm.state_dict(), stacked32[0].algorithm.state_dict()) > 1e-4


# (5) bad values -------------------------------------------------------------------------------------------
@pytest.mark.parametrize("value", ["fp16", "bfloat16", "on", "true", "1"])
def test_bad_autocast_values_are_refused_in_one_line(small_config, value):
    with pytest.raises(ConfigError) as err:
        small_config(f"device_args.autocast={value}")
    msg = str(err.value)
    assert "\n" not in msg and "device_args.autocast" in msg, msg
    if value in ("fp16", "bfloat16"):
        assert "off, bf16" in msg, msg


def test_yaml_off_reads_as_off(small_config):
    assert CHOICES["device_args.autocast"] == AUTOCAST_CHOICES  # the config's check is the module's
    assert small_config("device_args.autocast=off").device_args.autocast == "off"
    assert small_config("device_args.autocast=bf16").device_args.autocast == "bf16"


def test_bf16_on_a_gpu_without_bfloat16_is_refused(small_config, monkeypatch):
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "is_bf16_supported", lambda including_emulation=True: False)
    monkeypatch.setattr(torch.cuda, "get_device_name", lambda device=None: "Old GPU")
    monkeypatch.setattr(torch.amp, "is_autocast_available", lambda device_type: True)
    cfg = small_config("device_args.device=cuda", "device_args.autocast=bf16")
    with pytest.raises(ConfigError, match=r"device_args\.autocast: Old GPU has no native bfloat16"):
        resolve_device(cfg)
    assert check_autocast_device("off", torch.device("cuda", 0)) is None
    assert check_autocast_device("bf16", torch.device("cpu")) is None
