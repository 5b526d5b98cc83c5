"""The precision a model computes its forward pass in (``device_args.autocast``).

``off`` (the default) leaves the model alone: every pass in float32, as the papers train, bit for
bit the results from before the key. ``bf16`` runs every forward pass of the model under
:func:`torch.autocast` with bfloat16: convolutions and linear layers compute in bfloat16 (autocast's
lower-precision list), the ops autocast keeps in float32 stay there, and the model's floating
outputs are cast back to float32 as the forward returns. So:

- the weights, their gradients and the optimiser's state stay float32 (autocast casts a copy of
  each weight for the op, and its gradient flows back to the float32 weight);
- everything computed from the logits (softmax, cross-entropy, KL, pseudo-label confidences
  compared with thresholds such as 0.95, mixup of predictions, EMA of weights) is float32: the
  autocast region ends with the model's forward, and ``backward`` and the optimiser step run outside
  it, as PyTorch recommends for autocast;
- normalisation layers (BatchNorm, GroupNorm, LayerNorm) compute in float32 (:data:`NORM_LAYERS`);
- it applies wherever the model is called, through the model's ``forward``, set when the model is built
  (``experiment.make_algorithm``'s ``model_fn``), so every algorithm gets it in every pass: local
  steps (``training.run_steps``), the stacked clients' vmapped objective (``stacked``), the server's
  supervised steps, no-gradient passes (pseudo-labels, thresholds, BatchNorm sums, helper
  embeddings) and evaluation (``metrics.evaluate``).

float16 is not offered: it needs gradient scaling (``torch.amp.GradScaler``) in every optimiser
step, the stacked path's functional SGD included. On CUDA bf16 needs a GPU that supports it
(compute capability 8.0 or later; :func:`check_autocast_device`). On CPU bf16 runs everywhere but
is rarely faster; it is there to test the code path.
"""

from __future__ import annotations

from functools import partial
from typing import Any

import torch
from torch import nn

AUTOCAST_CHOICES = ("off", "bf16")
_DTYPES = {"bf16": torch.bfloat16}
_LOW = (torch.bfloat16, torch.float16)


def autocast_dtype(choice: str) -> torch.dtype | None:
    """The dtype ``choice`` computes in (None for ``off``).

    Raises
    ------
    ValueError
        An unknown choice.
    """
    if choice not in AUTOCAST_CHOICES:
        raise ValueError(f"device_args.autocast: {choice!r} is not one of {', '.join(AUTOCAST_CHOICES)}")
    return _DTYPES.get(choice)


def check_autocast_device(choice: str, device: torch.device) -> str | None:
    """Why ``choice`` cannot run on ``device`` (a one-line reason), or None when it can."""
    dtype = autocast_dtype(choice)
    if dtype is None:
        return None
    if not torch.amp.is_autocast_available(device.type):
        return f"device_args.autocast: {choice} is not available on device type {device.type!r}; use 'off'"
    if device.type == "cuda" and not torch.cuda.is_bf16_supported(including_emulation=False):
        name = torch.cuda.get_device_name(device)
        return f"device_args.autocast: {name} has no native bfloat16 (needs compute capability 8.0+); use 'off'"
    return None


def _device_type(module: nn.Module, args: tuple[Any, ...]) -> str:
    for a in args:
        if isinstance(a, torch.Tensor):
            return a.device.type
    p = next(iter(module.parameters()), None)
    return p.device.type if p is not None else "cpu"


def _forward_under_autocast(dtype: torch.dtype, model: nn.Module, *args: Any, **kwargs: Any) -> Any:
    with torch.autocast(_device_type(model, args), dtype=dtype):
        out = type(model).forward(model, *args, **kwargs)
    return to_float32(out)


def to_float32(value: Any) -> Any:
    """``value`` with every bfloat16/float16 tensor in it (nested tuples, lists, dicts) cast to float32."""
    if isinstance(value, torch.Tensor):
        return value.float() if value.dtype in _LOW else value
    if isinstance(value, tuple):
        items = [to_float32(v) for v in value]
        return type(value)(*items) if hasattr(value, "_fields") else tuple(items)
    if isinstance(value, list):
        return [to_float32(v) for v in value]
    if isinstance(value, dict):
        return {k: to_float32(v) for k, v in value.items()}
    return value


NORM_LAYERS = (nn.modules.batchnorm._NormBase, nn.GroupNorm, nn.LayerNorm)
"""Layers that normalise in float32 under autocast: their input is cast up first."""


def _norm_input_to_float32(module: nn.Module, args: tuple[Any, ...]) -> tuple[Any, ...] | None:
    if args and isinstance(args[0], torch.Tensor) and args[0].dtype in _LOW:
        return (args[0].float(), *args[1:])
    return None


def apply_precision(model: nn.Module, choice: str) -> nn.Module:
    """Make ``model``'s forward passes run under ``choice`` (in place; returned).

    ``off`` leaves the model untouched. Otherwise the model's ``forward`` becomes its class's
    ``forward`` run inside :func:`torch.autocast` on the input's device type, its floating outputs
    cast to float32 as it returns (a ``with`` block: closed when the forward raises, and
    :func:`torch.compile` traces it). Forward hooks run outside it: pre-hooks (the input layout) before,
    hooks after, on the float32 outputs. Normalisation layers (:data:`NORM_LAYERS`) compute in
    float32: a pre-hook casts their input up (their statistics and running buffers stay float32, and
    ``torch.func.vmap``'s batch norm, the stacked clients' path, takes no mixed dtypes). The new
    ``forward`` and the hooks are module-level functions and partials: the model still deep-copies
    and pickles.
    """
    dtype = autocast_dtype(choice)
    if dtype is None:
        return model
    for module in model.modules():
        if isinstance(module, NORM_LAYERS):
            module.register_forward_pre_hook(_norm_input_to_float32)
    model.forward = partial(_forward_under_autocast, dtype, model)  # type: ignore[method-assign]
    model.autocast_precision = choice  # type: ignore[assignment]
    return model
