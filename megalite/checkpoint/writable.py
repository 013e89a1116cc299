"""`checkpoint.dir` checked writable before launch, so that a directory no checkpoint can go
to (under a file, under /proc, read-only, not this user's) is a one-line refusal before the
first step, not a traceback at the first save after the training it was to keep.

The check creates nothing that stays: it makes (and removes) a temporary directory in the
deepest part of the path that exists, where the checkpoints' directories would be made.
"""
from __future__ import annotations

import os
import tempfile
from pathlib import Path

from megalite.config.errors import ConfigError


def existing_part(path: Path) -> Path:
    """The deepest ancestor of `path` (or `path` itself) that exists."""
    while not os.path.lexists(path) and path != path.parent:
        path = path.parent
    return path


def check_writable_dir(path: Path, key: str) -> None:
    """ConfigError naming `key` unless directories can be made at `path` (or in it)."""
    base = existing_part(path)
    if not base.is_dir():
        where = "is" if base == path else f"is under {str(base)!r}, which is"
        raise ConfigError(f"{key}={str(path)!r} {where} not a directory; give a directory "
                          "this user can write (or leave it unset: <run dir>/checkpoints)", key)
    try:
        os.rmdir(tempfile.mkdtemp(prefix=".megalite-probe-", dir=base))
    except OSError as e:
        raise ConfigError(f"{key}={str(path)!r} cannot be written: no directory can be made "
                          f"in {base} ({e.strerror or e}); give a directory this user can "
                          "write (or leave it unset: <run dir>/checkpoints)", key) from e
