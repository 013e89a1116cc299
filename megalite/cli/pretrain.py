"""Pretrain a GPT-2 or Llama model with megalite.

    megalite-pretrain                               # tiny preset on the embedded stdlib corpus
    torchrun --nproc_per_node=8 --no-python megalite-pretrain model=gpt2 train.seq_len=1024

(`python scripts/pretrain.py ...` and `torchrun ... scripts/pretrain.py ...` in a checkout are
the same command.) Arguments are Hydra overrides of conf/config.yaml. The run directory is
Hydra's output directory (`hydra.run.dir`); metrics.jsonl, pretrain.log (rank 0's log), the
wandb run and (by default) checkpoints go there. The configuration is validated, the token
shards (and the init_from and resume checkpoints' model shape) checked, before any process
group is created; the run starts through the one launch path (`megalite.train.launch`: the
plan made once, logged here and written to the metrics header). At the end rank 0 logs a
summary: steps, tokens, final losses, mean MFU, where the metrics, wandb run and last
checkpoint are, and the commands that generate from, export, plot and evaluate the run. A run
directory holding resilience/fault.json (a hardware verdict, `megalite.resilience.faults`) is
refused: exit 75, naming the file.
"""
from __future__ import annotations

import os
import sys
from pathlib import Path
from typing import Optional

import hydra
import torch
from hydra.core.hydra_config import HydraConfig

from megalite.cli import NO_HYDRA_OUTPUT
from megalite.cli.fault_exit import fit_or_exit, refuse_after_fault
from megalite.cli.launch_env import export_launch_env, launch_env
from megalite.cli.refusal import refuse
from megalite.config.errors import ConfigError
from megalite.config.schema import CONF_DIR, check_presets, register_configs, to_config
from megalite.data.errors import DataError
from megalite.plan.auto import launch_layout
from megalite.plan.memory import memory_warning
from megalite.train.init_shape import adopt_init_from_model
from megalite.train.launch import plan_launch
from megalite.train.preflight import local_ranks_from_env, preflight
from megalite.train.runtime import local_gpu, local_gpus, shutdown, world_size_from_env
from megalite.train.summary import trainer_summary
from megalite.utils import log


def launch_rank() -> int:
    """This process's rank as torchrun set it (0 without torchrun)."""
    return int(os.environ.get("RANK", "0"))


def given_run_dir(argv) -> Optional[Path]:
    """The run directory the command line names (the last `hydra.run.dir=`), None where it
    names none or one Hydra interpolates (`${now:...}`)."""
    given = [a.partition("=")[2] for a in argv if a.startswith("hydra.run.dir=")]
    return Path(given[-1]) if given and "${" not in given[-1] else None


def keep_hydra_output_on_rank0() -> None:
    """Only rank 0 writes Hydra's run directory; the others get rank 0's path later (and
    megalite's logger writes their lines, if any, to stderr)."""
    if launch_rank() != 0:
        sys.argv += NO_HYDRA_OUTPUT


# The configs by absolute path: megalite/conf, the checkout's conf/ or an installed package's
# copy (a `pkg://` path would need an __init__.py in the config directory).
@hydra.main(config_path=str(CONF_DIR), config_name="config", version_base="1.3")
def pretrain(node) -> None:
    """One rank of a run (torchrun starts one process per rank)."""
    refuse_after_fault(Path(HydraConfig.get().runtime.output_dir))  # exit 75 after a fault
    auto = None
    try:
        cfg = to_config(node)  # a key the schema lacks (`+train.max_step=30`) is refused here
        # init_from a transformers model: its config.json's model, a disagreeing key refused
        cfg = adopt_init_from_model(cfg, HydraConfig.get().overrides.task)
        logger = log.configure(launch_rank(), cfg.log.all_ranks)
        if cfg.layout == "auto":  # the same choice on every rank (megalite.plan.auto)
            cfg, auto = launch_layout(cfg, world_size_from_env(), local_gpu(),
                                      local_ranks_from_env(), HydraConfig.get().overrides.task)
            if launch_rank() == 0:
                logger.info(f"layout=auto chose {' '.join(auto.overrides)}\n{auto.why}")
        layout, warnings = preflight(cfg, world_size_from_env(), local_gpus(),
                                     local_ranks_from_env(), local_gpu())
    except (ConfigError, DataError) as e:
        refuse(f"megalite: bad configuration: {e}", 2)
    ready = plan_launch(cfg, world_size_from_env(), layout)  # the plan, made once
    if launch_rank() == 0:  # the layout's plan and warnings are the same on every rank
        logger.info(ready.plan.table())
        if layout.device_type == "cuda":
            warnings.append(memory_warning(ready.plan,
                                           torch.cuda.get_device_properties(0).total_memory))
        for w in filter(None, warnings):
            logger.warning(w)
    run = ready.start(HydraConfig.get().runtime.output_dir,
                      planner=auto.record() if auto else None)
    runtime, trainer = run.runtime, run.trainer
    logger.info(f"{runtime.topology.describe()} device={runtime.device} "
                f"run_dir={run.run_dir}")
    records = fit_or_exit(trainer)  # a hardware verdict exits with HARDWARE_FAULT_EXIT
    if runtime.topology.rank == 0:  # what happened and what next (megalite.train.summary)
        logger.info(trainer_summary(trainer, records))
    shutdown(runtime)


def main() -> None:
    """`megalite-pretrain [overrides]`: Hydra reads the overrides from the command line. A
    Slurm launch without torchrun gets torchrun's variables first (`megalite.cli.launch_env`)."""
    try:
        check_presets(sys.argv[1:])
    except ConfigError as e:
        refuse(f"megalite: bad configuration: {e}", 2)
    try:
        export_launch_env(launch_env(gpus=local_gpus()))
    except ConfigError as e:
        refuse(f"megalite: bad launch: {e}", 2)
    given = given_run_dir(sys.argv[1:])
    if launch_rank() != 0 and given is not None:  # rank 0 checks Hydra's run dir; the others
        refuse_after_fault(given)                   # get "." from Hydra (no output of theirs)
    register_configs()
    keep_hydra_output_on_rank0()
    pretrain()


if __name__ == "__main__":
    main()
