"""Every environment variable the package reads, read through one typed reader each.

A reader returns the default when the variable is unset or blank, and otherwise the value
converted and range-checked; a value it cannot take raises a one-line
:class:`~fedml_ssfl.errors.ConfigError` naming the variable, the value and the fix, at the moment
it is read, instead of falling back to the default or running with a negative time-out.

The variables (docs/inputs.md lists them with their defaults)::

    FEDML_SSFL_ROUND_TIMEOUT, FEDML_SSFL_CONNECT_TIMEOUT, FEDML_SSFL_FINISH_GRACE,
    FEDML_SSFL_OUTAGE_BUDGET, FEDML_SSFL_HEARTBEAT_INTERVAL,
    FEDML_SSFL_IDLE_TIMEOUT                                seconds        (runtime/fedml/launch.py)
    FEDML_SSFL_MAX_MESSAGE_BYTES                           bytes          (runtime/fedml/wire.py)
    FEDML_SSFL_MAX_INPUT_BYTES                             bytes          (limits.py)
    FEDML_SSFL_JOB_KEY                                     text           (runtime/fedml/security.py)
    FEDML_SSFL_SET                                         text           (config.py)
    FEDML_SSFL_ALLOW_NETWORK                               flag           (runtime/offline.py)
    FEDML_SSFL_NET_RECORD                                  file path      (runtime/offline.py)
    FEDML_CLIENT_RANK                                      integer        (runtime/fedml/launch.py, FedML's)
    FEDML_CURRENT_RUN_ID                                   text           (cli.py, FedML's)

``tests/test_envvars.py`` fails when a module of the package reads ``os.environ`` other than here.
"""

from __future__ import annotations

import math
import os
import re
from collections.abc import Callable
from pathlib import Path

from .errors import ConfigError

MAX_TEXT = 4096
"""The longest value a text variable may hold (characters), unless its reader says less."""

_UNITS = {
    "": 1,
    "b": 1,
    "k": 10**3,
    "kb": 10**3,
    "m": 10**6,
    "mb": 10**6,
    "g": 10**9,
    "gb": 10**9,
    "t": 10**12,
    "tb": 10**12,
    "kib": 2**10,
    "mib": 2**20,
    "gib": 2**30,
    "tib": 2**40,
}
_SIZE = re.compile(r"^\s*([0-9]+(?:\.[0-9]*)?(?:[eE][+-]?[0-9]+)?)\s*([A-Za-z]*)\s*$")
_TRUE = ("1", "true", "yes", "on")
_FALSE = ("0", "false", "no", "off")


def raw(name: str) -> str:
    """The variable's text with surrounding blanks removed ("" when unset)."""
    return os.environ.get(name, "").strip()


def _refuse(name: str, value: str, expected: str) -> ConfigError:
    shown = value if len(value) <= 60 else value[:57] + "..."
    return ConfigError(f"{name}={shown!r}: expected {expected}; set it to such a value, or unset it")


def seconds(name: str, default: float, *, minimum: float = 0.0, allow_minimum: bool = False) -> float:
    """A time in seconds: a finite number above ``minimum`` (at ``minimum`` too with ``allow_minimum``).

    ``1e3`` and ``2.5`` are numbers; ``abc``, ``-5``, ``inf`` and ``nan`` are refused.
    """
    value = raw(name)
    if not value:
        return default
    bound = f"{'>=' if allow_minimum else '>'} {minimum:g}"
    try:
        number = float(value)
    except ValueError:
        raise _refuse(name, value, f"a number of seconds {bound}, e.g. 300") from None
    if not math.isfinite(number) or number < minimum or (number == minimum and not allow_minimum):
        raise _refuse(name, value, f"a finite number of seconds {bound}, e.g. 300")
    return number


def integer(name: str, default: int | None, *, minimum: int | None = None, maximum: int | None = None) -> int | None:
    """A whole number within ``[minimum, maximum]`` (either end open when None)."""
    value = raw(name)
    if not value:
        return default
    span = (
        f" in {minimum}..{maximum}"
        if minimum is not None and maximum is not None
        else f" >= {minimum}"
        if minimum is not None
        else f" <= {maximum}"
        if maximum is not None
        else ""
    )
    if not re.fullmatch(r"[+-]?[0-9]{1,19}", value):
        raise _refuse(name, value, f"a whole number{span}")
    number = int(value)
    if (minimum is not None and number < minimum) or (maximum is not None and number > maximum):
        raise _refuse(name, value, f"a whole number{span}")
    return number


def nbytes(name: str, default: int, *, minimum: int = 1, maximum: int = 2**62) -> int:
    """A size in bytes: ``4294967296``, ``4GiB``, ``512MiB``, ``1e9``, ``2G`` (``G`` = 10**9, ``GiB`` = 2**30).

    Refused: anything else, and a size outside ``[minimum, maximum]``.
    """
    value = raw(name)
    if not value:
        return default
    expected = f"a size in bytes from {minimum} to {maximum}, e.g. 4294967296, 4GiB or 512MiB"
    match = _SIZE.match(value)
    unit = match.group(2).lower() if match else ""
    if match is None or unit not in _UNITS:
        raise _refuse(name, value, expected)
    digits = match.group(1)
    number = int(digits) * _UNITS[unit] if digits.isdigit() else float(digits) * _UNITS[unit]
    if not math.isfinite(number) or not minimum <= number <= maximum:
        raise _refuse(name, value, expected)
    return int(number)


def flag(name: str, default: bool = False) -> bool:
    """A switch: 1 / true / yes / on, or 0 / false / no / off (any case)."""
    value = raw(name)
    if not value:
        return default
    if value.lower() in _TRUE:
        return True
    if value.lower() in _FALSE:
        return False
    raise _refuse(name, value, "1 or 0 (true / false, yes / no, on / off)")


def text(name: str, default: str = "", *, max_length: int = MAX_TEXT) -> str:
    """Free text of at most ``max_length`` printable characters (blanks around it removed)."""
    value = raw(name)
    if not value:
        return default
    if len(value) > max_length or not value.isprintable():
        raise _refuse(name, value, f"at most {max_length} printable characters (no line breaks)")
    return value


def file_path(name: str) -> Path | None:
    """A file to write (None when unset): not a folder, and its folder must exist."""
    value = text(name)
    if not value:
        return None
    path = Path(value).expanduser()
    if path.is_dir():
        raise _refuse(name, value, "the path of a file, not a folder")
    if not path.parent.is_dir():
        raise _refuse(name, value, f"a file in an existing folder ({path.parent} does not exist)")
    return path


def _seconds(name: str) -> Callable[[], object]:
    return lambda: seconds(name, 0.0)


CHECKS: dict[str, Callable[[], object]] = {
    **{
        name: _seconds(name)
        for name in (
            "FEDML_SSFL_ROUND_TIMEOUT",
            "FEDML_SSFL_CONNECT_TIMEOUT",
            "FEDML_SSFL_FINISH_GRACE",
            "FEDML_SSFL_OUTAGE_BUDGET",
            "FEDML_SSFL_HEARTBEAT_INTERVAL",
            "FEDML_SSFL_IDLE_TIMEOUT",
        )
    },
    "FEDML_SSFL_MAX_MESSAGE_BYTES": lambda: nbytes("FEDML_SSFL_MAX_MESSAGE_BYTES", 1),
    "FEDML_SSFL_MAX_INPUT_BYTES": lambda: nbytes("FEDML_SSFL_MAX_INPUT_BYTES", 1),
    "FEDML_SSFL_JOB_KEY": lambda: text("FEDML_SSFL_JOB_KEY"),
    "FEDML_SSFL_SET": lambda: text("FEDML_SSFL_SET"),
    "FEDML_SSFL_ALLOW_NETWORK": lambda: flag("FEDML_SSFL_ALLOW_NETWORK"),
    "FEDML_SSFL_NET_RECORD": lambda: file_path("FEDML_SSFL_NET_RECORD"),
    "FEDML_CLIENT_RANK": lambda: integer("FEDML_CLIENT_RANK", None, minimum=0),
    "FEDML_CURRENT_RUN_ID": lambda: text("FEDML_CURRENT_RUN_ID", max_length=256),
}
"""Every variable of the module docstring's list, read as the module that uses it reads it (keep the two in
step): :func:`check_all` reads them all when a command starts."""


def check_all() -> None:
    """Read every variable in :data:`CHECKS` that is set, so a bad value is refused before any work.

    The modules read their variables where they use them (an invalid ``FEDML_SSFL_MAX_MESSAGE_BYTES`` was
    refused only once the data had loaded); the command line calls this first.

    Raises
    ------
    ConfigError
        The first variable whose value its reader refuses, naming it, the value and the fix.
    """
    for check in CHECKS.values():
        check()
