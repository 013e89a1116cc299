"""Restoring a checkpoint into the current layout, whatever layout wrote it.

Before anything is loaded, every rank checks meta.json's own CRC32, the index and the sizes and
CRC32s of the files it will read; the verdict is agreed over all ranks, so either every rank
loads a checkpoint or none does. Then each rank reads its owned ranges (directly when the TP
split is unchanged; else from the rebuilt global tensor) and hands them to the engine.
"""
from __future__ import annotations

from pathlib import Path
from typing import Dict, Optional, Tuple

import torch

from megalite.checkpoint.format import KINDS, CheckpointError, Reader, check_compatible, \
    read_meta, verify_file
from megalite.checkpoint.resolve import candidates
from megalite.config import Config
from megalite.log import get_logger
from megalite.parallel import comm
from megalite.parallel.param_spec import ParamSpec
from megalite.parallel.topology import Topology


def load_checkpoint(ckpt: Path, engine, cfg: Config, topo: Topology) -> Tuple[dict, Optional[dict]]:
    """Collective. Verify, then restore master weights, moments and parameters of this rank's
    part under the current layout. Returns (meta, this rank's RNG state or None when the
    layout differs from the writer's). Raises CheckpointError (on every rank) if any rank finds
    the checkpoint incomplete or corrupted; nothing is modified then."""
    error: Optional[str] = None
    meta: dict = {}
    plans = []
    try:
        meta = read_meta(ckpt)
        check_compatible(meta, cfg, ckpt)
        reader = Reader(ckpt, meta)
        files = set()
        for piece in sorted(engine.state_pieces(), key=lambda p: p.spec.name):
            for kind in KINDS:
                if kind != "param" and not reader.has(piece.spec.name, kind):
                    continue
                plan = reader.plan(piece.spec, kind, topo.tp_size, topo.coords.tp_rank,
                                   piece.lo, piece.hi)
                plans.append((piece, kind, plan))
                files.update(p["file"] for p in plan) if plan is not None \
                    else files.update(reader.files_for([piece.spec.name]))
        for name in sorted(files):
            verify_file(ckpt, name, meta["files"][name])
        same_layout = meta["layout"]["world_size"] == topo.world_size and all(
            meta["layout"][k] == v for k, v in (("tp", topo.tp_size), ("pp", topo.pp_size), ("dp", topo.dp_size)))
        rng_name = f"rng_rank{topo.rank:05d}.pt"
        if same_layout:
            verify_file(ckpt, rng_name, meta["files"][rng_name])
    except (CheckpointError, KeyError, OSError, TypeError, ValueError) as e:
        error = f"{ckpt}: {type(e).__name__}: {e}" if not isinstance(e, CheckpointError) else str(e)
    _agree_to_load(ckpt, error, meta.get("step"), topo.world_group)

    cache: Dict[Tuple[str, str], torch.Tensor] = {}

    def resliced(spec: ParamSpec, kind: str) -> torch.Tensor:
        """This rank's flattened slice, cut from the rebuilt global tensor (TP split changed)."""
        key = (spec.name, kind)
        if key not in cache:
            cache.clear()  # one global tensor at a time
            full = reader.global_tensor(spec.name, kind)
            cache[key] = spec.shard(full, topo.coords.tp_rank, topo.tp_size).reshape(-1)
        return cache[key]

    with torch.no_grad():
        for piece, kind, plan in plans:
            if plan is not None:
                values = reader.read_range(plan, piece.lo, piece.hi)
            else:
                values = resliced(piece.spec, kind)[piece.lo:piece.hi]
            engine.load_state_piece(piece, kind, values, meta["adam_step"])
        engine.params_from_master()
    rng = torch.load(ckpt / rng_name, weights_only=False) if same_layout else None
    return meta, rng


def _agree_to_load(ckpt: Path, error: Optional[str], step: Optional[int],
                   group: comm.Group) -> None:
    """Collective: every rank found its part of the checkpoint sound, and all of them are
    loading the same step; else CheckpointError on every rank, naming the first problem.
    (The verdicts travel as objects, which every backend carries: NCCL has no CPU tensors.)"""
    verdicts = comm.gather_objects((error, step), group)
    errors = [(rank, e) for rank, (e, _) in enumerate(verdicts) if e]
    if errors:
        rank, first = errors[0]
        raise CheckpointError(first if first == error else f"rank {rank}: {first}")
    steps = sorted({s for _, s in verdicts})
    if len(steps) > 1:
        raise CheckpointError(f"{ckpt}: the ranks are loading different checkpoints (steps "
                              f"{steps}); every rank must resume from the same step")


def resume(setting: str, root: Path, engine, cfg: Config, topo: Topology
           ) -> Optional[Tuple[Path, dict, Optional[dict]]]:
    """The resume policy of `checkpoint.resume` (collective): load the first usable of its
    candidates (`resolve.candidates`: the named checkpoint, or for auto the complete ones in
    `root`, newest first, a damaged one skipped for the one before it). Returns (path, meta,
    this rank's RNG state or None), or None when there is nothing to resume (none, or auto
    with no checkpoint yet); raises CheckpointError when nothing named loads."""
    tried = candidates(setting, root, topo.world_group)
    if setting == "auto" and not tried:
        get_logger().info(f"checkpoint.resume=auto: no complete checkpoint in {root}; starting "
                          "from scratch")
    for path in tried:
        try:
            meta, rng = load_checkpoint(path, engine, cfg, topo)
        except CheckpointError as e:
            if setting != "auto":
                raise
            get_logger().warning(f"checkpoint {path} unusable, trying the previous one: {e}")
            continue
        return path, meta, rng
    if tried:
        raise CheckpointError(f"no usable checkpoint in {root}")
    return None
