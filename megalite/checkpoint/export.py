"""Checkpoints as models: export to `transformers`, load for inference, in one process.

A checkpoint of any layout (tp, pp, dp, zero; see `megalite.checkpoint.format`) holds the fp32
master weights in pieces; `read_global_state` rebuilds the global tensors. From there:

    export_hf(ckpt, out_dir)   a `transformers` directory of the model's family (config.json,
                               model.safetensors or shards of at most max_shard_size bytes and
                               their index, generation_config.json, tokenizer files) that
                               GPT2LMHeadModel / LlamaForCausalLM and AutoTokenizer load; written
                               a shard at a time from the rank files (`checkpoint.hf_stream`),
                               by one process or in parts by several
    load_model(ckpt)           the serial megalite stage (tp = pp = 1) with the checkpoint's weights
    load_tokenizer(ckpt)       the tokenizer the run's data was tokenized with

`ckpt` is a checkpoint directory (`step_NNNNNNNN/` holding meta.json) or a checkpoint root
(`checkpoint.dir`), which stands for its latest complete checkpoint. The tokenizer is the one
`scripts/prepare_data.py` saved in `<data.dir>/tokenizer`, with the data directory's absolute
path read from meta.json; name another tokenizer directory explicitly where the data moved.
"""
from __future__ import annotations

import os
import shutil
from pathlib import Path
from typing import Optional, Tuple

import torch

from megalite.checkpoint.export_parts import export_id, pin_checkpoint
from megalite.checkpoint.format import read_global_state, read_meta
from megalite.checkpoint.hf_stream import INDEX, write_hf_dir
from megalite.checkpoint.resolve import CheckpointNotFound, resolve_checkpoint
from megalite.config.errors import ConfigError
from megalite.config.schema import ModelConfig
from megalite.data.prepare import TOKENIZER_DIR
from megalite.model.causal_lm import CausalLM
from megalite.model.families import causal_lm, family
from megalite.model.init import load_global_state
from megalite.utils.durable import recover_replaced, replace_dir


class ExportError(CheckpointNotFound):
    """A path that cannot be used; the message names it and what is expected instead."""


def model_config(ckpt: Path) -> ModelConfig:
    """The model shape recorded in a checkpoint's meta.json."""
    return ModelConfig.from_record(read_meta(resolve_checkpoint(ckpt))["model"])


def check_exportable(cfg: ModelConfig) -> None:
    """The family's model class can hold the model (e.g. MixtralForCausalLM has no expert
    selection bias); an ExportError naming the key otherwise."""
    check = family(cfg).hf.check_export
    if check is None:
        return
    try:
        check(cfg)
    except ConfigError as e:
        raise ExportError(f"{family(cfg).hf.model_class}: {e}") from e


def tokenizer_dir(ckpt: Path, override: Optional[str] = None) -> Path:
    """`override`, else `<data.dir>/tokenizer` of the run that wrote the checkpoint."""
    if override is not None:
        path, origin = Path(override), "the tokenizer directory given"
    else:
        ckpt = resolve_checkpoint(ckpt)
        meta = read_meta(ckpt)
        data_dir = meta["data_dir"]  # absolute: resolved when the checkpoint was written
        path = Path(data_dir) / TOKENIZER_DIR
        origin = f"data_dir={data_dir!r} recorded in {ckpt / 'meta.json'}"
    if not path.is_dir():
        raise ExportError(f"no tokenizer at {path} (from {origin}); run from the directory the "
                          "training was launched from, or give the tokenizer directory "
                          "(--tokenizer DIR, e.g. <data.dir>/tokenizer)")
    return path


def load_tokenizer(ckpt: Path, override: Optional[str] = None):
    """The checkpoint's tokenizer (see `tokenizer_dir`), checked against the model's vocabulary."""
    from transformers import AutoTokenizer

    path = tokenizer_dir(ckpt, override)
    try:
        tokenizer = AutoTokenizer.from_pretrained(str(path))
    except (OSError, ValueError) as e:
        raise ExportError(f"{path}: not a tokenizer directory ({e})") from e
    vocab_size = model_config(ckpt).vocab_size
    if len(tokenizer) > vocab_size:
        raise ExportError(f"{path}: {len(tokenizer)} tokens, more than the checkpoint's "
                          f"model.vocab_size={vocab_size}: not the tokenizer of this run")
    return tokenizer


def load_model(ckpt: Path, device: str = "cpu") -> CausalLM:
    """The serial model (of the checkpoint's family) holding the checkpoint's weights, in
    eval mode; `ckpt` is a checkpoint or a checkpoint directory (its latest complete
    checkpoint)."""
    ckpt = resolve_checkpoint(ckpt)
    with torch.device(device):
        model = causal_lm(model_config(ckpt))
    load_global_state(model, read_global_state(ckpt))
    return model.eval()


DEFAULT_SHARD_BYTES = 5 * 10**9  # transformers' max_shard_size="5GB"


def _check_out_dir(out_dir: Path, sources, force: bool, parts: int) -> None:
    """`out_dir` may receive the export: it holds none of `sources`, and holds nothing (no
    `force`, one part) or no finished export (parts)."""
    for source in sources:
        if source.resolve().is_relative_to(out_dir.resolve()):
            raise ExportError(f"{out_dir}: contains {source}, which the export reads; "
                              "pick another output directory")
    if out_dir.exists() and not out_dir.is_dir():
        raise ExportError(f"{out_dir}: exists and is not a directory")
    if out_dir.is_dir() and any(out_dir.iterdir()) and not force and parts == 1:
        raise ExportError(f"{out_dir}: exists and is not empty; pick a new directory, or "
                          "replace it with --force")
    finished = [f for f in (INDEX, "config.json") if (out_dir / f).exists()]
    if parts > 1 and finished:  # parts share the directory: an old export's index would
        # make it look complete while they write, and its shards would pass for theirs
        raise ExportError(f"{out_dir}: holds {', '.join(finished)} of an earlier export; "
                          "the parts of an export write into a new directory")


def export_hf(ckpt, out_dir, tokenizer: Optional[str] = None, force: bool = False,
              max_shard_bytes: int = DEFAULT_SHARD_BYTES, part: Tuple[int, int] = (0, 1)
              ) -> Path:
    """Write checkpoint `ckpt` as a `transformers` directory `out_dir` (the `transformers`
    model of the checkpoint's family), in safetensors shards of at most `max_shard_bytes`.

    Alone (`part` = (0, 1)) everything is written to a temporary sibling directory that
    replaces `out_dir` only when complete (`megalite.utils.durable.replace_dir`: a finished
    export there stays whole until then). As part i of n > 1 (processes sharing `out_dir`)
    the shards are written into `out_dir` itself, the parts export one checkpoint (a
    checkpoint directory's step is pinned by the first part: `checkpoint.export_parts`) and
    the last part to finish writes the index (`checkpoint.hf_stream`). An existing non-empty
    `out_dir` is an error unless `force` (or a part of n > 1); `out_dir` may never contain
    the checkpoint or the tokenizer it is made from. Returns the checkpoint exported.
    """
    given, out_dir, parts = Path(ckpt), Path(out_dir), part[1]
    ckpt = resolve_checkpoint(given)
    recover_replaced(out_dir)  # an earlier export cut short in its swap
    _check_out_dir(out_dir, (given, ckpt, tokenizer_dir(ckpt, tokenizer)), force, parts)
    load_tokenizer(ckpt, tokenizer)  # checked against the model before anything is written
    check_exportable(model_config(ckpt))
    if parts > 1:
        out_dir.mkdir(parents=True, exist_ok=True)
        ckpt, run = pin_checkpoint(given, out_dir, max_shard_bytes, parts)
        write_hf_dir(ckpt, read_meta(ckpt), out_dir, tokenizer_dir(ckpt, tokenizer),
                     max_shard_bytes, run, part)
        return ckpt
    out_dir.parent.mkdir(parents=True, exist_ok=True)
    tmp = out_dir.with_name(f".{out_dir.name}.tmp{os.getpid()}")
    shutil.rmtree(tmp, ignore_errors=True)
    tmp.mkdir()
    try:
        write_hf_dir(ckpt, read_meta(ckpt), tmp, tokenizer_dir(ckpt, tokenizer),
                     max_shard_bytes, export_id(ckpt, max_shard_bytes, 1))
        replace_dir(tmp, out_dir)
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
    return ckpt
