"""Making a completed write survive a crash or power loss (checkpoints, prepared data,
exports)."""
from __future__ import annotations

import os
import shutil
from pathlib import Path


def fsync_dir(path: Path) -> None:
    """Flush a directory's entries (a rename into it, a new file) to disk."""
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def aside(dest: Path) -> Path:
    """Where `replace_dir` holds the directory it replaces between its two renames."""
    return dest.with_name(f".{dest.name}.replaced")


def recover_replaced(dest: Path) -> None:
    """Finish a `replace_dir` cut short: the old directory set aside goes back to `dest` where
    the new one never arrived, and is deleted where it did."""
    old = aside(dest)
    if not old.exists():
        return
    if dest.exists():
        shutil.rmtree(old)
    else:
        os.replace(old, dest)


def replace_dir(new: Path, dest: Path) -> None:
    """Make the complete directory `new` be `dest`, keeping `dest`'s old content until then:
    the old one is renamed aside, the new one renamed in, then the old one deleted. A crash at
    any point leaves at `dest` the old directory or the new one, both complete, except between
    the two renames, where the old one waits in `aside(dest)` for `recover_replaced`."""
    recover_replaced(dest)
    if dest.exists():
        os.replace(dest, aside(dest))
        os.replace(new, dest)
        fsync_dir(dest.parent)
        shutil.rmtree(aside(dest))
    else:
        os.replace(new, dest)
        fsync_dir(dest.parent)
