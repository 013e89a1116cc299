"""Sharded, layout-independent checkpoints: written in parallel, loadable under any layout.

    <checkpoint.dir>/step_00000100/
        rank00003.bin       this rank's pieces of global tensors, raw little-endian fp32
        rng_rank00003.pt    this rank's RNG streams (restored when the layout is unchanged)
        meta.json           written last by rank 0: step, sampler position, skipped steps, the
                            fp16 loss scale, layout, model shape, the index of every piece,
                            every file's size and CRC32, and the CRC32 of meta.json's own
                            content

A *piece* is a contiguous range [lo, hi) of one TP rank's slice (flattened) of one global tensor
(HF name, e.g. `transformer.h.3.attn.c_attn.weight`) of one kind (`param` = the fp32 master
weights, `exp_avg`, `exp_avg_sq` = AdamW's moments). ZeRO ranges cut tensors into such pieces,
TP slices are recorded with the spec that made them (split dim, [q|k|v] interleave, vocab
padding), and every element is written by exactly one rank: DP replicas (zero 0), TP replicas
of replicated tensors and the pipeline's second copy of the tied embedding write nothing.

Loading rebuilds each global tensor from its pieces (checking that they cover it), cuts the
slice the current rank owns under the *current* (tp, pp, dp, zero), and fills the master
weights, the moments and the model parameters — so any valid layout resumes any checkpoint.

A save is a snapshot (`take_snapshot`: this rank's pieces, RNG and data position at the end of
a step) and its writing (`write_snapshot`), in the training thread or in a background thread
(`megalite.train.async_checkpoint`). A checkpoint counts only when complete: written under
`step_N.tmp/`, published by rank 0 with an atomic rename after every rank has reported its
files written and meta.json is on disk. A rank that fails to write is reported to all: nothing
is published and every rank raises the same error. Only `step_N`
directories holding a meta.json are ever picked; the `keep` most recent are kept. A directory
being replaced or deleted is first renamed out of the `step_N` namespace, so a crash midway
never leaves a half-deleted directory that looks complete. When a run starts at step k, the
checkpoints of steps after k (an abandoned continuation, or ones that failed to load) are moved
to `superseded/`, so they neither take `keep`'s places nor get picked by `resume=auto` again.

Before anything is loaded, on every rank: meta.json's own CRC32, the index (every piece inside
its file, every tensor slice covered) and the files' sizes and CRC32s are checked, and the
verdict is agreed over all ranks, so either every rank loads a checkpoint or none does.
"""
from __future__ import annotations

import copy
import json
import os
import random
import re
import shutil
import sys
import time
import zlib
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Callable, Dict, List, Optional, Tuple

import numpy as np
import torch
import torch.distributed as dist

from megalite.config import Config, ModelConfig, data_sources
from megalite.parallel.param_spec import ParamSpec
from megalite.parallel.topology import Topology

STEP_DIR = re.compile(r"^step_(\d{8})$")
FORMAT_VERSION = 3
SUPERSEDED_DIR = "superseded"
KINDS = ("param", "exp_avg", "exp_avg_sq")
SHAPE_KEYS = ("n_layer", "n_embd", "n_head", "n_positions", "vocab_size", "n_inner")


class CheckpointError(RuntimeError):
    pass


def _distributed() -> bool:
    return dist.is_available() and dist.is_initialized()


def _barrier(group: Optional[dist.ProcessGroup] = None) -> None:
    if _distributed():
        dist.barrier(group=group)


def _gather_objects(obj, group: Optional[dist.ProcessGroup] = None) -> List:
    if not _distributed():
        return [obj]
    out = [None] * dist.get_world_size(group)
    dist.all_gather_object(out, obj, group=group)
    return out


def broadcast_object(obj, group: Optional[dist.ProcessGroup] = None):
    """Rank 0's `obj` on every rank."""
    if not _distributed():
        return obj
    box = [obj]
    dist.broadcast_object_list(box, src=0, group=group)
    return box[0]


def complete_checkpoints(root: Path) -> List[Path]:
    """Complete checkpoints under `root`, oldest first."""
    if not root.is_dir():
        return []
    found = [p for p in root.iterdir() if STEP_DIR.match(p.name) and (p / "meta.json").is_file()]
    return sorted(found, key=lambda p: p.name)


def _discard(path: Path) -> None:
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


def _spec_record(spec: ParamSpec, tp: int) -> dict:
    return {"shape": list(spec.shape), "tp_dim": spec.tp_dim, "tp_interleave": spec.tp_interleave,
            "padded_rows": spec.padded_rows, "tp": tp}


def _writes(spec: ParamSpec, topo: Topology, zero: int) -> bool:
    """Whether this rank is the one that writes its copy of `spec`'s elements."""
    c = topo.coords
    if spec.tied_copy or (spec.tp_replicated and c.tp != 0):
        return False
    return zero >= 1 or c.dp == 0


# --- save ---------------------------------------------------------------------------------


def _meta_crc32(meta: dict) -> int:
    body = {k: v for k, v in meta.items() if k != "meta_crc32"}
    return zlib.crc32(json.dumps(body, sort_keys=True).encode())


def written_numel(engine, cfg: Config, topo: Topology) -> int:
    """Elements this rank writes into a checkpoint (once AdamW's moments exist)."""
    return len(KINDS) * sum(seg.param_hi - seg.param_lo for _, seg, _ in engine.main_params
                            if _writes(seg.spec, topo, cfg.zero))


@dataclass
class Progress:
    """Where a run stands besides its tensors (the same on every rank, kept in meta.json)."""
    sampler: dict  # the data position: consumed samples (per-dataset counts of a blend)
    skipped_steps: int = 0  # non-finite steps skipped so far
    loss_scaler: Optional[dict] = None  # precision=fp16: the dynamic loss scale's state


@dataclass
class Snapshot:
    """What one rank writes into a checkpoint, as of the end of one optimizer step.

    `tensors` are the values of `pieces`, in file order: the live master weights and moments
    for a save in the training thread, or copies in a staging buffer for a save in the
    background (`take_snapshot(..., staging=...)`), which training may then overwrite."""
    step: int
    tensors: List[torch.Tensor]
    pieces: List[dict]
    rng_state: dict
    progress: Progress
    adam_step: int


def take_snapshot(step: int, engine, rng_state: dict, progress: Progress, cfg: Config,
                  topo: Topology, staging: Optional[Callable[[int], torch.Tensor]] = None
                  ) -> Snapshot:
    """This rank's pieces at `step`. With `staging` (numel -> a flat fp32 CPU buffer), their
    values are copied into it (device-to-host for CUDA tensors) before returning."""
    data_file = f"rank{topo.rank:05d}.bin"
    tensors, pieces, offset = [], [], 0
    for piece_param, seg, _ in engine.main_params:
        if not _writes(seg.spec, topo, cfg.zero):
            continue
        state = engine.optimizer.state.get(piece_param, {})
        for kind, t in (("param", piece_param), ("exp_avg", state.get("exp_avg")),
                        ("exp_avg_sq", state.get("exp_avg_sq"))):
            if t is None:
                continue
            tensors.append(t.detach().reshape(-1))
            pieces.append({"name": seg.spec.name, "kind": kind, "tp_rank": topo.coords.tp,
                           "lo": seg.param_lo, "hi": seg.param_hi, "file": data_file,
                           "offset": offset, "spec": _spec_record(seg.spec, topo.tp)})
            offset += 4 * t.numel()
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
    return Snapshot(step, tensors, pieces, rng_state, copy.deepcopy(progress),
                    engine.adam_step())


def _write_rank_files(tmp: Path, snap: Snapshot, rank: int) -> dict:
    """This rank's data file (its pieces, raw little-endian fp32, fsynced) and RNG file;
    returns their sizes and CRC32s."""
    data_file, rng_file = f"rank{rank:05d}.bin", f"rng_rank{rank:05d}.pt"
    size, crc = 0, 0
    with open(tmp / data_file, "wb") as f:
        for t in snap.tensors:
            raw = t.to("cpu", torch.float32).contiguous().numpy().data
            f.write(raw)
            crc = zlib.crc32(raw, crc)
            size += raw.nbytes
        f.flush()
        os.fsync(f.fileno())
    with open(tmp / rng_file, "wb") as f:
        torch.save(snap.rng_state, f)
        f.flush()
        os.fsync(f.fileno())
    return {data_file: {"bytes": size, "crc32": crc},
            rng_file: {"bytes": (tmp / rng_file).stat().st_size,
                       "crc32": zlib.crc32((tmp / rng_file).read_bytes())}}


def _publish(root: Path, tmp: Path, final: Path, snap: Snapshot, cfg: Config, topo: Topology,
             keep: int, gathered: List) -> None:
    """Rank 0: meta.json (fsynced), then the atomic rename, then old checkpoints beyond `keep`
    deleted."""
    sources = data_sources(cfg.data)
    progress = snap.progress
    meta = {"format_version": FORMAT_VERSION, "step": snap.step,
            "consumed_samples": progress.sampler["consumed_samples"],
            "sampler": progress.sampler, "adam_step": snap.adam_step,
            "skipped_steps": progress.skipped_steps, "loss_scaler": progress.loss_scaler,
            "layout": {"tp": topo.tp, "pp": topo.pp, "dp": topo.dp, "zero": cfg.zero,
                       "sp": cfg.sp, "virtual_stages": cfg.parallel.virtual_stages,
                       "world_size": topo.world_size},
            "model": asdict(cfg.model), "config": asdict(cfg), "time": time.time(),
            "data_dir": str(sources[0][0]),  # the tokenizer's (the same for a blend)
            "data_sources": [[str(d), w] for d, w in sources],
            "files": {k: v for _, fs, _ in gathered for k, v in fs.items()},
            "pieces": [p for ps, _, _ in gathered for p in ps]}
    meta["meta_crc32"] = _meta_crc32(meta)
    with open(tmp / "meta.json", "w") as f:
        json.dump(meta, f)
        f.flush()
        os.fsync(f.fileno())
    if final.exists():
        _discard(final)
    os.replace(tmp, final)
    _fsync_dir(root)  # the rename itself survives a power loss before the old ones go
    for old in complete_checkpoints(root)[:-keep]:
        try:
            _discard(old)
        except OSError as e:  # step_N is published: a stale old one is not worth the run
            print(f"megalite: warning: published {final.name} but could not delete {old} "
                  f"(checkpoint.keep={keep}): {type(e).__name__}: {e}", file=sys.stderr)


def _fsync_dir(path: Path) -> None:
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def write_snapshot(root: Path, snap: Snapshot, cfg: Config, topo: Topology, keep: int,
                   group: Optional[dist.ProcessGroup] = None) -> Path:
    """Collective over `group` (default: the world): every rank writes its snapshot into
    `step_N.tmp/`, rank 0 publishes `step_N/`. Any rank's failure is agreed on: nothing is
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
    _barrier(group)
    files: dict = {}
    if error is None:
        try:
            files = _write_rank_files(tmp, snap, rank)
        except Exception as e:  # noqa: BLE001 - reported to every rank, which all raise
            error = f"rank {rank}: {type(e).__name__}: {e}"
    gathered = _gather_objects((snap.pieces, files, error), group)
    errors = [e for _, _, e in gathered if e]
    if not errors and rank == 0:
        try:
            _publish(root, tmp, final, snap, cfg, topo, keep, gathered)
        except OSError as e:
            errors = [f"rank 0 publishing: {type(e).__name__}: {e}"]
    errors = broadcast_object(errors, group)
    if errors:
        more = f" (and {len(errors) - 1} more)" if len(errors) > 1 else ""
        raise CheckpointError(f"checkpoint {final} was not published: {errors[0]}{more}")
    return final


def save_checkpoint(root: Path, step: int, engine, rng_state: dict, progress: Progress,
                    cfg: Config, topo: Topology, keep: int) -> Path:
    """Collective, in the calling thread: every rank must call it. Returns the published
    directory. Background saves: `megalite.train.async_checkpoint`."""
    snap = take_snapshot(step, engine, rng_state, progress, cfg, topo)
    return write_snapshot(root, snap, cfg, topo, keep)


# --- load ---------------------------------------------------------------------------------


def read_meta(ckpt: Path) -> dict:
    path = ckpt / "meta.json"
    if not path.is_file():
        raise CheckpointError(f"{ckpt} is not a complete checkpoint (no meta.json)")
    try:
        meta = json.loads(path.read_text())
    except json.JSONDecodeError as e:
        raise CheckpointError(f"{path}: corrupted ({e})") from e
    if meta.get("format_version") != FORMAT_VERSION:
        raise CheckpointError(f"{path}: format version {meta.get('format_version')} (this "
                              f"megalite reads {FORMAT_VERSION})")
    if meta.get("meta_crc32") != _meta_crc32(meta):
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


class _Reader:
    """Global tensors rebuilt from a checkpoint's pieces; the index is checked on creation."""

    def __init__(self, ckpt: Path, meta: dict):
        self.ckpt = ckpt
        self.index: Dict[Tuple[str, str], List[dict]] = {}
        for p in meta["pieces"]:
            self.index.setdefault((p["name"], p["kind"]), []).append(p)
        self._check_index(meta["files"])

    def _check_index(self, files: dict) -> None:
        """Every piece lies inside its file, and each TP slice of each tensor is covered by its
        pieces without a gap, so reading cannot fail halfway (after the ranks agreed)."""
        for (name, kind), pieces in self.index.items():
            spec, tp = self.written_spec(name, kind)
            numel = int(np.prod(spec.local_shape(tp)))
            for rank in range(tp if spec.tp_dim is not None else 1):
                end = 0
                for p in sorted((p for p in pieces if p["tp_rank"] == rank),
                                key=lambda p: p["lo"]):
                    size = files.get(p["file"], {}).get("bytes", -1)
                    if p["lo"] > end or p["offset"] + 4 * (p["hi"] - p["lo"]) > size:
                        break
                    end = max(end, p["hi"])
                if end < numel:
                    raise CheckpointError(f"{self.ckpt}: the pieces of {name} ({kind}, TP rank "
                                          f"{rank}) do not cover it or lie outside their file")

    def files_for(self, names: List[str]) -> List[str]:
        return sorted({p["file"] for (n, _), ps in self.index.items() if n in names for p in ps})

    def has(self, name: str, kind: str) -> bool:
        return (name, kind) in self.index

    def _pieces(self, name: str, kind: str) -> List[dict]:
        pieces = self.index.get((name, kind))
        if not pieces:
            raise CheckpointError(f"{self.ckpt}: no {kind} of {name}")
        return pieces

    def written_spec(self, name: str, kind: str) -> Tuple[ParamSpec, int]:
        """The spec the writer split `name` with, and the writer's TP size."""
        rec = self._pieces(name, kind)[0]["spec"]
        return ParamSpec(name, tuple(rec["shape"]), rec["tp_dim"], rec["tp_interleave"],
                         rec["padded_rows"]), rec["tp"]

    def plan(self, spec: ParamSpec, kind: str, tp: int, tp_rank: int, lo: int, hi: int
             ) -> Optional[List[dict]]:
        """The pieces holding elements [lo, hi) of TP rank `tp_rank`'s flattened slice when the
        writer split `spec` the same way (same TP size, padding, interleave): a rank then
        reads only its own range. None when the split changed (rebuild the global tensor)."""
        written, written_tp = self.written_spec(spec.name, kind)
        same = written.tp_dim == spec.tp_dim and written.tp_interleave == spec.tp_interleave \
            and written.padded_rows == spec.padded_rows and (spec.tp_dim is None or written_tp == tp)
        if not same:
            return None
        rank = tp_rank if spec.tp_dim is not None else 0
        return [p for p in self._pieces(spec.name, kind)
                if p["tp_rank"] == rank and p["lo"] < hi and p["hi"] > lo]

    def read_range(self, pieces: List[dict], lo: int, hi: int) -> torch.Tensor:
        """Elements [lo, hi) of one TP slice from the planned pieces (which cover it: the index
        was checked)."""
        out = torch.empty(hi - lo, dtype=torch.float32)
        for p in pieces:
            a, b = max(lo, p["lo"]), min(hi, p["hi"])
            data = np.fromfile(self.ckpt / p["file"], dtype=np.float32, count=b - a,
                               offset=p["offset"] + 4 * (a - p["lo"]))
            out[a - lo:b - lo] = torch.from_numpy(data)
        return out

    def global_tensor(self, name: str, kind: str) -> torch.Tensor:
        """The whole tensor: every writer TP rank's slice read in full, then joined."""
        pieces = self._pieces(name, kind)
        spec, written_tp = self.written_spec(name, kind)
        local_shape = spec.local_shape(written_tp)
        numel = int(np.prod(local_shape))
        slices = [self.read_range([p for p in pieces if p["tp_rank"] == r], 0,
                                  numel).view(local_shape)
                  for r in range(written_tp if spec.tp_dim is not None else 1)]
        return spec.unshard(slices)


def read_global_state(ckpt: Path, kind: str = "param") -> Dict[str, torch.Tensor]:
    """Every global tensor of a checkpoint (HF names, nn.Linear layout, fp32, vocabulary
    unpadded), whatever layout wrote it: for export, generation and inspection. Verifies the
    files it reads; reads one process's worth (no process group needed)."""
    ckpt = Path(ckpt)
    meta = read_meta(ckpt)
    reader = _Reader(ckpt, meta)
    names = sorted({n for (n, k) in reader.index if k == kind})
    for name in reader.files_for(names):
        verify_file(ckpt, name, meta["files"][name])
    return {name: reader.global_tensor(name, kind) for name in names}


def shape_mismatch(theirs: dict, cfg: ModelConfig, where: str,
                   keys: Tuple[str, ...] = SHAPE_KEYS) -> Optional[str]:
    """What is wrong, if anything, between a checkpoint's model (meta.json's "model", trained
    by `where`) and `cfg`: the first differing key of `keys`, named with both values. The MLP
    size counts, not how it was written (n_inner=null is 4 * n_embd)."""
    for key in keys:
        ours, recorded = getattr(cfg, key), theirs.get(key)
        if key == "n_inner":
            same = cfg.ffn_size == (recorded if recorded is not None else 4 * theirs.get("n_embd"))
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
        reader = _Reader(ckpt, meta)
        files = set()
        for piece, seg, _ in sorted(engine.main_params, key=lambda t: t[1].spec.name):
            for kind in KINDS:
                if kind != "param" and not reader.has(seg.spec.name, kind):
                    continue
                plan = reader.plan(seg.spec, kind, topo.tp, topo.coords.tp, seg.param_lo,
                                   seg.param_hi)
                plans.append((piece, seg, kind, plan))
                files.update(p["file"] for p in plan) if plan is not None \
                    else files.update(reader.files_for([seg.spec.name]))
        for name in sorted(files):
            verify_file(ckpt, name, meta["files"][name])
        same_layout = meta["layout"]["world_size"] == topo.world_size and all(
            meta["layout"][k] == v for k, v in (("tp", topo.tp), ("pp", topo.pp), ("dp", topo.dp)))
        rng_name = f"rng_rank{topo.rank:05d}.pt"
        if same_layout:
            verify_file(ckpt, rng_name, meta["files"][rng_name])
    except (CheckpointError, KeyError, OSError, TypeError, ValueError) as e:
        error = f"{ckpt}: {type(e).__name__}: {e}" if not isinstance(e, CheckpointError) else str(e)
    _agree_to_load(ckpt, error, meta.get("step"))

    cache: Dict[Tuple[str, str], torch.Tensor] = {}

    def resliced(spec: ParamSpec, kind: str) -> torch.Tensor:
        """This rank's flattened slice, cut from the rebuilt global tensor (TP split changed)."""
        key = (spec.name, kind)
        if key not in cache:
            cache.clear()  # one global tensor at a time
            full = reader.global_tensor(spec.name, kind)
            cache[key] = spec.shard(full, topo.coords.tp, topo.tp).reshape(-1)
        return cache[key]

    with torch.no_grad():
        for piece, seg, kind, plan in plans:
            if plan is not None:
                values = reader.read_range(plan, seg.param_lo, seg.param_hi)
            else:
                values = resliced(seg.spec, kind)[seg.param_lo:seg.param_hi]
            if kind == "param":
                piece.copy_(values)
            else:
                engine.set_optimizer_state(piece, kind, values, meta["adam_step"])
        engine.params_from_master()
    rng = torch.load(ckpt / rng_name, weights_only=False) if same_layout else None
    return meta, rng


def _agree_to_load(ckpt: Path, error: Optional[str], step: Optional[int]) -> None:
    """Collective: every rank found its part of the checkpoint sound, and all of them are
    loading the same step; else CheckpointError on every rank, naming the first problem.
    (The verdicts travel as objects, which every backend carries: NCCL has no CPU tensors.)"""
    verdicts = _gather_objects((error, step))
    errors = [(rank, e) for rank, (e, _) in enumerate(verdicts) if e]
    if errors:
        rank, first = errors[0]
        raise CheckpointError(first if first == error else f"rank {rank}: {first}")
    steps = sorted({s for _, s in verdicts})
    if len(steps) > 1:
        raise CheckpointError(f"{ckpt}: the ranks are loading different checkpoints (steps "
                              f"{steps}); every rank must resume from the same step")


def rng_state(tracker) -> dict:
    return {"tracker": tracker.state_dict(), "torch_cpu": torch.get_rng_state(),
            "numpy": np.random.get_state(), "python": random.getstate()}


def set_rng_state(tracker, state: dict) -> None:
    tracker.load_state_dict(state["tracker"])
    torch.set_rng_state(state["torch_cpu"])
    np.random.set_state(state["numpy"])
    random.setstate(state["python"])
