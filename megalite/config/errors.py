"""The error every configuration check raises, and the one way to raise it."""


class ConfigError(ValueError):
    """A configuration value that cannot work; the message names key, value and remedy."""


def fail(key: str, value, remedy: str) -> None:
    """Raise the ConfigError of `key` set to `value`, saying what would work."""
    raise ConfigError(f"{key}={value!r}: {remedy}")
