"""Name -> model builder registry.

A model module registers each architecture with :func:`register_model`; everything else
builds models by name with :func:`build_model`, which checks the request against what the
architecture declares it supports (normalisation kinds, input sizes, input channels) and
fails with a message that says what would work.

Example
-------
>>> from fedml_ssfl.models import build_model
>>> net = build_model("cnn28", num_classes=10, in_channels=1, image_size=28, norm="gn")
>>> classifier_prefix(net, in_channels=1, image_size=28)
'fc'

Every registered model follows the same contract:

* the builder is called as ``builder(*, num_classes, in_channels, image_size, norm)``;
* the model maps a float tensor ``(N, in_channels, image_size, image_size)``, already
  normalised, to logits ``(N, num_classes)``;
* some layer with parameters of its own produces those logits: the classifier head, found by a
  forward pass whatever its name (:func:`~fedml_ssfl.models.head.find_classifier`); checked the
  first time a model is built for a given request, with an error naming what is missing;
* parameters are initialised from torch's global RNG, so seeding it makes builds identical.
"""

from __future__ import annotations

import difflib
from collections.abc import Callable
from dataclasses import dataclass

from torch import nn

from ..errors import ConfigError
from .head import check_classifier, find_classifier
from .norm import NORM_KINDS
from .script import select_logits

ModelBuilder = Callable[..., nn.Module]
"""``builder(*, num_classes, in_channels, image_size, norm) -> nn.Module``."""


@dataclass(frozen=True)
class ModelSpec:
    """What a registered model is and which inputs it accepts.

    Attributes
    ----------
    name : str
        Registry name (``model_args.model``).
    builder : ModelBuilder
        Function called with keyword arguments ``num_classes``, ``in_channels``,
        ``image_size`` and ``norm``.
    norms : tuple of str
        Normalisation kinds the model supports (subset of ``("bn", "gn", "none")``).
    image_sizes : tuple of int or None
        Square input sizes the model accepts; ``None`` for any size ``>= min_image_size``.
    description : str
        One-line description.
    min_image_size : int
        Smallest input size accepted when ``image_sizes`` is ``None``.
    in_channels : tuple of int or None
        Input channel counts the model accepts; ``None`` for any positive count.
    """

    name: str
    builder: ModelBuilder
    norms: tuple[str, ...]
    image_sizes: tuple[int, ...] | None
    description: str
    min_image_size: int = 1
    in_channels: tuple[int, ...] | None = None

    def accepts_image_size(self, image_size: int) -> bool:
        """Whether a square input of side ``image_size`` is accepted."""
        if self.image_sizes is not None:
            return image_size in self.image_sizes
        return image_size >= self.min_image_size

    def image_size_text(self) -> str:
        """Human-readable statement of the accepted input sizes."""
        if self.image_sizes is not None:
            return ", ".join(str(s) for s in self.image_sizes)
        return f"any >= {self.min_image_size}"


_REGISTRY: dict[str, ModelSpec] = {}
_CHECKED: set[tuple] = set()
"""Build requests whose model has passed :func:`~fedml_ssfl.models.head.check_classifier` (checked once each)."""


def register_model(
    name: str,
    *,
    norms: tuple[str, ...] = ("bn", "gn", "none"),
    image_sizes: tuple[int, ...] | None = None,
    min_image_size: int = 1,
    in_channels: tuple[int, ...] | None = None,
    description: str | None = None,
) -> Callable[[ModelBuilder], ModelBuilder]:
    """Decorator that registers a model builder under ``name``.

    Parameters
    ----------
    name : str
        Registry name; must not be registered already.
    norms : tuple of str, optional
        Supported normalisation kinds (default all of ``"bn"``, ``"gn"``, ``"none"``).
    image_sizes : tuple of int or None, optional
        Accepted square input sizes; ``None`` (default) for any size ``>= min_image_size``.
    min_image_size : int, optional
        Smallest accepted size when ``image_sizes`` is ``None`` (default 1).
    in_channels : tuple of int or None, optional
        Accepted input channel counts; ``None`` (default) for any.
    description : str or None, optional
        One-line description; defaults to the first line of the builder's docstring.

    Returns
    -------
    Callable
        A decorator that records the builder and returns it unchanged.

    Raises
    ------
    ValueError
        If ``name`` is already registered, or ``norms`` is empty or names an unknown kind.
    """
    if not norms or any(n not in NORM_KINDS for n in norms):
        raise ValueError(f"norms for model {name!r} must be a non-empty subset of {NORM_KINDS}, got {norms}")

    def decorator(builder: ModelBuilder) -> ModelBuilder:
        if name in _REGISTRY:
            raise ValueError(f"model {name!r} is already registered")
        doc = description
        if doc is None:
            lines = (builder.__doc__ or "").strip().splitlines()
            doc = lines[0].strip() if lines else ""
        _REGISTRY[name] = ModelSpec(
            name=name,
            builder=builder,
            norms=tuple(norms),
            image_sizes=None if image_sizes is None else tuple(image_sizes),
            description=doc,
            min_image_size=min_image_size,
            in_channels=None if in_channels is None else tuple(in_channels),
        )
        return builder

    return decorator


def available_models() -> list[str]:
    """Sorted names of all registered models."""
    return sorted(_REGISTRY)


def model_spec(name: str) -> ModelSpec:
    """The :class:`ModelSpec` registered under ``name``.

    Raises
    ------
    ValueError
        If no model has that name; the message lists the available models and suggests the
        closest name.
    """
    try:
        return _REGISTRY[name]
    except KeyError:
        names = available_models()
        close = difflib.get_close_matches(str(name), names, n=1, cutoff=0.0)
        hint = f" Did you mean {close[0]!r}?" if close else ""
        raise ValueError(
            f"unknown model {name!r} (model_args.model).{hint} Available models: {', '.join(names) or 'none'}"
        ) from None


def build_model(
    name: str, *, num_classes: int, in_channels: int, image_size: int, norm: str = "gn", logits: int | str = ""
) -> nn.Module:
    """Build a registered model after checking the request against its :class:`ModelSpec`.

    Parameters
    ----------
    name : str
        Registry name, see :func:`available_models`.
    num_classes : int
        Number of output logits.
    in_channels : int
        Channels of the input images.
    image_size : int
        Side of the (square) input images.
    norm : str, optional
        Normalisation kind (``model_args.norm``), default ``"gn"``.
    logits : int or str, optional
        ``model_args.logits``: for a model returning a tuple or dict, the position or key of its logits
        (:func:`~fedml_ssfl.models.script.select_logits`); default ``""``, the output itself.

    Returns
    -------
    torch.nn.Module
        The freshly initialised model (in training mode).

    Raises
    ------
    ValueError
        Unknown model (with the closest name suggested), unsupported ``norm``, or an input
        size / channel count / class count the model cannot take.
    TypeError
        The builder's model does not map such images to ``(N, num_classes)`` logits produced by a
        layer with parameters (checked on the first build of each request; names the fix).
    """
    spec = model_spec(name)
    if norm not in spec.norms:
        raise ValueError(
            f"model_args.norm={norm!r} is not supported by model {name!r}; "
            f"allowed values: {', '.join(map(repr, spec.norms))}"
        )
    if num_classes < 1:
        raise ValueError(f"num_classes must be positive, got {num_classes}")
    if in_channels < 1:
        raise ValueError(f"in_channels must be positive, got {in_channels}")
    if spec.in_channels is not None and in_channels not in spec.in_channels:
        raise ValueError(
            f"model {name!r} cannot take in_channels={in_channels}; "
            f"it supports in_channels in {', '.join(map(str, spec.in_channels))}"
        )
    if not spec.accepts_image_size(image_size):
        raise ValueError(
            f"model {name!r} cannot take image_size={image_size}; it supports image sizes: {spec.image_size_text()}"
        )
    model = spec.builder(num_classes=num_classes, in_channels=in_channels, image_size=image_size, norm=norm)
    select_logits(model, logits)
    request = (name, spec.builder, num_classes, in_channels, image_size, norm, logits)
    if request not in _CHECKED:
        try:
            check_classifier(model, num_classes, in_channels, image_size, f"model {name!r}")
        except ConfigError as exc:
            raise TypeError(f"{exc} (registered with @register_model({name!r}))") from None
        _CHECKED.add(request)
    return model


def classifier_prefix(model: nn.Module, *, in_channels: int, image_size: int) -> str:
    """State-dict key prefix of the model's classifier head, found by a forward pass (no naming rule).

    Parameters
    ----------
    model : torch.nn.Module
        Any model mapping images ``(N, in_channels, image_size, image_size)`` to logits ``(N, K)``.
    in_channels, image_size : int
        The input the model takes.

    Returns
    -------
    str
        ``"fc"`` for the shipped models; the head's keys are ``prefix + ".weight"`` and so on
        (:func:`~fedml_ssfl.models.head.head_keys`).

    Raises
    ------
    ValueError
        The model's output is not ``(N, K)`` logits, or no layer with parameters produces them.
    """
    prefix = find_classifier(model, in_channels, image_size)
    if prefix is None:
        raise ValueError(
            f"{type(model).__name__}: no layer with parameters of its own produces its (N, num_classes) logits"
        )
    return prefix


def count_parameters(model: nn.Module) -> int:
    """Number of trainable parameters (elements of tensors with ``requires_grad``)."""
    return sum(p.numel() for p in model.parameters() if p.requires_grad)
