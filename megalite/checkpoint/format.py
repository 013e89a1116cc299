"""Sharded, layout-independent checkpoints: written in parallel, loadable under any layout.

    <checkpoint.dir>/step_00000100/
        rank00003.bin       this rank's pieces of global tensors, raw little-endian fp32
        rng_rank00003.pt    this rank's RNG streams (restored when the layout is unchanged)
        index/<tensor>.json where each piece of one global tensor lies (`checkpoint.index`)
        meta.json           written last by rank 0: the run state's parts (step, skipped steps,
                            sampler position, fp16 loss scale, rerun statistics:
                            `checkpoint.state`), layout, model shape, every file's size and CRC32
                            (per 1 MiB block for rank files), each index file's, and the CRC32
                            of meta.json's own content

A *piece* is a contiguous range [lo, hi) of one TP rank's slice (flattened) of one global tensor
(HF name, e.g. `transformer.h.3.attn.c_attn.weight`) of one kind (`param` = the fp32 master
weights, `exp_avg`, `exp_avg_sq` = AdamW's moments). ZeRO ranges cut tensors into such pieces,
TP slices are recorded with the spec that made them (split dim, [q|k|v] interleave, vocab
padding), and every element is written by exactly one rank: DP replicas (zero 0), TP replicas
of replicated tensors and the pipeline's second copy of the tied embedding write nothing.

Loading maps the range each rank owns under the *current* (tp, pp, dp, zero) onto the pieces
that hold it (`checkpoint.reslice`: exact runs of the writers' TP slices, so a rank reads its
share even when the TP size changed), checks that they cover it, and fills the master weights,
the moments and the model parameters — so any valid layout resumes any checkpoint.

The package: `format` (this file: the layout on disk, reading and verifying it), `index`
(the piece index, per tensor), `reslice` (a range of one TP split in runs of another),
`save` (snapshots and the publication protocol), `async_save` (saves in the background),
`load` (restore into any layout, agreed over the ranks), `resolve` (which checkpoint a path or
`checkpoint.resume` names), `state` (the run's stateful parts besides tensors, listed once),
`export` (to `transformers`; written a shard at a time by `hf_stream` from `tensor_reads`, the
parts of one export agreed by `export_parts`), `dcp_export` (DCP both ways, under the
family's DCP names: `Family.dcp`). The engine hands its state over as pieces
(`ZeroEngine.state_pieces`, `load_state_piece`); the progress, sampler, loss scaler, rerun
statistics and RNG through their `state_dict()`, walked as one list (`state.RunState`).

Format policy: a new key in meta.json that an older reader ignores needs no version bump; a
change an old reader would misread bumps FORMAT_VERSION, and the reader keeps accepting every
version it can read (`READABLE_VERSIONS`).

A save is a snapshot (`take_snapshot`: this rank's pieces and the run state's parts at the end
of a step) and its writing (`write_snapshot`), in the training thread or in a background thread
(`megalite.checkpoint.async_save`). A checkpoint counts only when complete: written under
`step_N.tmp/`, published by rank 0 with an atomic rename after every rank has reported its
files written and meta.json is on disk. A rank that fails to write is reported to all: nothing
is published and every rank raises the same error. Only `step_N`
directories holding a meta.json are ever picked; the `keep` most recent are kept. A directory
being replaced or deleted is first renamed out of the `step_N` namespace, so a crash midway
never leaves a half-deleted directory that looks complete. When a run starts at step k, the
checkpoints of steps after k (an abandoned continuation, or ones that failed to load) are moved
to `superseded/`, so they neither take `keep`'s places nor get picked by `resume=auto` again.

Before anything is loaded, on every rank: meta.json's own CRC32, the index of each tensor it
reads (its CRC32, every piece inside its file, every slice covered) and the sizes and CRC32s of
the blocks it reads are checked, and the
verdict is agreed over all ranks, so either every rank loads a checkpoint or none does.
"""
from __future__ import annotations

import bisect
import json
import os
import re
import zlib
from pathlib import Path
from typing import Dict, List, Optional, Tuple

import numpy as np
import torch

from megalite.checkpoint.errors import CheckpointError
from megalite.checkpoint.index import Index
from megalite.checkpoint.reslice import runs, same_split_axis
from megalite.config.schema import Config, ModelConfig
from megalite.parallel.bucket import StatePiece
from megalite.parallel.param_spec import ParamSpec
from megalite.parallel.topology import Topology

STEP_DIR = re.compile(r"^step_(\d{8})$")
FORMAT_VERSION = 5
READABLE_VERSIONS = (3, 4, 5)  # 4: per-block CRC32s of each rank file (3: one CRC32 per
#                                file); 5: the piece index in one file per tensor (index/)
CRC_BLOCK_BYTES = 2**20  # format 4: a CRC32 per block of this many bytes of a rank file (a
#                          resume verifies the blocks its reads touch: smaller blocks waste less
#                          where its ranges end mid-block; meta.json lists ~1 per MiB of state)
KINDS = ("param", "exp_avg", "exp_avg_sq")
SHAPE_KEYS = ("arch", "n_layer", "n_embd", "n_head", "n_kv_head", "n_positions", "vocab_size",
              "n_inner", "tie_word_embeddings", "rope_theta")
# meta.json's own entries, the checkpoint's record (format 3 wrote "pieces" where format 5
# writes "tensors"); every other entry is a stateful part's (`megalite.checkpoint.state`)
RECORD_KEYS = ("format_version", "consumed_samples", "adam_step", "layout", "model", "config",
               "time", "data_dir", "data_sources", "files", "tensors", "pieces", "meta_crc32")


def rank_file(name: str, rank: int) -> str:
    """The file of a per-rank part of the run state (`rng` -> `rng_rank00003.pt`)."""
    return f"{name}_rank{rank:05d}.pt"


def written_range(piece: StatePiece, topo: Topology) -> Optional[Tuple[int, int]]:
    """The part [a, b) of this rank's owned range of a piece that it writes, or None. Every
    element is written once: not by the tied embedding's second copy, not by TP ranks other
    than 0 for TP-replicated tensors nor by the later ranks sharing a TP slice
    (`ParamSpec.tp_writer`); a range that the DP x CP replicas all hold (zero 0; the CP ranks
    of a (tp, pp, dp) hold the same parameters) is written by the replica that zero >= 1 would
    give it (`StatePiece.dp_share`, over `Topology.grad_group`), so a save uses every
    replica's bandwidth and a resume under zero >= 1 on the same dp x cp reads its own file."""
    spec = piece.spec
    if spec.tied_copy or not spec.tp_writer(topo.coords.tp_rank):
        return None
    a, b = piece.dp_share
    return (a, b) if a < b else None


def meta_crc32(meta: dict) -> int:
    body = {k: v for k, v in meta.items() if k != "meta_crc32"}
    return zlib.crc32(json.dumps(body, sort_keys=True).encode())


def read_meta(ckpt: Path) -> dict:
    path = ckpt / "meta.json"
    if not path.is_file():
        raise CheckpointError(f"{ckpt} is not a complete checkpoint (no meta.json)")
    try:
        meta = json.loads(path.read_text())
    except json.JSONDecodeError as e:
        raise CheckpointError(f"{path}: corrupted ({e})") from e
    if "model" not in meta and "splits" in meta:  # scripts/prepare_data.py's meta.json
        raise CheckpointError(f"{ckpt}: a prepared data directory (its meta.json lists token "
                              "shards), not a checkpoint; give a checkpoint step_NNNNNNNN "
                              "(e.g. <run dir>/checkpoints/step_00000300) or a checkpoint.dir")
    if meta.get("format_version") not in READABLE_VERSIONS:
        raise CheckpointError(f"{path}: format version {meta.get('format_version')} (this "
                              f"megalite reads versions {', '.join(map(str, READABLE_VERSIONS))})")
    if meta.get("meta_crc32") != meta_crc32(meta):
        raise CheckpointError(f"{path}: its content does not match its CRC32 (corrupted)")
    return meta


def verify_file(ckpt: Path, name: str, record: dict) -> None:
    """Size and CRC32 of one file against meta.json; raises CheckpointError naming it."""
    path = ckpt / name
    if not path.is_file():
        raise CheckpointError(f"{path}: missing (listed in {ckpt / 'meta.json'})")
    size = path.stat().st_size
    if size != record["bytes"]:
        raise CheckpointError(f"{path}: {size} bytes, meta.json lists {record['bytes']} "
                              "(truncated or overwritten)")
    crc = 0
    with open(path, "rb") as f:
        while chunk := f.read(1 << 24):
            crc = zlib.crc32(chunk, crc)
    if crc != record["crc32"]:
        raise CheckpointError(f"{path}: CRC32 {crc:#010x} != {record['crc32']:#010x} in "
                              "meta.json (corrupted)")


def needed_blocks(record: dict, ranges: List[Tuple[int, int]]) -> List[int]:
    """The CRC blocks of a format-4 file that byte ranges (offset, nbytes) touch."""
    size = record["block_bytes"]
    blocks = set()
    for offset, nbytes in ranges:
        if nbytes > 0:
            blocks.update(range(offset // size, (offset + nbytes - 1) // size + 1))
    return sorted(blocks)


def verify_ranges(ckpt: Path, name: str, record: dict, ranges: List[Tuple[int, int]]) -> int:
    """Check the parts of one file a rank will read: with per-block CRC32s (format 4) only the
    blocks that the byte ranges (offset, nbytes) touch, else (format 3) the whole file.
    Returns the bytes read; raises CheckpointError naming the file and the block."""
    if "block_crc32" not in record:
        verify_file(ckpt, name, record)
        return record["bytes"]
    path = ckpt / name
    if not path.is_file():
        raise CheckpointError(f"{path}: missing (listed in {ckpt / 'meta.json'})")
    if path.stat().st_size != record["bytes"]:
        raise CheckpointError(f"{path}: {path.stat().st_size} bytes, meta.json lists "
                              f"{record['bytes']} (truncated or overwritten)")
    size, read = record["block_bytes"], 0
    with open(path, "rb") as f:
        for block in needed_blocks(record, ranges):
            f.seek(block * size)
            data = f.read(size)
            read += len(data)
            if zlib.crc32(data) != record["block_crc32"][block]:
                raise CheckpointError(f"{path}: block {block} (bytes {block * size}..."
                                      f"{block * size + len(data)}) does not match its CRC32 "
                                      "in meta.json (corrupted)")
    return read


class Reader:
    """Reads a checkpoint's tensors through its index (checked per tensor on first use), each
    rank only its own elements: the same TP split reads the rank's range of its own slice, a
    changed one the runs of the writers' slices that hold it (`checkpoint.reslice`)."""

    def __init__(self, ckpt: Path, meta: dict):
        self.ckpt = ckpt
        self.index = Index(ckpt, meta)
        self.bytes_read = 0  # tensor data read so far

    def has(self, name: str, kind: str) -> bool:
        return name in self.index and kind in self.index.tensor(name).pieces

    def reads(self, spec: ParamSpec, kind: str, tp: int, tp_rank: int, lo: int, hi: int
              ) -> List[Tuple[str, int, int, int]]:
        """(file, byte offset, elements, destination) of each read that fills elements [lo, hi)
        of TP rank `tp_rank`'s flattened slice of `spec` (destinations relative to lo); the
        elements no read covers are vocabulary padding (zero)."""
        tensor = self.index.tensor(spec.name)
        if not same_split_axis(spec, tensor.spec):
            raise CheckpointError(f"{self.ckpt}: {spec.name} was split along dim "
                                  f"{tensor.spec.tp_dim} in blocks of {tensor.spec.tp_interleave}"
                                  f" with shape {tensor.spec.shape}; this model splits it along "
                                  f"{spec.tp_dim} in {spec.tp_interleave} with {spec.shape}")
        pieces = {w: tensor.of_rank(kind, w) for w in range(tensor.tp)}
        starts = {w: [p.lo for p in ps] for w, ps in pieces.items()}
        out = []
        for run in runs(spec, tp, tp_rank, tensor.spec, tensor.tp, lo, hi):
            src, dst, n = run.src, run.dst, run.length
            ps = pieces[run.writer]
            for p in ps[max(0, bisect.bisect_right(starts[run.writer], src) - 1):]:
                if p.lo >= src + n:
                    break
                a, b = max(src, p.lo), min(src + n, p.hi)
                if a < b:
                    out.append((p.file, p.offset + 4 * (a - p.lo), b - a, dst + a - src))
        return out

    def read(self, reads: List[Tuple[str, int, int, int]], numel: int) -> torch.Tensor:
        """The planned reads into a zero-filled flat fp32 tensor of `numel` elements."""
        out = np.zeros(numel, dtype=np.float32)
        handles: Dict[str, int] = {}
        try:
            for file, offset, n, dst in reads:
                if file not in handles:
                    handles[file] = os.open(self.ckpt / file, os.O_RDONLY)
                view = memoryview(out[dst:dst + n]).cast("B")
                got = os.preadv(handles[file], [view], offset)
                if got != 4 * n:
                    raise CheckpointError(f"{self.ckpt / file}: short read at {offset}")
                self.bytes_read += got
        finally:
            for fd in handles.values():
                os.close(fd)
        return torch.from_numpy(out)

    def global_tensor(self, name: str, kind: str) -> torch.Tensor:
        """The whole tensor (logical shape, unpadded) from every writer TP rank's slice."""
        spec = self.index.tensor(name).spec
        whole = ParamSpec(name, spec.shape, spec.tp_dim, spec.tp_interleave)
        numel = int(np.prod(spec.shape))
        return self.read(self.reads(whole, kind, 1, 0, 0, numel), numel).view(spec.shape)


def read_global_state(ckpt: Path, kind: str = "param") -> Dict[str, torch.Tensor]:
    """Every global tensor of a checkpoint (HF names, nn.Linear layout, fp32, vocabulary
    unpadded), whatever layout wrote it: for export, generation and inspection. Verifies the
    files it reads; reads one process's worth (no process group needed)."""
    ckpt = Path(ckpt)
    meta = read_meta(ckpt)
    reader = Reader(ckpt, meta)
    names = [n for n in reader.index.names() if reader.has(n, kind)]
    files = sorted({p.file for n in names for p in reader.index.tensor(n).pieces[kind]})
    for name in files:
        verify_file(ckpt, name, meta["files"][name])  # whole files: every piece is read
    return {name: reader.global_tensor(name, kind) for name in names}


def shape_mismatch(theirs: dict, cfg: ModelConfig, where: str,
                   keys: Tuple[str, ...] = SHAPE_KEYS) -> Optional[str]:
    """What is wrong, if anything, between a checkpoint's model (meta.json's "model", trained
    by `where`) and `cfg`: the first differing key of `keys`, named with both values. The MLP
    size counts, not how it was written (n_inner=null is 4 * n_embd, n_kv_head=null n_head); a
    key an older megalite did not record has its default (a GPT-2 then)."""
    defaults = ModelConfig()
    for key in keys:
        ours, recorded = getattr(cfg, key), theirs.get(key, getattr(defaults, key))
        if key == "n_inner":
            same = cfg.ffn_size == (recorded if recorded is not None else 4 * theirs.get("n_embd"))
        elif key == "n_kv_head":
            same = cfg.kv_heads == (recorded if recorded is not None else theirs.get("n_head"))
        else:
            same = recorded == ours
        if not same:
            return (f"model.{key}={ours!r}: {where} was trained with {key}={recorded!r}; set "
                    f"model.{key}={recorded!r}")
    return None


def check_compatible(meta: dict, cfg: Config, ckpt: Path) -> None:
    problem = shape_mismatch(meta["model"], cfg.model, f"checkpoint {ckpt}")
    if problem is not None:
        raise CheckpointError(f"{problem} to resume it")
