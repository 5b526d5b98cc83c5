"""The algorithm registry: name -> :class:`~fedml_ssfl.algorithms.base.Algorithm` subclass."""

from __future__ import annotations

import difflib
import importlib
import pkgutil
from typing import TypeVar

from .base import Algorithm

_REGISTRY: dict[str, type[Algorithm]] = {}
_NOT_ALGORITHMS = {"base", "registry", "common"}
_loaded = False

A = TypeVar("A", bound=type[Algorithm])


def register_algorithm(cls: A) -> A:
    """Class decorator: add an algorithm under its ``name``."""
    if not cls.name:
        raise ValueError(f"{cls.__name__} has no name")
    if cls.name in _REGISTRY and _REGISTRY[cls.name] is not cls:
        raise ValueError(f"algorithm '{cls.name}' is already registered by {_REGISTRY[cls.name].__name__}")
    _REGISTRY[cls.name] = cls
    return cls


def _load_all() -> None:
    global _loaded
    if not _loaded:
        package = importlib.import_module(__package__)
        for info in pkgutil.iter_modules(package.__path__):
            if info.name not in _NOT_ALGORITHMS and not info.name.startswith("_"):
                importlib.import_module(f"{__package__}.{info.name}")
        _loaded = True


def available_algorithms() -> list[str]:
    """Names of every registered algorithm, sorted."""
    _load_all()
    return sorted(_REGISTRY)


def get_algorithm(name: str) -> type[Algorithm]:
    """The algorithm class registered as ``name``.

    Raises
    ------
    ValueError
        For an unknown name, listing the registered ones and the closest match.
    """
    _load_all()
    if name not in _REGISTRY:
        close = difflib.get_close_matches(name, list(_REGISTRY), n=1)
        hint = f"; did you mean '{close[0]}'?" if close else ""
        raise ValueError(
            f"ssfl_args.algorithm: unknown algorithm '{name}'{hint} Available: {', '.join(sorted(_REGISTRY))}"
        )
    return _REGISTRY[name]


def algorithm_description(name: str) -> str:
    """One line saying what algorithm ``name`` is: the first line of its class docstring ('' if none).

    Raises
    ------
    ValueError
        For an unknown name (as :func:`get_algorithm`).
    """
    lines = (get_algorithm(name).__doc__ or "").strip().splitlines()
    return lines[0].strip() if lines else ""


def create(name: str, **kwargs) -> Algorithm:
    """Instantiate algorithm ``name`` with the :class:`Algorithm` constructor arguments."""
    return get_algorithm(name)(**kwargs)
