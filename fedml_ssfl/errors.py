"""The package's configuration error, at the bottom layer so that every layer can raise it."""


class ConfigError(ValueError):
    """A configuration problem, with a message that names the key and the fix."""
