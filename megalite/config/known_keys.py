"""Keys the schema does not have, refused by name.

Hydra's `+key=value` adds a key that the configuration lacks, and OmegaConf then sets it on the
schema's dataclass as an attribute that nothing reads: `+train.max_step=30` (a typo of
train.max_steps) would train with the key silently ignored. `check_known_keys` walks the
configuration object and refuses the first attribute that is not a field, naming the nearest
known key.
"""
from __future__ import annotations

import difflib
from dataclasses import fields, is_dataclass
from typing import Iterator, List, Tuple

from megalite.config.errors import ConfigError


def _walk(obj, prefix: str) -> Iterator[Tuple[str, bool]]:
    """(dotted key, known) for every attribute of the dataclass `obj` but its sections
    (those are walked into), depth first."""
    names = {f.name for f in fields(obj)}
    for name, value in vars(obj).items():
        key = f"{prefix}{name}"
        if name in names and is_dataclass(value):
            yield from _walk(value, f"{key}.")
        else:
            yield key, name in names


def known_keys(cfg) -> List[str]:
    """Every key of the schema that holds a value, dotted (`train.max_steps`)."""
    return [key for key, known in _walk(cfg, "") if known]


def check_known_keys(cfg) -> None:
    """ConfigError naming the first key of `cfg` that its schema lacks, and the nearest one."""
    unknown = [key for key, known in _walk(cfg, "") if not known]
    if not unknown:
        return
    key = unknown[0]
    close = difflib.get_close_matches(key, known_keys(cfg), n=1, cutoff=0.6)
    nearest = f"did you mean {close[0]}? " if close else ""
    value = cfg
    for part in key.split("."):
        value = getattr(value, part)
    raise ConfigError(f"{key}={value!r}: megalite has no such key ({nearest}the keys are "
                      "in docs/configuration.md; a `+` adds a key, it does not set one)", key)
