"""A `transformers` directory written one safetensors shard at a time, straight from a megalite
checkpoint's rank files: peak memory is about one output shard, whatever the model's size.

The weights are cut, in the checkpoint's tensor order, into shards of at most
`max_shard_bytes` (a tensor larger than that is a shard alone), named as `save_pretrained`
names them: `model.safetensors` when one shard, else `model-0000N-of-0000M.safetensors` and
`model.safetensors.index.json` (`metadata.total_size`, `weight_map`). Each shard's tensors are
read as byte ranges of the rank files (`checkpoint.tensor_reads`), mapped to the family's
`transformers` names (`Family.hf`: per tensor, so a shard needs only its own), written under a
temporary name and renamed, readable as the user's umask allows (safetensors alone writes
0600), its metadata naming the export it belongs to (`checkpoint.export_parts`).

Parallel: part i of n (processes or ranks, `megalite-export --part i/n`) writes shards
i, i + n, ...; every part plans the same shards. The part that finds every shard on disk after
its own writes config.json, generation_config.json, the tokenizer and the index, the index
last: a directory without its index (or, for one shard, without config.json) is incomplete. A
part refuses a directory holding a shard of another export (`check_shards`).
"""
from __future__ import annotations

import json
import os
from pathlib import Path
from typing import Dict, List, Optional, Tuple

import torch

from megalite.checkpoint.export_parts import EXPORT_KEY, check_shards, release
from megalite.checkpoint.tensor_reads import read_tensors, tensor_shapes
from megalite.config.schema import ModelConfig
from megalite.model.families import family

INDEX = "model.safetensors.index.json"


def shard_name(j: int, n: int) -> str:
    return "model.safetensors" if n == 1 else f"model-{j + 1:05d}-of-{n:05d}.safetensors"


def hf_shapes(name: str, shape: Tuple[int, ...], cfg: ModelConfig) -> Dict[str, Tuple[int, ...]]:
    """The `transformers` tensors one megalite tensor becomes, and their shapes (no data)."""
    mapped = family(cfg).hf.to_hf_state_dict({name: torch.empty(shape, device="meta")})
    return {k: tuple(t.shape) for k, t in mapped.items()}


def plan_shards(shapes: Dict[str, Tuple[int, ...]], cfg: ModelConfig, max_shard_bytes: int
                ) -> List[List[str]]:
    """The megalite tensors of each shard (fp32: 4 bytes an element), in order."""
    shards: List[List[str]] = [[]]
    size = 0
    for name, shape in shapes.items():
        nbytes = 4 * sum(int(torch.Size(s).numel()) for s in hf_shapes(name, shape, cfg).values())
        if shards[-1] and size + nbytes > max_shard_bytes:
            shards.append([])
            size = 0
        shards[-1].append(name)
        size += nbytes
    return shards


def check_names(shapes: Dict[str, Tuple[int, ...]], cfg: ModelConfig, hf_cfg) -> None:
    """The tensors written are the `transformers` model's (built on the meta device) but the
    ones it derives (a tied head, buffers)."""
    import transformers

    mapping = family(cfg).hf
    with torch.device("meta"):
        model = getattr(transformers, mapping.model_class)(hf_cfg)
    want = set(model.state_dict())
    have = {k for n, s in shapes.items() for k in hf_shapes(n, s, cfg)}
    missing = sorted(k for k in want - have if not mapping.derived(k))
    if missing or have - want:
        raise ValueError(f"the checkpoint does not map onto {mapping.model_class}: missing "
                         f"{missing}, unexpected {sorted(have - want)}")


def _replace_write(path: Path, write) -> None:
    tmp = path.with_name(f".{path.name}.tmp{os.getpid()}")
    write(tmp)
    os.replace(tmp, path)


def umask_mode() -> int:
    """The mode a new file gets from open(): 0o666 less the process's umask."""
    umask = os.umask(0o022)
    os.umask(umask)
    return 0o666 & ~umask


def write_shard(ckpt: Path, meta: dict, names: List[str], cfg: ModelConfig, path: Path,
                run: str) -> None:
    """Read one shard's tensors, map them to `transformers` names, write the shard of export
    `run`."""
    from safetensors.torch import save_file

    state = family(cfg).hf.to_hf_state_dict(read_tensors(ckpt, meta, names))

    def write(tmp: Path) -> None:
        save_file(state, str(tmp), metadata={"format": "pt", EXPORT_KEY: run})
        os.chmod(tmp, umask_mode())

    _replace_write(path, write)


def write_configs(cfg: ModelConfig, out_dir: Path, tokenizer_dir: Optional[Path]):
    """config.json, generation_config.json and the tokenizer (its special token ids in the
    configs)."""
    from transformers import AutoTokenizer, GenerationConfig

    mapping = family(cfg).hf
    tokenizer = AutoTokenizer.from_pretrained(str(tokenizer_dir)) if tokenizer_dir else None
    ids = {"bos_token_id": tokenizer.bos_token_id, "eos_token_id": tokenizer.eos_token_id} \
        if tokenizer is not None else {}
    hf_cfg = mapping.hf_config(cfg, **ids)
    hf_cfg.architectures = [mapping.model_class]
    hf_cfg.save_pretrained(out_dir)
    GenerationConfig.from_model_config(hf_cfg).save_pretrained(out_dir)
    if tokenizer is not None:
        tokenizer.model_max_length = cfg.n_positions  # the model's context, for truncation=True
        tokenizer.save_pretrained(out_dir)


def write_hf_dir(ckpt: Path, meta: dict, out_dir: Path, tokenizer_dir: Optional[Path],
                 max_shard_bytes: int, run: str, part: Tuple[int, int] = (0, 1)) -> bool:
    """Write part `part` = (i, n) of export `run` (`export_parts.export_id`) of checkpoint
    `ckpt`'s `transformers` directory into `out_dir` (existing); returns whether this part
    completed the directory."""
    cfg = ModelConfig.from_record(meta["model"])
    shapes = tensor_shapes(ckpt, meta)
    check_names(shapes, cfg, family(cfg).hf.hf_config(cfg))
    shards = plan_shards(shapes, cfg, max_shard_bytes)
    check_shards(out_dir, run)
    i, n = part
    for j in range(i, len(shards), n):
        write_shard(ckpt, meta, shards[j], cfg, out_dir / shard_name(j, len(shards)), run)
    if not all((out_dir / shard_name(j, len(shards))).is_file() for j in range(len(shards))):
        return False  # another part completes the directory
    release(out_dir)
    write_configs(cfg, out_dir, tokenizer_dir)
    if len(shards) > 1:
        weight_map = {k: shard_name(j, len(shards)) for j, names in enumerate(shards)
                      for name in names for k in hf_shapes(name, shapes[name], cfg)}
        total = sum(4 * torch.Size(s).numel() for name in shapes
                    for s in hf_shapes(name, shapes[name], cfg).values())
        index = {"metadata": {"total_size": total}, "weight_map": dict(sorted(weight_map.items()))}
        _replace_write(out_dir / INDEX, lambda tmp: tmp.write_text(json.dumps(index, indent=2)))
    return True
