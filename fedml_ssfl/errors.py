"""The package's configuration error and its one error style: at the bottom layer, for every layer to use."""

import re

PROG = "fedml-ssfl"
"""The command's name, the prefix of every error line it prints."""


class ConfigError(ValueError):
    """A configuration problem, with a message that names the key and the fix.

    Several problems found together (a config's validation reports all of them) are given as several
    arguments: ``problems`` holds them, one line each, and ``str()`` joins them with line breaks.
    """

    def __init__(self, *problems: object) -> None:
        self.problems = [str(p) for p in problems] or [""]
        super().__init__("\n".join(self.problems))


def error_lines(exc: BaseException) -> list[str]:
    """:func:`error_line` for each problem of ``exc`` (a :class:`ConfigError` may carry several)."""
    problems = getattr(exc, "problems", None) if isinstance(exc, ConfigError) else None
    return [error_line(p) for p in (problems or [str(exc)])]


def error_line(text: str) -> str:
    """``text`` as the command line prints an error: ``fedml-ssfl: error: <text>``, on one line.

    Every subcommand and runtime process uses it, so an error reads the same wherever it comes
    from; line breaks inside ``text`` (e.g. a YAML parser's) become single spaces.
    """
    return f"{PROG}: error: " + re.sub(r"\s*\n\s*", " ", str(text).strip())
