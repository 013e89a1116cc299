"""Writing a checkpoint: a rank's snapshot at the end of a step, and the publication protocol
(see `megalite.checkpoint.format` for the layout on disk).

Every rank writes its snapshot into `step_N.tmp/`; rank 0 publishes `step_N/` (meta.json
fsynced, then an atomic rename) only after every rank reported its files written, and deletes
checkpoints beyond `keep`. Any rank's failure is agreed on: nothing is published and every rank
raises the same error.
"""
from __future__ import annotations

import json
import os
import shutil
import time
import zlib
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Callable, List, Optional

import torch

from megalite.checkpoint.errors import CheckpointError
from megalite.checkpoint.format import (
    CRC_BLOCK_BYTES,
    FORMAT_VERSION,
    KINDS,
    meta_crc32,
    rank_file,
    written_range,
)
from megalite.checkpoint.index import spec_record, write_index
from megalite.checkpoint.resolve import complete_checkpoints, discard
from megalite.checkpoint.state import SavedState
from megalite.config.schema import Config
from megalite.parallel import comm
from megalite.parallel.group import Group
from megalite.parallel.topology import Topology
from megalite.utils.durable import fsync_dir
from megalite.utils.log import get_logger


def written_numel(engine, topo: Topology) -> int:
    """Elements this rank writes into a checkpoint (once AdamW's moments exist)."""
    total = 0
    for p in engine.state_pieces():
        part = written_range(p, topo)
        total += 0 if part is None else part[1] - part[0]
    return len(KINDS) * total


@dataclass
class Snapshot:
    """What one rank writes into a checkpoint, as of the end of one optimizer step.

    `tensors` are the values of `pieces`, in file order: the live master weights and moments
    for a save in the training thread, or copies in a staging buffer for a save in the
    background (`take_snapshot(..., staging=...)`), which training may then overwrite."""
    step: int
    tensors: List[torch.Tensor]
    pieces: List[dict]
    state: SavedState  # the run state's parts (`RunState.capture()`)
    adam_step: int
    layout: dict  # the writer's `Layout.as_dict()`


def take_snapshot(engine, state: SavedState, cfg: Config, topo: Topology,
                  staging: Optional[Callable[[int], torch.Tensor]] = None) -> Snapshot:
    """This rank's pieces and `state`, at the step `state` records. With `staging` (numel -> a
    flat fp32 CPU buffer), the pieces' values are copied into it (device-to-host for CUDA
    tensors) before returning."""
    data_file = f"rank{topo.rank:05d}.bin"
    tensors, pieces, offset = [], [], 0
    for piece in engine.state_pieces():
        part = written_range(piece, topo)
        if part is None:
            continue
        a, b = part
        # an expert whole on each TP rank (ep > 1): its ranges are of the whole tensor, as
        # one TP rank's would be
        folded = piece.spec.tp_folded
        for kind in KINDS:
            t = piece.tensors.get(kind)
            if t is None:
                continue
            tensors.append(t.detach().reshape(-1)[a - piece.lo:b - piece.lo])
            pieces.append({"name": piece.spec.name, "kind": kind,
                           "tp_rank": 0 if folded else topo.coords.tp_rank, "lo": a, "hi": b,
                           "file": data_file, "offset": offset,
                           "spec": spec_record(piece.spec, 1 if folded else topo.tp_size)})
            offset += 4 * (b - a)
    if staging is not None:
        flat = staging(offset // 4)
        views, at = [], 0
        for t in tensors:
            view = flat[at:at + t.numel()]
            view.copy_(t, non_blocking=True)
            views.append(view)
            at += t.numel()
        if any(t.is_cuda for t in tensors):
            torch.cuda.synchronize()
        tensors = views
    return Snapshot(state.step, tensors, pieces, state, engine.adam_step(),
                    engine.layout.as_dict())


class BlockCRC:
    """CRC32 of a file written as a stream: the whole file's, and one per block of
    `CRC_BLOCK_BYTES` (format 4), so a reader can verify just the blocks it reads."""

    def __init__(self, block_bytes: int):
        self.block_bytes, self.blocks = block_bytes, []
        self.crc, self.block_crc, self.filled, self.size = 0, 0, 0, 0

    def update(self, raw: memoryview) -> None:
        self.crc = zlib.crc32(raw, self.crc)
        self.size += len(raw)
        while len(raw):
            take = min(len(raw), self.block_bytes - self.filled)
            self.block_crc = zlib.crc32(raw[:take], self.block_crc)
            self.filled += take
            raw = raw[take:]
            if self.filled == self.block_bytes:
                self.blocks.append(self.block_crc)
                self.block_crc, self.filled = 0, 0

    def record(self) -> dict:
        blocks = self.blocks + ([self.block_crc] if self.filled else [])
        return {"bytes": self.size, "crc32": self.crc, "block_bytes": self.block_bytes,
                "block_crc32": blocks}


def _write_rank_files(tmp: Path, snap: Snapshot, rank: int) -> dict:
    """This rank's data file (its pieces, raw little-endian fp32, fsynced) and the files of
    the run state's per-rank parts (the RNG's); returns their sizes and CRC32s (the data
    file's per block too)."""
    data_file = f"rank{rank:05d}.bin"
    crc = BlockCRC(CRC_BLOCK_BYTES)  # read at call time: a test may shrink it
    with open(tmp / data_file, "wb") as f:
        for t in snap.tensors:
            raw = t.to("cpu", torch.float32).contiguous().numpy().data
            f.write(raw)
            crc.update(raw.cast("B"))
        f.flush()
        os.fsync(f.fileno())
    files = {data_file: crc.record()}
    for name, state in snap.state.rank_files.items():
        path = tmp / rank_file(name, rank)
        with open(path, "wb") as f:
            torch.save(state, f)
            f.flush()
            os.fsync(f.fileno())
        files[path.name] = {"bytes": path.stat().st_size,
                            "crc32": zlib.crc32(path.read_bytes())}
    return files


def _publish(root: Path, tmp: Path, final: Path, snap: Snapshot, cfg: Config, topo: Topology,
             keep: int, gathered: List) -> None:
    """Rank 0: meta.json (fsynced), then the atomic rename, then old checkpoints beyond `keep`
    deleted. meta.json: the checkpoint's record (`format.RECORD_KEYS`) and the run state's
    parts (`checkpoint.state`); "consumed_samples" repeats the sampler's, for a reader's
    glance and the resumed run's warnings."""
    sources = cfg.data.sources()
    parts = snap.state.meta
    meta = {"format_version": FORMAT_VERSION, **parts,
            "consumed_samples": parts["sampler"]["consumed_samples"],
            "adam_step": snap.adam_step,
            "layout": snap.layout,
            "model": asdict(cfg.model), "config": asdict(cfg), "time": time.time(),
            "data_dir": str(sources[0][0]),  # the tokenizer's (the same for a blend)
            "data_sources": [[str(d), w] for d, w in sources],
            "files": {k: v for _, fs, _ in gathered for k, v in fs.items()},
            "tensors": write_index(tmp, [p for ps, _, _ in gathered for p in ps])}
    meta["meta_crc32"] = meta_crc32(meta)
    with open(tmp / "meta.json", "w") as f:
        json.dump(meta, f)
        f.flush()
        os.fsync(f.fileno())
    if final.exists():
        discard(final)
    os.replace(tmp, final)
    fsync_dir(root)  # the rename itself survives a power loss before the old ones go
    for old in complete_checkpoints(root)[:-keep]:
        try:
            discard(old)
        except OSError as e:  # step_N is published: a stale old one is not worth the run
            get_logger().warning(f"published {final.name} but could not "
                                 f"delete {old} (checkpoint.keep={keep}): "
                                 f"{type(e).__name__}: {e}")


def write_snapshot(root: Path, snap: Snapshot, cfg: Config, topo: Topology, keep: int,
                   group: Group) -> Path:
    """Collective over `group` (all ranks, the checkpoint group): every rank writes its
    snapshot into `step_N.tmp/`, the piece index goes to rank 0 only, which publishes
    `step_N/` and broadcasts the verdict. Any rank's failure is agreed on: nothing is
    published and every rank raises CheckpointError naming the rank and the error (the
    unfinished `step_N.tmp/` is deleted at the next start)."""
    rank = topo.rank
    final, tmp = root / f"step_{snap.step:08d}", root / f"step_{snap.step:08d}.tmp"
    error: Optional[str] = None
    if rank == 0:
        try:
            if tmp.exists():
                shutil.rmtree(tmp)
            tmp.mkdir(parents=True)
        except OSError as e:
            error = f"rank 0: {type(e).__name__}: {e}"
    comm.barrier(group)
    files: dict = {}
    if error is None:
        try:
            files = _write_rank_files(tmp, snap, rank)
        except Exception as e:  # noqa: BLE001 - reported to every rank, which all raise
            error = f"rank {rank}: {type(e).__name__}: {e}"
    gathered = comm.gather_objects_to_root((snap.pieces, files, error), group)  # the index
    errors: List[str] = []
    if rank == 0:
        errors = [e for _, _, e in gathered if e]
        if not errors:
            try:
                _publish(root, tmp, final, snap, cfg, topo, keep, gathered)
            except OSError as e:
                errors = [f"rank 0 publishing: {type(e).__name__}: {e}"]
    errors = comm.broadcast_object(errors, group)
    if errors:
        more = f" (and {len(errors) - 1} more)" if len(errors) > 1 else ""
        raise CheckpointError(f"checkpoint {final} was not published: {errors[0]}{more}")
    return final


def save_checkpoint(root: Path, engine, state: SavedState, cfg: Config, topo: Topology,
                    keep: int) -> Path:
    """Collective, in the calling thread: every rank must call it. Returns the published
    directory. Background saves: `megalite.checkpoint.async_save`."""
    snap = take_snapshot(engine, state, cfg, topo)
    return write_snapshot(root, snap, cfg, topo, keep, topo.checkpoint_group)
