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

from megalite.config import ConfigError, register_configs, to_config  # noqa: E402
from megalite.data.loader import DataError  # noqa: E402
from megalite.plan import make_plan, memory_warning  # noqa: E402
from megalite.runtime import init_runtime, local_gpus, shutdown, world_size_from_env  # noqa: E402
from megalite.train.preflight import local_ranks_from_env, preflight  # noqa: E402
from megalite.train.build import broadcast_run_dir, build_trainer  # noqa: E402

register_configs()


def keep_hydra_output_on_rank0() -> None:
    """Only rank 0 writes Hydra's run directory; the others get rank 0's path later."""
    if int(os.environ.get("RANK", "0")) != 0:
        sys.argv += ["hydra.output_subdir=null", "hydra.run.dir=.",
                     "hydra/job_logging=disabled", "hydra/hydra_logging=disabled"]


@hydra.main(config_path="../conf", config_name="config", version_base="1.3")
def main(node) -> None:
    cfg = to_config(node)
    try:
        layout, warnings = preflight(cfg, world_size_from_env(), local_gpus(),
                                     local_ranks_from_env())
    except (ConfigError, DataError) as e:
        print(f"megalite: bad configuration: {e}", file=sys.stderr)
        sys.exit(2)
    if int(os.environ.get("RANK", "0")) == 0:
        plan = make_plan(cfg, layout)
        print(plan.table())
        if layout.device_type == "cuda":
            warnings.append(memory_warning(plan, torch.cuda.get_device_properties(0).total_memory))
        for w in filter(None, warnings):
            print(f"megalite: warning: {w}", file=sys.stderr)
    runtime = init_runtime(cfg, layout)
    run_dir = broadcast_run_dir(Path(HydraConfig.get().runtime.output_dir).resolve(),
                                runtime.topology)
    if runtime.topology.rank == 0:
        print(f"megalite: {runtime.topology.describe()} device={runtime.device} run_dir={run_dir}")
    build_trainer(cfg, runtime, run_dir).fit()
    shutdown(runtime)


if __name__ == "__main__":
    keep_hydra_output_on_rank0()
    main()
