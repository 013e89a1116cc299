"""megalite checkpoints as torch.distributed.checkpoint (DCP) checkpoints, and back, under the
names of the model family's DCP mapping (`Family.dcp`: Llama's is torchtitan's Llama 3,
`megalite.model.llama.titan`; a family without one has no DCP checkpoints).

    export_dcp(ckpt, out_dir)   out_dir/.metadata + __<rank>_0.distcp: the weights under the
                                family's DCP names (torchtitan's names and rotary layout), as
                                torchtitan's CheckpointManager writes a model-only checkpoint
                                (flat model keys), loadable with `dcp.load` in any layout
    read_titan_state(path)      the weights of a DCP checkpoint (a `step-N` directory, or a
                                folder of them: the highest step), megalite names

The export runs in one process or in every rank of a process group (`torchrun ...
megalite-export --format dcp`): each rank reads only its share of the tensors (whole tensors,
balanced by size) from the megalite checkpoint's files, byte ranges only, and DCP writes each
rank's share into its own file; nothing is gathered. It is written under a sibling temporary
directory that replaces `out_dir` only when every rank has written (`.metadata` last), by
`megalite.utils.durable.replace_dir`: an export it replaces stays whole until then.
"""
from __future__ import annotations

import re
import shutil
import warnings
from pathlib import Path
from typing import Dict, List, Type

import torch
import torch.distributed as dist

from megalite.checkpoint.errors import CheckpointError
from megalite.checkpoint.format import read_meta
from megalite.checkpoint.resolve import resolve_checkpoint
from megalite.checkpoint.tensor_reads import read_tensors, tensor_sizes
from megalite.config.errors import ConfigError
from megalite.config.schema import ModelConfig
from megalite.model.families import causal_lm, families, family
from megalite.model.family import DCPMapping
from megalite.utils.durable import recover_replaced, replace_dir

STEP = re.compile(r"^step-(\d+)$")


def share(sizes: Dict[str, int], parts: int, part: int) -> List[str]:
    """The names `part` of `parts` handles: largest first to the least loaded part, so each
    part writes about 1/parts of the bytes (deterministic: every process computes the same)."""
    loads, owner = [0] * parts, {}
    for name in sorted(sizes, key=lambda n: (-sizes[n], n)):
        p = loads.index(min(loads))
        owner[name] = p
        loads[p] += sizes[name]
    return [n for n in sizes if owner[n] == part]


def dcp_names(cfg: ModelConfig, error: Type[Exception], where: str) -> DCPMapping:
    """The DCP mapping of `cfg`'s family, or `error` naming the families that have one."""
    mapping = family(cfg).dcp
    if mapping is None:
        have = ", ".join(f"model.arch={f.name} ({f.dcp.display})" for f in families() if f.dcp)
        raise error(f"{where}: model.arch={cfg.arch} ({family(cfg).hf.display}) has no DCP "
                    f"names; DCP checkpoints are written and read for {have}")
    return mapping


def _checked_out_dir(ckpt: Path, out_dir: Path, force: bool) -> None:
    if ckpt.resolve().is_relative_to(out_dir.resolve()):
        raise CheckpointError(f"{out_dir}: contains {ckpt}, which the export reads; pick "
                              "another output directory")
    if out_dir.exists() and not out_dir.is_dir():
        raise CheckpointError(f"{out_dir}: exists and is not a directory")
    if out_dir.is_dir() and any(out_dir.iterdir()) and not force:
        raise CheckpointError(f"{out_dir}: exists and is not empty; pick a new directory, or "
                              "replace it with --force")


def export_dcp(ckpt, out_dir, force: bool = False) -> Path:
    """Write megalite checkpoint `ckpt` as a DCP checkpoint `out_dir` under its family's DCP
    names; in every rank of the default process group where one exists. Returns the
    checkpoint."""
    import torch.distributed.checkpoint as dcp  # half a second of imports: when used
    ckpt, out_dir = resolve_checkpoint(ckpt), Path(out_dir)
    meta = read_meta(ckpt)
    cfg = ModelConfig.from_record(meta["model"])
    mapping = dcp_names(cfg, CheckpointError, f"{ckpt}: --format dcp")
    distributed = dist.is_available() and dist.is_initialized()
    rank, world = (dist.get_rank(), dist.get_world_size()) if distributed else (0, 1)
    tmp = out_dir.with_name(f".{out_dir.name}.dcp-partial")
    if rank == 0:
        recover_replaced(out_dir)  # an earlier export cut short in its swap
        shutil.rmtree(tmp, ignore_errors=True)
    if distributed:
        dist.barrier()
    _checked_out_dir(ckpt, out_dir, force)
    mine = read_tensors(ckpt, meta, share(tensor_sizes(ckpt, meta), world, rank))
    state = {k: v for name, t in mine.items() for k, v in mapping.to_dcp(name, t, cfg)}
    if rank == 0:
        out_dir.parent.mkdir(parents=True, exist_ok=True)
    if distributed:
        dist.barrier()
    with warnings.catch_warnings():  # alone: "assuming the intent is to save in a single process"
        warnings.simplefilter("ignore", UserWarning)
        dcp.save(state, storage_writer=dcp.FileSystemWriter(str(tmp)), no_dist=not distributed)
    if rank == 0:  # dcp.save returns after every rank's files and the .metadata are written
        replace_dir(tmp, out_dir)
    if distributed:
        dist.barrier()
    return ckpt


def find_dcp(path) -> Path | None:
    """The DCP checkpoint `path` names: itself (it holds `.metadata`) or, for a folder of
    torchtitan's `step-N` directories, the highest step's; None if neither."""
    path = Path(path)
    if (path / ".metadata").is_file():
        return path
    if not path.is_dir():
        return None
    steps = [(int(m.group(1)), p) for p in path.iterdir()
             if (m := STEP.match(p.name)) and (p / ".metadata").is_file()]
    return max(steps)[1] if steps else None


def titan_shapes(path: Path, mapping: DCPMapping) -> Dict[str, torch.Size]:
    """The model weights a DCP checkpoint holds and their shapes (from `.metadata` only)."""
    import torch.distributed.checkpoint as dcp  # half a second of imports: when used
    metadata = dcp.FileSystemReader(str(path)).read_metadata()
    return {k: v.size for k, v in metadata.state_dict_metadata.items()
            if mapping.is_model_key(k) and hasattr(v, "size")}


def read_titan_state(path, cfg: ModelConfig) -> Dict[str, torch.Tensor]:
    """The weights of DCP checkpoint `path` as megalite's global state (fp32),
    read in this process alone (no process group used)."""
    import torch.distributed.checkpoint as dcp  # half a second of imports: when used
    found = find_dcp(path)
    if found is None:
        raise CheckpointError(f"{path}: no DCP checkpoint (.metadata) there")
    mapping = dcp_names(cfg, CheckpointError, str(path))
    state = {k: torch.empty(size, dtype=torch.float32)
             for k, size in titan_shapes(found, mapping).items()}
    with warnings.catch_warnings():  # "assuming the intent is to load in a single process"
        warnings.simplefilter("ignore", UserWarning)
        dcp.load(state, storage_reader=dcp.FileSystemReader(str(found)), no_dist=True)
    return mapping.from_dcp(state, cfg)


def check_titan_shapes(path, cfg: ModelConfig, source: str) -> None:
    """Before launch: the DCP checkpoint holds the family's model (torchtitan's Llama 3) of
    the configured shape (reads `.metadata` only); names the first missing or differing
    tensor. RoPE's theta and scaling are not in a DCP checkpoint: model.rope_theta /
    model.rope_scaling must be the torchtitan flavor's."""
    mapping = dcp_names(cfg, ConfigError, f"init_from={source!r} (a DCP checkpoint)")
    with torch.device("meta"):
        specs = causal_lm(cfg).param_specs.values()
    want = {k: tuple(t.shape) for s in specs if not s.tied_copy
            for k, t in mapping.to_dcp(s.name, torch.empty(s.shape, device="meta"), cfg)}
    theirs = titan_shapes(find_dcp(path), mapping)
    for key, shape in want.items():
        if key not in theirs:
            raise ConfigError(f"init_from={source!r}: no {key} in the DCP checkpoint; it is not "
                              f"{mapping.display} of model.n_layer="
                              f"{cfg.n_layer} (model.tie_word_embeddings={cfg.tie_word_embeddings})")
        if tuple(theirs[key]) != shape:
            raise ConfigError(f"init_from={source!r}: {key} has shape {tuple(theirs[key])}, the "
                              f"model config gives {shape}; set model.n_embd / n_head / "
                              "n_kv_head / n_inner / vocab_size to the checkpoint's")
