"""Everything a launch checks before any process group exists, for the scripts and for
library users alike (`python -c "from megalite.train.preflight import preflight; ..."`).

    layout, warnings = preflight(cfg, world_size, local_gpus, local_ranks)

Validates the configuration for the world size (`megalite.config.layout.validate`), checks the
prepared token shards (`megalite.data.loader.check_data`), the model shape of `init_from` and
of the checkpoint `checkpoint.resume` names, the HellaSwag examples of `eval.hellaswag` (and the
data's tokenizer that renders them), derives the run's `Layout` once, and checks that the fault
drill's rank holds its tensor (`resilience.inject`: the rank's stage built on the meta device),
and that `checkpoint.dir` can be written (a temporary directory made and removed). Raises
ConfigError or DataError naming the key or file; nothing is left written.
"""
from __future__ import annotations

import os
from typing import List, Optional, Tuple

from megalite.checkpoint.resolve import check_resume
from megalite.checkpoint.writable import check_writable_dir
from megalite.config.layout import GpuInfo, Layout, device_type_for, validate
from megalite.config.schema import Config, load_config, resolve_path
from megalite.data.documents import document_rule
from megalite.data.loader import PREPARE_HINT, check_data, read_meta
from megalite.eval.hellaswag import check_hellaswag
from megalite.resilience.inject_target import check_inject_target
from megalite.train.cpu_precision import half_precision_note
from megalite.train.host_memory import check_host_memory
from megalite.train.init_from import check_init_from
from megalite.train.init_shape import adopt_init_from_model


def preflight(cfg: Config, world_size: int, local_gpus: Optional[int] = None,
              local_ranks: int = 1, gpu: Optional[GpuInfo] = None
              ) -> Tuple[Layout, List[str]]:
    """The run's layout and the warnings to print, or ConfigError / DataError."""
    warnings = validate(cfg, world_size, local_gpus, local_ranks, gpu)
    check_data([d for d, _ in cfg.data.sources()], cfg.train.seq_len,
               cfg.train.global_batch_size, cfg.model.vocab_size,
               evaluates=cfg.train.eval_every > 0, hint=prepare_hint(cfg))
    for data_dir, _ in cfg.data.sources():  # documents are found from the data's EOS
        document_rule(cfg.train, read_meta(data_dir).get("eos_token_id"), data_dir)
    if cfg.init_from:
        check_init_from(cfg.init_from, cfg.model)
    check_resume(cfg)
    check_hellaswag(cfg)
    layout = Layout.from_config(cfg, world_size, device_type_for(cfg.device, local_gpus),
                                bf16=gpu is None or gpu.bf16)
    if cfg.resilience.inject is not None:
        check_inject_target(cfg, layout)
    check_host_memory(cfg, layout, local_ranks)
    note = half_precision_note(layout.precision, layout.device_type, cfg.model.n_embd)
    warnings += [note] if note else []
    if cfg.checkpoint.dir:  # last: the probe is the only check that touches the disk
        check_writable_dir(resolve_path(cfg.checkpoint.dir), "checkpoint.dir")
    return layout, warnings


def validated_config(overrides, world_size: int, gpus_per_node: int, device: str
                     ) -> Tuple[Config, List[str]]:
    """The configuration of `overrides` and its warnings, validated as a launch on
    `world_size` ranks of `device` would be (`gpus_per_node` GPUs a node on cuda), for the
    commands that plan or simulate a launch rather than start one; ConfigError otherwise."""
    cfg = adopt_init_from_model(load_config(list(overrides)), overrides)
    return cfg, validate(cfg, world_size, gpus_per_node if device == "cuda" else None)


def local_ranks_from_env() -> int:
    """Processes the launcher started on this node (torchrun's --nproc_per_node)."""
    return int(os.environ.get("LOCAL_WORLD_SIZE", "1"))


def prepare_hint(cfg: Config) -> str:
    """The command that prepares the run's data: its preset and directory (a blend's datasets
    are prepared one by one: the general hint)."""
    if cfg.data.blend is not None:
        return PREPARE_HINT
    return (f"run `megalite-prepare data={cfg.data.name} data.dir={cfg.data.dir}` (with this "
            "run's other data.* overrides) first")
