#!/usr/bin/env python
"""Pretrain GPT-2 with megalite.

    torchrun --nproc_per_node=8 scripts/pretrain.py model=gpt2 train.seq_len=1024
    python scripts/pretrain.py                      # tiny preset on the embedded stdlib corpus

The run directory is Hydra's output directory (`hydra.run.dir`); metrics.jsonl, the wandb run
and (by default) checkpoints go there. The configuration is validated, the token shards (and
the init_from and resume checkpoints' model shape) checked, before any process group is
created.
"""
from __future__ import annotations

import os
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

import hydra  # noqa: E402
import torch  # noqa: E402
from hydra.core.hydra_config import HydraConfig  # noqa: E402

from megalite.config import ConfigError, data_sources, register_configs, to_config, validate  # noqa: E402
from megalite.data.loader import DataError, check_data  # noqa: E402
from megalite.plan import make_plan, memory_warning  # noqa: E402
from megalite.runtime import init_runtime, local_gpus, shutdown, world_size_from_env  # noqa: E402
from megalite.train.init_from import check_init_from  # noqa: E402
from megalite.train.resume import check_resume  # noqa: E402
from megalite.train.trainer import Trainer, broadcast_run_dir  # noqa: E402

register_configs()


def planned_device(cfg) -> str:
    """The device type the run will use (a device=cuda run without GPUs fails at start-up)."""
    return "cuda" if cfg.device in ("auto", "cuda") and local_gpus() else "cpu"


def keep_hydra_output_on_rank0() -> None:
    """Only rank 0 writes Hydra's run directory; the others get rank 0's path later."""
    if int(os.environ.get("RANK", "0")) != 0:
        sys.argv += ["hydra.output_subdir=null", "hydra.run.dir=.",
                     "hydra/job_logging=disabled", "hydra/hydra_logging=disabled"]


@hydra.main(config_path="../conf", config_name="config", version_base="1.3")
def main(node) -> None:
    cfg = to_config(node)
    try:
        warnings = validate(cfg, world_size_from_env(), local_gpus(),
                            int(os.environ.get("LOCAL_WORLD_SIZE", "1")))
        check_data([d for d, _ in data_sources(cfg.data)], cfg.train.seq_len,
                   cfg.train.global_batch_size, cfg.model.vocab_size,
                   evaluates=cfg.train.eval_every > 0)
        if cfg.init_from:
            check_init_from(cfg.init_from, cfg.model)
        check_resume(cfg)
    except (ConfigError, DataError) as e:
        print(f"megalite: bad configuration: {e}", file=sys.stderr)
        sys.exit(2)
    if int(os.environ.get("RANK", "0")) == 0:
        plan = make_plan(cfg, world_size_from_env(), planned_device(cfg))
        print(plan.table())
        if planned_device(cfg) == "cuda":
            warnings.append(memory_warning(plan, torch.cuda.get_device_properties(0).total_memory))
        for w in filter(None, warnings):
            print(f"megalite: warning: {w}", file=sys.stderr)
    runtime = init_runtime(cfg)
    run_dir = broadcast_run_dir(Path(HydraConfig.get().runtime.output_dir).resolve())
    if runtime.topology.rank == 0:
        print(f"megalite: {runtime.topology.describe()} device={runtime.device} run_dir={run_dir}")
    Trainer(cfg, runtime, run_dir).fit()
    shutdown(runtime)


if __name__ == "__main__":
    keep_hydra_output_on_rank0()
    main()
