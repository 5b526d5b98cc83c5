"""A run's trained model on its own: what a checkpoint records to use it, and using it from that alone.

Every checkpoint a run writes (``checkpoints/last.pt``, key :data:`CARD_KEY`) and its
``summary.json`` carry the run's **model card**: what the weights need to be used without the
run's data, config or code paths:

``model``, ``label``, ``norm``, ``logits``
    ``model_args.model`` (a registry name, or ``script:<Class>`` for a FedML script's own module),
    the name outputs use (``cnn28-gn``, ``MyNet-bn``: the normalisation layers the module holds),
    and ``model_args.logits`` (which output of a tuple / dict is the logits; ``""``: the output).
``model_class``, ``model_file``
    A script's module only: where its class is imported from (``my_script.MyNet``; a class defined
    in the script that ran is named after the script's file) and that file.
``dataset``, ``num_classes``, ``class_names``, ``in_channels``, ``image_size``, ``input_shape``
    The data the model was trained on: its name (``script_data`` for a script's own list), the
    classes, the image shape ``(C, s, s)`` and the sample shape the module takes (``[784]`` for a
    module written for flat vectors).
``norm_mean``, ``norm_std``
    The per-channel normalisation the run used, as resolved: ``data_args.norm_mean`` / ``norm_std``
    when given, else measured on the (server's) data. The input is uint8 pixels ``/ 255``, then
    ``(x - norm_mean) / norm_std`` per channel (:func:`prepare`).

:func:`load_trained` rebuilds the model from a checkpoint (a registered model by name; a script's
by importing its class, or from a module passed in) and :func:`predict` / :func:`accuracy` apply
it to uint8 images with the recorded normalisation.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
from torch import nn

from .errors import ConfigError

CARD_KEY = "model_card"
"""The checkpoint's (and summary.json's) key of the model card."""

INPUT_RULE = "uint8 pixels (N, C, H, W) / 255, then (x - norm_mean) / norm_std per channel"


def model_card(cfg: Any, exp: Any) -> dict[str, Any]:
    """The model card of the run ``exp`` (its config ``cfg``): see the module docstring."""
    from .experiment import script_data
    from .models.script import SCRIPT_MODEL_PREFIX, class_path, input_shape, norm_kind

    info, data = exp.data_info, exp.dataset
    try:
        model = exp.algorithm.global_model()
    except NotImplementedError:  # the local-only baselines: one model per client
        model = exp.algorithm.evaluation_models()[0]
    norm = norm_kind(model)
    card: dict[str, Any] = {
        "model": cfg.model_args.model,
        "label": label(cfg.model_args.model, cfg.model_args.norm, norm),
        "norm": norm,
        "logits": cfg.model_args.logits,
        "dataset": data.name if script_data(cfg) else cfg.data_args.dataset,  # a script's list: its own name
        "num_classes": int(info.num_classes),
        "class_names": [str(c) for c in data.class_names],
        "in_channels": int(info.in_channels),
        "image_size": int(info.image_size),
        "input_shape": list(input_shape(model) or (info.in_channels, info.image_size, info.image_size)),
        "norm_mean": [float(v) for v in info.mean],
        "norm_std": [float(v) for v in info.std],
        "input": INPUT_RULE,
    }
    if cfg.model_args.model.startswith(SCRIPT_MODEL_PREFIX):
        card["model_class"], card["model_file"] = class_path(model)
    else:
        card["model_norm"] = cfg.model_args.norm  # model_args.norm, to build it again
    return card


def label(model: str, config_norm: str, held: str) -> str:
    """How outputs name a model: ``<model>-<model_args.norm>`` for a registered one, ``<Class>-<norm layers
    held>`` for a script's own (``script:MyNet`` holding BatchNorm: ``MyNet-bn``)."""
    from .models.script import SCRIPT_MODEL_PREFIX

    if model.startswith(SCRIPT_MODEL_PREFIX):
        return f"{model[len(SCRIPT_MODEL_PREFIX) :]}-{held}"
    return f"{model}-{config_norm}"


@dataclass
class Trained:
    """A trained model (eval mode, CPU) and the model card it was rebuilt from."""

    model: nn.Module
    card: dict[str, Any]
    checkpoint: Path


def read_card(payload: dict[str, Any], where: Path | str) -> dict[str, Any]:
    """The model card of a loaded checkpoint.

    Raises
    ------
    ConfigError
        The checkpoint has none (written before cards were recorded): names the run's config as the way.
    """
    card = payload.get(CARD_KEY)
    if not isinstance(card, dict):
        raise ConfigError(
            f"checkpoint {where} carries no {CARD_KEY} (written before runs recorded one): rebuild the model from the "
            "run's config.yaml and give the normalisation the run used (data_args.norm_mean / norm_std)"
        )
    return card


def build_from_card(card: dict[str, Any], module: nn.Module | None = None, model_spec: str = "") -> nn.Module:
    """A fresh model of the card's architecture: ``module`` (a script's, as built), the class ``model_spec``
    names (``module:Name``), the script's class the card records, or the registered model by name.

    Raises
    ------
    ConfigError
        A script's model whose class cannot be imported (names what is needed: ``--model MODULE:NAME``).
    """
    from .models import build_model
    from .models.script import SCRIPT_MODEL_PREFIX, _reshape_input, import_model, select_logits

    name = str(card.get("model", ""))
    if module is None and (model_spec or name.startswith(SCRIPT_MODEL_PREFIX)):
        spec = model_spec or str(card.get("model_class", ""))
        folder = str(Path(card["model_file"]).parent) if card.get("model_file") else ""
        try:
            module = import_model(spec, (folder,))
        except ConfigError as exc:
            if model_spec:
                raise
            raise ConfigError(
                f"the run trained a FedML script's own model {name[len(SCRIPT_MODEL_PREFIX) :]} "
                f"({spec or 'class unknown'}{', in ' + card['model_file'] if card.get('model_file') else ''}), which "
                f"cannot be built here ({exc}); pass --model MODULE:NAME, a class or function building it with no "
                "arguments (its folder on PYTHONPATH)"
            ) from None
    if module is None:
        return build_model(
            name,
            num_classes=int(card["num_classes"]),
            in_channels=int(card["in_channels"]),
            image_size=int(card["image_size"]),
            norm=str(card.get("model_norm", "gn")),
            logits=card.get("logits", ""),
        )
    import copy
    from functools import partial

    module = copy.deepcopy(module).to("cpu")
    shape = tuple(card.get("input_shape") or ())
    if shape and shape != (card["in_channels"], card["image_size"], card["image_size"]):
        module.register_forward_pre_hook(partial(_reshape_input, shape))
    return select_logits(module, card.get("logits", ""))


def load_trained(
    source: str | Path, module: nn.Module | None = None, model_spec: str = "", weights: str = "global_state"
) -> Trained:
    """The trained model of a run folder or checkpoint file, rebuilt from the checkpoint alone.

    Parameters
    ----------
    source : path
        A run folder (``checkpoints/last.pt``) or a checkpoint file.
    module : nn.Module, optional
        A script's model as the script builds it (its weights are replaced by the checkpoint's).
    model_spec : str, optional
        ``module:Name`` of a class or function building the script's model (instead of the class the
        checkpoint records).
    weights : str
        The state dict in the checkpoint's algorithm state (default ``global_state``).

    Raises
    ------
    ConfigError
        No checkpoint, a damaged one, one without a model card, weights that do not fit, or a script's
        model that cannot be built (names what is needed).
    """
    from .checkpoint import CheckpointError, load_checkpoint

    src = Path(source).expanduser()
    ckpt = src / "checkpoints" / "last.pt" if src.is_dir() else src
    try:
        payload = load_checkpoint(ckpt)
    except CheckpointError as exc:
        raise ConfigError(str(exc)) from None
    card = read_card(payload, ckpt)
    model = build_from_card(card, module, model_spec)
    state = (payload.get("algorithm") or {}).get(weights)
    if not isinstance(state, dict):
        raise ConfigError(f"checkpoint {ckpt} has no model state 'algorithm.{weights}'")
    try:
        model.load_state_dict(state, strict=True)
    except RuntimeError as exc:
        first = str(exc).strip().splitlines()[0]
        raise ConfigError(f"checkpoint {ckpt}: its weights do not fit the model {card.get('label')}: {first}") from None
    return Trained(model=model.eval(), card=card, checkpoint=ckpt)


def prepare(images: torch.Tensor, card: dict[str, Any]) -> torch.Tensor:
    """uint8 images ``(N, C, s, s)`` as the model takes them: ``/ 255``, then the card's normalisation."""
    mean = torch.tensor(card["norm_mean"], dtype=torch.float32).view(1, -1, 1, 1)
    std = torch.tensor(card["norm_std"], dtype=torch.float32).view(1, -1, 1, 1)
    return (images.to(torch.float32) / 255.0 - mean) / std


def predict(trained: Trained, images: torch.Tensor, batch_size: int = 500) -> torch.Tensor:
    """The predicted class of every uint8 image ``(N, C, s, s)``."""
    out = []
    with torch.no_grad():
        for s in range(0, len(images), batch_size):
            out.append(trained.model(prepare(images[s : s + batch_size], trained.card)).argmax(dim=1))
    return torch.cat(out) if out else torch.zeros(0, dtype=torch.int64)


def accuracy(trained: Trained, images: torch.Tensor, labels: torch.Tensor) -> float:
    """The share of uint8 images ``(N, C, s, s)`` whose predicted class is ``labels``'."""
    return int((predict(trained, images) == labels).sum()) / max(len(labels), 1)
