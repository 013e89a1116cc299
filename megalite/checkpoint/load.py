"""Restoring a checkpoint into the current layout, whatever layout wrote it.

Before anything is loaded, every rank checks meta.json's own CRC32, the index and the sizes and
CRC32s of the files it will read; the verdict is agreed over all ranks, so either every rank
loads a checkpoint or none does. Then each rank reads its owned ranges — only those elements,
whatever TP split wrote them (`checkpoint.reslice`) — and hands them to the engine.
"""
from __future__ import annotations

from pathlib import Path
from typing import Dict, List, NamedTuple, Optional, Sequence, Tuple

import torch

from megalite.checkpoint.errors import CheckpointError
from megalite.checkpoint.format import (
    KINDS,
    Reader,
    check_compatible,
    rank_file,
    read_meta,
    verify_file,
    verify_ranges,
)
from megalite.checkpoint.resolve import candidates
from megalite.config.schema import DEFAULT_RANK_ORDER, Config
from megalite.parallel import comm
from megalite.parallel.group import Group
from megalite.parallel.topology import Topology
from megalite.utils.log import get_logger


class Loaded(NamedTuple):
    meta: dict
    # a per-rank part's name -> this rank's state; None when the layout differs from the
    # writer's, or the checkpoint has no such file (written before the part existed)
    rank_files: Dict[str, Optional[dict]]
    verified_bytes: int  # read to check CRC32s before the ranks agreed to load
    read_bytes: int  # read to fill this rank's state


def load_checkpoint(ckpt: Path, engine, cfg: Config, topo: Topology,
                    rank_files: Sequence[str] = ()) -> Loaded:
    """Collective. Verify, then restore master weights, moments and parameters of this rank's
    part under the current layout, and read this rank's files of the run state's per-rank
    parts named in `rank_files` (`RunState.rank_files`; the writer's layout only). Each rank
    checks only what it will read (format 4: the CRC32 blocks its byte ranges touch; format 3:
    whole files), then the ranks agree. Raises CheckpointError (on every rank) if any rank
    finds the checkpoint incomplete or corrupted; nothing is modified then."""
    error: Optional[str] = None
    meta: dict = {}
    plans: list = []
    verified = 0
    readable: List[str] = []  # the files of `rank_files` this rank reads
    try:
        meta = read_meta(ckpt)
        check_compatible(meta, cfg, ckpt)
        reader = Reader(ckpt, meta)
        plans, ranges = plan_reads(reader, engine, topo)
        for name in sorted(ranges):
            verified += verify_ranges(ckpt, name, meta["files"][name], ranges[name])
        if same_ranks(meta["layout"], topo):
            readable = [f for f in (rank_file(n, topo.rank) for n in rank_files)
                        if f in meta["files"]]
        for name in readable:
            verify_file(ckpt, name, meta["files"][name])
    except Exception as e:  # noqa: BLE001 - every rank must reach the verdict, whatever it is
        error = f"{ckpt}: {type(e).__name__}: {e}" if not isinstance(e, CheckpointError) \
            else str(e)
    _agree_to_load(ckpt, error, meta.get("step"), topo.checkpoint_group)
    _fill(reader, plans, engine, meta["adam_step"])
    states = {n: torch.load(ckpt / rank_file(n, topo.rank), weights_only=False)
              if rank_file(n, topo.rank) in readable else None for n in rank_files}
    # the slowest reader is waited for here, on the checkpoint group's timeout, not in the
    # first collective of a training group (the ZeRO parameter gather below)
    comm.barrier(topo.checkpoint_group)
    engine.params_from_master()
    return Loaded(meta, states, verified, reader.bytes_read)


def same_ranks(written: dict, topo: Topology) -> bool:
    """Whether the checkpoint's layout (`written`, its meta.json's) put every rank at the
    coordinates `topo` gives it, so that a rank may read its own per-rank files: the same
    sizes and the same rank order (no "cp": written before context parallelism; no
    "rank_order": before the key, the default). Under another order rank r's files are
    another coordinate's."""
    sizes = (("tp", topo.tp_size), ("cp", topo.cp_size), ("pp", topo.pp_size),
             ("dp", topo.dp_size))
    return written["world_size"] == topo.world_size \
        and all(written.get(k, 1) == v for k, v in sizes) \
        and written.get("rank_order", DEFAULT_RANK_ORDER) == topo.rank_order


def plan_reads(reader: Reader, engine, topo: Topology
                ) -> Tuple[list, Dict[str, List[Tuple[int, int]]]]:
    """For each owned piece and kind, the reads that fill it (`Reader.reads`: only its own
    elements, whatever TP split wrote them), and per file the byte ranges (offset, bytes)
    they touch, for the CRC pass."""
    plans, ranges = [], {}
    for piece in sorted(engine.state_pieces(), key=lambda p: p.spec.name):
        for kind in KINDS:
            if kind != "param" and not reader.has(piece.spec.name, kind):
                continue
            reads = reader.reads(piece.spec, kind, topo.tp_size, topo.coords.tp_rank,
                                 piece.lo, piece.hi)
            plans.append((piece, kind, reads))
            for file, offset, n, _ in reads:
                ranges.setdefault(file, []).append((offset, 4 * n))
    return plans, ranges


@torch.no_grad()
def _fill(reader: Reader, plans: list, engine, adam_step: int) -> None:
    """Read each planned piece into the engine's master weights and moments."""
    for piece, kind, reads in plans:
        engine.load_state_piece(piece, kind, reader.read(reads, piece.hi - piece.lo), adam_step)


def _agree_to_load(ckpt: Path, error: Optional[str], step: Optional[int],
                   group: Group) -> None:
    """Collective over the checkpoint group: every rank found its part of the checkpoint
    sound, and all of them are loading the same step; else CheckpointError on every rank,
    naming the first problem. The verdicts go to rank 0, which broadcasts the outcome."""
    verdicts = comm.gather_objects_to_root((error, step), group)
    problem: Optional[Tuple[Optional[int], str]] = None  # (the rank that found it, what)
    if group.rank == 0:
        errors = [(rank, e) for rank, (e, _) in enumerate(verdicts) if e]
        steps = sorted({s for _, s in verdicts})
        if errors:
            problem = errors[0]
        elif len(steps) > 1:
            problem = (None, f"{ckpt}: the ranks are loading different checkpoints (steps "
                             f"{steps}); every rank must resume from the same step")
    problem = comm.broadcast_object(problem, group)
    if problem is not None:
        rank, what = problem
        raise CheckpointError(what if rank in (None, group.rank) else f"rank {rank}: {what}")


def resume(setting: str, root: Path, engine, cfg: Config, topo: Topology,
           rank_files: Sequence[str] = ()) -> Optional[Tuple[Path, Loaded]]:
    """The resume policy of `checkpoint.resume` (collective): load the first usable of its
    candidates (`resolve.candidates`: the named checkpoint, or for auto the complete ones in
    `root`, newest first, a damaged one skipped for the one before it). Returns (path, what
    `load_checkpoint` loaded), or None when there is nothing to resume (none, or auto with no
    checkpoint yet); raises CheckpointError when nothing named loads."""
    tried = candidates(setting, root, topo.checkpoint_group)
    if setting == "auto" and not tried:
        get_logger().info(f"checkpoint.resume=auto: no complete checkpoint in {root}; starting "
                          "from scratch")
    for path in tried:
        try:
            loaded = load_checkpoint(path, engine, cfg, topo, rank_files)
        except CheckpointError as e:
            if setting != "auto":
                raise
            get_logger().warning(f"checkpoint {path} unusable, trying the previous one: {e}")
            continue
        return path, loaded
    if tried:
        raise CheckpointError(f"no usable checkpoint in {root}")
    return None
