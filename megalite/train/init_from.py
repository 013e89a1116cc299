"""Where a run's starting weights come from (`init_from`): a `transformers` model of the
configured family (GPT2LMHeadModel, LlamaForCausalLM: a directory written by save_pretrained,
or a hub id), a megalite checkpoint, or torchtitan's Llama 3 DCP checkpoint
(`megalite.checkpoint.dcp_export`), weights only (Megatron's --finetune): the run starts at
step 0 with fresh AdamW moments and data position, in any layout. `checkpoint.resume` is the
other thing: it continues a run where it stopped.
"""
from __future__ import annotations

from pathlib import Path
from typing import Dict

import torch

from megalite.checkpoint.dcp_export import check_titan_shapes, find_dcp, read_titan_state
from megalite.checkpoint.errors import CheckpointError
from megalite.checkpoint.format import SHAPE_KEYS, read_global_state, read_meta, shape_mismatch
from megalite.checkpoint.resolve import find_checkpoint
from megalite.config.errors import ConfigError
from megalite.config.schema import ModelConfig
from megalite.model import hf_io
from megalite.model.safetensors_check import check_weight_files


def is_path(source: str) -> bool:
    """Whether `source` can only be a path (absolute, or starting with ., ~): never a hub id."""
    return source.startswith(("/", ".", "~")) or Path(source).is_absolute()


def check_init_from(source: str, cfg: ModelConfig) -> None:
    """Before launch: `source` holds weights of the configured model shape (reads configs,
    meta.json and safetensors headers only); names the first mismatch or damaged file."""
    if is_path(source) and not Path(source).expanduser().exists():
        raise ConfigError(f"init_from={source!r}: no such file or directory; give an existing "
                          "transformers directory or megalite checkpoint, or a hub id such as "
                          "gpt2")
    if find_dcp(source) is not None:
        check_titan_shapes(source, cfg, source)
        return
    ckpt = find_checkpoint(source)
    if ckpt is None:
        if Path(source).is_dir() and not (Path(source) / "config.json").is_file():
            raise ConfigError(f"init_from={source!r}: this directory holds neither a "
                              "transformers model (config.json) nor a megalite checkpoint "
                              "(meta.json, or a checkpoint.dir with a complete step_N) nor a "
                              "DCP checkpoint (.metadata); give one "
                              "of those or a hub id such as gpt2")
        hf_io.check_init_from(source, cfg)
        if Path(source).is_dir():  # a hub id's weights are not downloaded before launch
            check_weight_files(Path(source), f"init_from={source!r}")
        return
    try:
        theirs = read_meta(ckpt)["model"]
    except CheckpointError as e:
        raise ConfigError(f"init_from={source!r}: {e}") from e
    problem = shape_mismatch(theirs, cfg, f"init_from={source!r} ({ckpt.name})",
                             (*SHAPE_KEYS, "layer_norm_epsilon"))
    if problem is not None:
        raise ConfigError(problem)


def is_hub_id(source: str) -> bool:
    """Whether `source` names a model on the Hugging Face hub (not a local directory or a
    megalite checkpoint)."""
    return find_checkpoint(source) is None and not Path(source).exists()


def load_init_state(source: str, cfg: ModelConfig) -> Dict[str, torch.Tensor]:
    """The global weights (HF names, nn.Linear layout, fp32, vocabulary unpadded) to start
    from; a megalite checkpoint's files are verified (size, CRC32) as they are read."""
    if find_dcp(source) is not None:
        check_titan_shapes(source, cfg, source)
        return read_titan_state(source, cfg)
    ckpt = find_checkpoint(source)
    if ckpt is None:
        return hf_io.load_hf_state_dict(source, cfg)
    check_init_from(source, cfg)
    return read_global_state(ckpt, "param")
