"""The error every configuration check raises, and the one way to raise it."""
from typing import Optional


class ConfigError(ValueError):
    """A configuration value that cannot work; the message names key, value and remedy
    (`key`: the key `fail` named, None for an error raised with a message alone)."""

    def __init__(self, message: str, key: Optional[str] = None):
        super().__init__(message)
        self.key = key


def fail(key: str, value, remedy: str) -> None:
    """Raise the ConfigError of `key` set to `value`, saying what would work."""
    raise ConfigError(f"{key}={value!r}: {remedy}", key)
