"""A FedML script's own model as the algorithms' model factory.

A FedML script builds its ``nn.Module`` and passes it to ``FedMLRunner``; the algorithms need a
factory of fresh copies (the global model, the clients' working copies, EMA / target nets,
FedMatch's ``sigma + psi``). :func:`script_model_factory` checks the module once
(:func:`~fedml_ssfl.models.head.check_classifier`: it must map the data's images to logits of its
class count) and returns a factory of deep copies on the CPU, in training mode, with the script's
initial weights. Where the script's data are flat vectors (FedML's MNIST ``lr`` data), the
algorithms still handle them as images (augmentation needs pixels) and each copy flattens its input
back to the vectors the module was written for, in a forward pre-hook.

A module whose forward returns more than the logits (``(logits, embedding)``, or a dict) names
them with ``model_args.logits`` (:func:`select_logits`): a position in the tuple (``0``) or a
key of the dict (``"logits"``); a forward hook then hands every caller (the algorithms, the
evaluation, the head finder, the export) that output alone, and the state dict is unchanged.

What a run records so that its checkpoint stands alone (:func:`norm_kind`, :func:`class_path`,
:func:`input_shape`) and how ``fedml-ssfl export`` builds a script's model again
(:func:`import_model`) are here too.
"""

from __future__ import annotations

import copy
import importlib
import inspect
import sys
from collections.abc import Callable
from functools import partial
from pathlib import Path
from typing import Any

import torch
from torch import nn

from ..errors import ConfigError
from .head import check_classifier


def _reshape_input(shape: tuple[int, ...], _module: nn.Module, args: tuple) -> tuple:
    x, *rest = args
    return (x.reshape(x.shape[0], *shape), *rest)


def _pick(selector: int | str, _module: nn.Module, _args: tuple, output: Any) -> Any:
    """The forward hook of :func:`select_logits`: the named output of the module."""
    try:
        return output[selector]
    except (KeyError, IndexError, TypeError):
        what = f"a {type(output).__name__}" + (f" of {len(output)}" if isinstance(output, (tuple, list)) else "")
        have = f" (keys: {', '.join(map(repr, output))})" if isinstance(output, dict) else ""
        raise ConfigError(
            f"model_args.logits {selector!r}: the model returns {what}{have} with no such entry; name the logits by "
            "their position in the tuple (0) or their key in the dict"
        ) from None


def select_logits(model: nn.Module, selector: int | str) -> nn.Module:
    """``model`` returning only the output ``selector`` names (``model_args.logits``); ``""``: unchanged.

    A forward hook replaces the output, so every caller gets the logits tensor and the state dict keeps
    its keys; deep copies keep the hook. Returns ``model`` itself.
    """
    if selector == "" or selector is None:
        return model
    if isinstance(selector, str) and selector.lstrip("-").isdigit():
        selector = int(selector)  # --set model_args.logits=0 on a shell, or "0" in YAML
    model.register_forward_hook(partial(_pick, selector))
    return model


def norm_kind(module: nn.Module) -> str:
    """The normalisation layers ``module`` holds, as run names spell them: ``bn``, ``gn``, ``ln``, ``in``
    (several joined by ``+``, e.g. ``bn+gn``), or ``none``."""
    kinds = {
        "bn": nn.modules.batchnorm._BatchNorm,
        "gn": nn.GroupNorm,
        "ln": nn.LayerNorm,
        "in": nn.modules.instancenorm._InstanceNorm,
    }
    found = [name for name, cls in kinds.items() if any(isinstance(m, cls) for m in module.modules())]
    return "+".join(found) or "none"


def class_path(module: nn.Module) -> tuple[str, str]:
    """``(module.Class, file)``: where ``module``'s class can be imported from, and the file defining it.

    A class defined in the script that was run (``__main__``, or a file loaded by path) is named after the
    script's file (``my_script.MyNet``): importable from the script's folder when the script guards its run with
    ``if __name__ == "__main__":``, as FedML's examples do. ``file`` is ``""`` when unknown.
    """
    cls = type(module)
    try:
        file = inspect.getsourcefile(cls) or ""
    except TypeError:  # a module loaded by path and not in sys.modules: its forward's code knows the file
        code = getattr(getattr(cls, "forward", None), "__code__", None)
        file = code.co_filename if code is not None and Path(code.co_filename).is_file() else ""
    name = cls.__module__
    if file and (name == "__main__" or name not in sys.modules):  # the script run, or a file loaded by path
        name = Path(file).stem
    return f"{name}.{cls.__qualname__}", str(Path(file).resolve()) if file else ""


def input_shape(model: nn.Module) -> tuple[int, ...] | None:
    """The sample shape a script's module takes when it is not ``(C, s, s)`` (its reshape pre-hook), else None."""
    for hook in model._forward_pre_hooks.values():
        if isinstance(hook, partial) and hook.func is _reshape_input:
            return tuple(hook.args[0])
    return None


def import_model(spec: str, folders: tuple[str, ...] = ()) -> nn.Module:
    """The module ``spec`` names, built: ``package.module:Name`` or ``package.module.Name``, a class or a
    function called with no arguments (write one that passes the class its arguments).

    ``folders`` are tried as import roots after ``sys.path`` (the folder of the script a run recorded).

    Raises
    ------
    ConfigError
        The module cannot be imported, has no such name, the call fails or does not return an ``nn.Module``.
    """
    mod_name, sep, attr = spec.partition(":")
    if not sep:
        mod_name, _, attr = spec.rpartition(".")
    if not mod_name or not attr:
        raise ConfigError(f"--model {spec!r}: give MODULE:NAME, e.g. my_script:MyNet (a class or a function)")
    added = [f for f in folders if f and f not in sys.path]
    sys.path.extend(added)
    try:
        module = importlib.import_module(mod_name)
    except Exception as exc:  # the user's module may raise anything at import
        raise ConfigError(
            f"--model {spec!r}: cannot import {mod_name} ({type(exc).__name__}: {exc}); put its folder on PYTHONPATH"
        ) from None
    finally:
        for f in added:
            sys.path.remove(f)
    target = module
    for part in attr.split("."):
        target = getattr(target, part, None)
        if target is None:
            raise ConfigError(f"--model {spec!r}: {mod_name} has no {attr}")
    try:
        built = target()
    except Exception as exc:
        raise ConfigError(
            f"--model {spec!r}: calling {attr}() failed ({type(exc).__name__}: {exc}); name a function that builds "
            "the model with its arguments"
        ) from None
    if not isinstance(built, nn.Module):
        raise ConfigError(f"--model {spec!r}: {attr}() returned {type(built).__name__}, not a torch nn.Module")
    return built


def script_model_factory(
    module: nn.Module,
    num_classes: int,
    in_channels: int,
    image_size: int,
    sample_shape: tuple[int, ...],
    logits: int | str = "",
) -> Callable[[], nn.Module]:
    """Fresh copies of ``module`` for the algorithms, after checking it can be trained on the data.

    Parameters
    ----------
    module : nn.Module
        The script's model, as it passed it (left untouched).
    num_classes, in_channels, image_size : int
        What the data holds.
    sample_shape : tuple of int
        One sample as the script's loaders give it: ``(C, s, s)``, ``(s, s)`` or ``(C * s * s,)``.
    logits : int or str
        ``model_args.logits``: which output of a tuple or dict is the logits (``""``: the output itself).

    Raises
    ------
    ConfigError
        The module does not map the data to ``(N, num_classes)`` logits, has no trainable parameter,
        or no layer with parameters produces the logits (one line naming what is missing).
    """
    template = copy.deepcopy(module).to("cpu").train()
    if tuple(sample_shape) != (in_channels, image_size, image_size):
        template.register_forward_pre_hook(partial(_reshape_input, tuple(sample_shape)))
    select_logits(template, logits)
    check_classifier(template, num_classes, in_channels, image_size, f"the script's model {type(module).__name__}")

    def build() -> nn.Module:
        with torch.no_grad():
            return copy.deepcopy(template)

    return build


def script_model_name(module: nn.Module) -> str:
    """How ``model_args.model`` records a script's model: ``script:<class name>`` (not a registry name)."""
    return f"{SCRIPT_MODEL_PREFIX}{type(module).__name__}"


SCRIPT_MODEL_PREFIX = "script:"
"""``model_args.model`` of a run that trained a FedML script's own module: ``script:<class name>``."""
