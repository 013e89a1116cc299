"""Which checkpoint a run continues from (`checkpoint.resume`), the same on every rank, and
checked before launch.

    none   start from scratch
    auto   the newest complete checkpoint in checkpoint.dir (none yet: from scratch); one that
           fails to load is skipped for the one before it
    PATH   that step_N directory, or the newest complete checkpoint of a checkpoint.dir

Rank 0 lists the checkpoints and every rank takes its list: ranks listing a shared directory
each on their own could see different newest checkpoints (a node whose view of the file
system lags) and resume from different steps.
"""
from __future__ import annotations

from pathlib import Path
from typing import List

from megalite.config import Config, ConfigError, data_sources, resolve_path
from megalite.train.checkpoint import (CheckpointError, broadcast_object, complete_checkpoints,
                                       find_checkpoint, read_meta, shape_mismatch)


def checkpoint_root(cfg: Config, run_dir: Path) -> Path:
    """`checkpoint.dir`, or `<run dir>/checkpoints`."""
    return resolve_path(cfg.checkpoint.dir) if cfg.checkpoint.dir else Path(run_dir) / "checkpoints"


def candidates(setting: str, root: Path) -> List[Path]:
    """The checkpoints to try in order (newest first for auto), as rank 0 sees them
    (collective when distributed)."""
    if setting == "none":
        return []
    if setting == "auto":
        found = list(reversed(complete_checkpoints(root)))
    else:
        named = find_checkpoint(resolve_path(setting))
        found = [named if named is not None else resolve_path(setting)]
    return broadcast_object(found)


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
    sources = len(data_sources(cfg.data))
    if sources > 1 and blended != sources:
        raise ConfigError(f"data.blend: {where} holds the data position of {blended} blended "
                          f"dataset(s), this run blends {sources}; resume with the same "
                          "data.blend, or start a new run (init_from takes its weights)")
