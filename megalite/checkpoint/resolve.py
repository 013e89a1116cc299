"""Which checkpoint a path or a run's settings name, and the `step_N` directories of a
checkpoint root.

`find_checkpoint(path)` is the one rule for a path (`checkpoint.resume`, `init_from`, export,
generate): a complete `step_N` directory (holding meta.json) is itself, a checkpoint root
stands for its newest complete checkpoint.

Which checkpoint a run continues from (`checkpoint.resume`), the same on every rank, and
checked before launch:

    none   start from scratch
    auto   the newest complete checkpoint in checkpoint.dir (none yet: from scratch); one that
           fails to load is skipped for the one before it
    PATH   that step_N directory, or the newest complete checkpoint of a checkpoint.dir

Rank 0 lists the checkpoints and every rank takes its list: ranks listing a shared directory
each on their own could see different newest checkpoints (a node whose view of the file
system lags) and resume from different steps.
"""
from __future__ import annotations

import os
import shutil
import time
from pathlib import Path
from typing import List, Optional

from megalite.checkpoint.errors import CheckpointError
from megalite.checkpoint.format import STEP_DIR, read_meta, shape_mismatch
from megalite.config.errors import ConfigError
from megalite.config.schema import Config, resolve_path
from megalite.parallel import comm
from megalite.parallel.group import Group

SUPERSEDED_DIR = "superseded"


def complete_checkpoints(root: Path) -> List[Path]:
    """Complete checkpoints under `root`, oldest first."""
    if not root.is_dir():
        return []
    found = [p for p in root.iterdir() if STEP_DIR.match(p.name) and (p / "meta.json").is_file()]
    return sorted(found, key=lambda p: p.name)


def latest_checkpoint(root: Path) -> Optional[Path]:
    found = complete_checkpoints(root)
    return found[-1] if found else None


def find_checkpoint(path) -> Optional[Path]:
    """The checkpoint `path` names: itself if it is a complete `step_N` (holds meta.json),
    else the newest complete checkpoint of a checkpoint.dir; None when it is neither."""
    path = Path(path)
    if (path / "meta.json").is_file():
        return path
    return latest_checkpoint(path) if path.is_dir() else None


class CheckpointNotFound(ValueError):
    """A path that names no checkpoint; the message says what is expected instead."""


def resolve_checkpoint(path) -> Path:
    """`find_checkpoint(path)`, or CheckpointNotFound naming the path and what would work."""
    path = Path(path)
    found = find_checkpoint(path)
    if found is not None:
        return found
    problem = ("does not exist" if not path.exists() else "is not a directory"
               if not path.is_dir() else "holds no meta.json and no complete checkpoint")
    raise CheckpointNotFound(f"{path}: {problem}; expected a megalite checkpoint directory "
                             "step_NNNNNNNN holding meta.json (e.g. <run dir>/checkpoints/"
                             "step_00000300) or a checkpoint.dir containing one")


def discard(path: Path) -> None:
    """Delete a directory, renaming it out of the `step_N` namespace first."""
    trash = path.with_name(f".trash-{path.name}-{os.getpid()}-{time.time_ns()}")
    os.replace(path, trash)
    shutil.rmtree(trash, ignore_errors=True)


def set_aside_later_checkpoints(root: Path, step: int) -> List[Path]:
    """A run starting at `step`: move `step_N` with N > step into `superseded/` (kept for the
    user, invisible to `keep` and `resume=auto`); delete unfinished `step_N.tmp` directories
    and trash left by a crash. Rank 0 only, before the run's first save. Returns the moved."""
    if not root.is_dir():
        return []
    moved = []
    for p in sorted(root.iterdir()):
        match = STEP_DIR.match(p.name)
        if match and int(match.group(1)) > step:
            (root / SUPERSEDED_DIR).mkdir(exist_ok=True)
            stamp = time.strftime("%Y%m%d-%H%M%S")
            dest = root / SUPERSEDED_DIR / f"{p.name}-{stamp}"
            n = 1
            while dest.exists():
                n += 1
                dest = root / SUPERSEDED_DIR / f"{p.name}-{stamp}-{n}"
            os.replace(p, dest)
            moved.append(dest)
        elif p.name.startswith(".trash-step_") or (p.name.startswith("step_")
                                                   and p.name.endswith(".tmp")):
            shutil.rmtree(p, ignore_errors=True)
    return moved



def checkpoint_root(directory: Optional[str], run_dir: Path) -> Path:
    """`checkpoint.dir` (`directory`), or `<run dir>/checkpoints`."""
    return resolve_path(directory) if directory else Path(run_dir) / "checkpoints"


def candidates(setting: str, root: Path, group: Group) -> List[Path]:
    """The checkpoints to try in order (newest first for auto), as rank 0 of `group` (all
    ranks) sees them (collective)."""
    if setting == "none":
        return []
    if setting == "auto":
        found = list(reversed(complete_checkpoints(root)))
    else:
        named = find_checkpoint(resolve_path(setting))
        found = [named if named is not None else resolve_path(setting)]
    return comm.broadcast_object(found, group)


def check_resume(cfg: Config) -> None:
    """Before launch: the checkpoint the run would continue from has this model's shape and
    this run's number of blended datasets. An explicit one must also be readable; with auto,
    the newest readable one in `checkpoint.dir` is checked (damaged ones are the fallback's);
    auto into the run directory is checked when it loads, as ranks > 0 learn that directory
    only after launch."""
    setting = cfg.checkpoint.resume
    if setting == "none" or (setting == "auto" and not cfg.checkpoint.dir):
        return
    if setting == "auto":
        ckpts = list(reversed(complete_checkpoints(resolve_path(cfg.checkpoint.dir))))
    else:
        named = find_checkpoint(resolve_path(setting))
        if named is None:
            raise ConfigError(f"checkpoint.resume={setting!r}: holds neither a complete "
                              "checkpoint (step_N with meta.json) nor a checkpoint.dir with one")
        ckpts = [named]
    for ckpt in ckpts:
        try:
            meta = read_meta(ckpt)
        except CheckpointError as e:
            if setting == "auto":
                continue
            raise ConfigError(f"checkpoint.resume={setting!r}: {e}") from e
        _check_meta(meta, cfg, f"checkpoint.resume={setting!r} ({ckpt.name})")
        return


def _check_meta(meta: dict, cfg: Config, where: str) -> None:
    problem = shape_mismatch(meta["model"], cfg.model, where)
    if problem is not None:
        raise ConfigError(f"{problem} to resume it")
    blended = len(meta["sampler"].get("counts", [1]))
    sources = len(cfg.data.sources())
    if sources > 1 and blended != sources:
        raise ConfigError(f"data.blend: {where} holds the data position of {blended} blended "
                          f"dataset(s), this run blends {sources}; resume with the same "
                          "data.blend, or start a new run (init_from takes its weights)")
