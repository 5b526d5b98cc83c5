"""The package's configuration error and its one error style: at the bottom layer, for every layer to use."""

import re

PROG = "fedml-ssfl"
"""The command's name, the prefix of every error line it prints."""


class ConfigError(ValueError):
    """A configuration problem, with a message that names the key and the fix."""


def error_line(text: str) -> str:
    """``text`` as the command line prints an error: ``fedml-ssfl: error: <text>``, on one line.

    Every subcommand and runtime process uses it, so an error reads the same wherever it comes
    from; line breaks inside ``text`` (e.g. a YAML parser's) become single spaces.
    """
    return f"{PROG}: error: " + re.sub(r"\s*\n\s*", " ", str(text).strip())
