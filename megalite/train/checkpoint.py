"""Checkpoint save / resume for replicated layouts (tp = pp = 1, zero = 0).

Layout of one checkpoint:

    <checkpoint.dir>/step_00000100/
        model.pt            model state (rank 0; every DP replica holds the same)
        optimizer.pt        AdamW state (rank 0)
        rng_rank00003.pt    torch / CUDA / numpy / python RNG of each rank
        meta.json           written last: step, consumed samples, layout, config, file list

A checkpoint is written under `step_N.tmp/` and renamed to `step_N/` by rank 0 only after every
rank has finished writing (a barrier) and `meta.json` is on disk, so a crash mid-save never
leaves a directory that looks complete. Only directories named `step_N` that hold a
`meta.json` are ever picked; the `keep` most recent are kept.
"""
from __future__ import annotations

import json
import os
import random
import re
import shutil
import time
from dataclasses import asdict
from pathlib import Path
from typing import List, Optional

import numpy as np
import torch
import torch.distributed as dist

from megalite.config import Config

STEP_DIR = re.compile(r"^step_(\d{8})$")
FORMAT_VERSION = 1


class CheckpointError(RuntimeError):
    pass


def _barrier() -> None:
    if dist.is_available() and dist.is_initialized():
        dist.barrier()


def _fsync_write(path: Path, text: str) -> None:
    with open(path, "w") as f:
        f.write(text)
        f.flush()
        os.fsync(f.fileno())


def rng_state() -> dict:
    state = {"torch": torch.get_rng_state(), "numpy": np.random.get_state(),
             "python": random.getstate()}
    if torch.cuda.is_available():
        state["cuda"] = torch.cuda.get_rng_state()
    return state


def set_rng_state(state: dict) -> None:
    torch.set_rng_state(state["torch"])
    np.random.set_state(state["numpy"])
    random.setstate(state["python"])
    if "cuda" in state and torch.cuda.is_available():
        torch.cuda.set_rng_state(state["cuda"])


def complete_checkpoints(root: Path) -> List[Path]:
    """Complete checkpoints under `root`, oldest first."""
    if not root.is_dir():
        return []
    found = [p for p in root.iterdir()
             if STEP_DIR.match(p.name) and (p / "meta.json").is_file()]
    return sorted(found, key=lambda p: p.name)


def latest_checkpoint(root: Path) -> Optional[Path]:
    found = complete_checkpoints(root)
    return found[-1] if found else None


def save_checkpoint(root: Path, step: int, model: torch.nn.Module,
                    optimizer: torch.optim.Optimizer, consumed_samples: int, cfg: Config,
                    rank: int, world_size: int, keep: int) -> Path:
    """Collective: every rank must call it. Returns the published directory."""
    final = root / f"step_{step:08d}"
    tmp = root / f"step_{step:08d}.tmp"
    if rank == 0:
        if tmp.exists():
            shutil.rmtree(tmp)
        tmp.mkdir(parents=True)
    _barrier()
    torch.save(rng_state(), tmp / f"rng_rank{rank:05d}.pt")
    if rank == 0:
        torch.save(model.state_dict(), tmp / "model.pt")
        torch.save(optimizer.state_dict(), tmp / "optimizer.pt")
    _barrier()
    if rank == 0:
        meta = {"format_version": FORMAT_VERSION, "step": step,
                "consumed_samples": consumed_samples, "world_size": world_size,
                "layout": {"tp": cfg.tp, "pp": cfg.pp, "zero": cfg.zero,
                           "dp": world_size // (cfg.tp * cfg.pp)},
                "model": asdict(cfg.model), "config": asdict(cfg), "time": time.time(),
                "files": sorted(p.name for p in tmp.iterdir())}
        _fsync_write(tmp / "meta.json", json.dumps(meta, indent=1))
        if final.exists():
            shutil.rmtree(final)
        os.replace(tmp, final)
        for old in complete_checkpoints(root)[:-keep]:
            shutil.rmtree(old, ignore_errors=True)
    _barrier()
    return final


def _load(path: Path, what: str):
    if not path.is_file():
        raise CheckpointError(f"checkpoint file missing: {path} ({what})")
    try:
        return torch.load(path, map_location="cpu", weights_only=False)
    except Exception as e:
        raise CheckpointError(f"checkpoint file unreadable (truncated or corrupted?): {path}: "
                              f"{e}") from e


def read_meta(ckpt: Path) -> dict:
    meta_path = ckpt / "meta.json"
    if not meta_path.is_file():
        raise CheckpointError(f"{ckpt} is not a complete checkpoint (no meta.json)")
    return json.loads(meta_path.read_text())


def load_checkpoint(ckpt: Path, model: torch.nn.Module, optimizer: torch.optim.Optimizer,
                    cfg: Config, rank: int) -> dict:
    """Restore model, optimizer and this rank's RNG; returns the checkpoint's meta."""
    meta = read_meta(ckpt)
    for key in ("tp", "pp"):
        if meta["layout"][key] != getattr(cfg, key):
            raise CheckpointError(
                f"{key}={getattr(cfg, key)}: checkpoint {ckpt} was written with "
                f"{key}={meta['layout'][key]}; resharding across layouts lands with the "
                f"checkpoint issue")
    for key, value in meta["model"].items():
        if key != "name" and getattr(cfg.model, key) != value and not key.endswith("pdrop"):
            raise CheckpointError(f"model.{key}={getattr(cfg.model, key)!r}: checkpoint {ckpt} "
                                  f"has {key}={value!r}")
    model.load_state_dict(_load(ckpt / "model.pt", "model"))
    optimizer.load_state_dict(_load(ckpt / "optimizer.pt", "optimizer"))
    rng_file = ckpt / f"rng_rank{rank:05d}.pt"
    if rng_file.is_file():
        set_rng_state(_load(rng_file, "rng"))
    else:  # a rank the writing layout did not have: a fresh, seed-derived stream
        torch.manual_seed(cfg.seed + 7919 * (rank + 1) + meta["step"])
    return meta
