"""Who this process is in the job: rank, world size, local rank, from the launcher.

torchrun sets RANK / WORLD_SIZE / LOCAL_RANK / LOCAL_WORLD_SIZE (and MASTER_ADDR / PORT).
Launched by Slurm without torchrun (`srun python scripts/pretrain.py`, one task per GPU),
there are only SLURM_PROCID / SLURM_NTASKS / SLURM_LOCALID: without translating them every task
would be an independent world of one — N separate trainings sharing one checkpoint directory.
`launch_env()` derives the torchrun variables from Slurm's (MASTER_ADDR = the allocation's first
node, MASTER_PORT = 29500 + the job id mod 10000 unless set), refuses what cannot work before any
work (RANK without LOCAL_RANK when a process would see several GPUs: every rank of a node would
take cuda:0; Slurm variables that disagree with RANK / LOCAL_RANK), and `export_launch_env()`
writes them for `init_process_group`'s env:// rendezvous. A task bound to one GPU of its own
(`--gpus-per-task=1`) sees it as cuda:0: it is then local rank 0 of 1. Only srun's tasks are
translated: the batch script of an sbatch job is not one of the job's ranks.
"""
from __future__ import annotations

import os
import re
from dataclasses import dataclass
from typing import Dict, Mapping, Optional

from megalite.config.errors import ConfigError

TORCHRUN = ("TORCHELASTIC_RUN_ID", "GROUP_RANK")  # set by torchrun's agent for its workers
BATCH_STEPS = ("batch", "extern", "4294967294", "4294967295")  # Slurm's batch/extern step ids


@dataclass(frozen=True)
class LaunchEnv:
    rank: int = 0
    world_size: int = 1
    local_rank: int = 0
    local_world_size: int = 1
    master_addr: Optional[str] = None
    master_port: Optional[int] = None
    source: str = "none"  # torchrun (or RANK set by hand) | slurm | none (a world of one)


def first_host(nodelist: str) -> str:
    """The first host of a Slurm hostlist: "gpu[03-05,9],cpu1" -> "gpu03"."""
    match = re.match(r"([^,\[]+)(?:\[([^\]]+)\])?", nodelist.strip())
    if not match:
        raise ConfigError(f"SLURM_JOB_NODELIST={nodelist!r}: not a Slurm host list")
    prefix, ranges = match.groups()
    return prefix + (ranges.split(",")[0].split("-")[0] if ranges else "")


def _int(env: Mapping[str, str], key: str) -> int:
    try:
        return int(env[key])
    except ValueError:
        raise ConfigError(f"{key}={env[key]!r}: must be an integer") from None


def launch_env(env: Mapping[str, str] = os.environ, gpus: Optional[int] = None) -> LaunchEnv:
    """The launch this process belongs to (`gpus`: the GPUs it sees; None without CUDA)."""
    if "RANK" in env:
        return _from_rank(env, gpus)
    if _srun_task(env) and _int(env, "SLURM_NTASKS") > 1:
        return _from_slurm(env, gpus)
    return LaunchEnv()


def _srun_task(env: Mapping[str, str]) -> bool:
    """A task that srun started: a job step, not the batch script itself (an sbatch script
    with --ntasks > 1 also sees SLURM_PROCID=0 and SLURM_NTASKS; run there directly, megalite
    is a world of one, as before)."""
    step = env.get("SLURM_STEP_ID", env.get("SLURM_STEPID"))
    return "SLURM_PROCID" in env and step is not None and step not in BATCH_STEPS


def _from_rank(env: Mapping[str, str], gpus: Optional[int]) -> LaunchEnv:
    rank, world = _int(env, "RANK"), _int(env, "WORLD_SIZE") if "WORLD_SIZE" in env else None
    if world is None:
        raise ConfigError(f"RANK={rank} is set but WORLD_SIZE is not: launch with torchrun, "
                          "or set both (and LOCAL_RANK)")
    if "LOCAL_RANK" not in env and (gpus or 0) > 1:
        raise ConfigError(f"RANK={rank} without LOCAL_RANK on a node where a process sees "
                          f"{gpus} GPUs: every rank would take cuda:0; launch with torchrun, "
                          "set LOCAL_RANK, or give each process one GPU (CUDA_VISIBLE_DEVICES)")
    local = _int(env, "LOCAL_RANK") if "LOCAL_RANK" in env else 0
    if "SLURM_PROCID" in env and not any(k in env for k in TORCHRUN):
        for key, ours, slurm in (("RANK", rank, "SLURM_PROCID"),
                                 ("LOCAL_RANK", local, "SLURM_LOCALID")):
            if slurm in env and key in env and _int(env, slurm) != ours:
                raise ConfigError(f"{key}={ours} but {slurm}={env[slurm]}: the Slurm task and "
                                  f"the rank disagree; unset {key} (megalite derives it from "
                                  "Slurm's) or launch with torchrun")
    return LaunchEnv(rank, world, local, _int(env, "LOCAL_WORLD_SIZE")
                     if "LOCAL_WORLD_SIZE" in env else 1, env.get("MASTER_ADDR"),
                     _int(env, "MASTER_PORT") if "MASTER_PORT" in env else None, "torchrun")


def _from_slurm(env: Mapping[str, str], gpus: Optional[int]) -> LaunchEnv:
    missing = [k for k in ("SLURM_NTASKS", "SLURM_LOCALID", "SLURM_JOB_NODELIST")
               if k not in env]
    if missing:
        raise ConfigError(f"SLURM_PROCID={env['SLURM_PROCID']} without {', '.join(missing)}: "
                          "cannot tell this task's rank and node; launch with torchrun")
    per_node = env.get("SLURM_NTASKS_PER_NODE") or env.get("SLURM_TASKS_PER_NODE", "1")
    port = _int(env, "MASTER_PORT") if "MASTER_PORT" in env else \
        29500 + int(env.get("SLURM_JOB_ID", "0")) % 10000
    local, per_node_tasks = _int(env, "SLURM_LOCALID"), int(re.match(r"\d+", per_node).group())
    if gpus == 1:  # each task bound to its own GPU (--gpus-per-task=1): it is cuda:0 there
        local, per_node_tasks = 0, 1
    return LaunchEnv(_int(env, "SLURM_PROCID"), _int(env, "SLURM_NTASKS"), local,
                     per_node_tasks,
                     env.get("MASTER_ADDR") or first_host(env["SLURM_JOB_NODELIST"]), port,
                     "slurm")


def exported(launch: LaunchEnv) -> Dict[str, str]:
    """The torchrun variables of a launch derived from Slurm's (nothing otherwise)."""
    if launch.source != "slurm":
        return {}
    return {"RANK": str(launch.rank), "WORLD_SIZE": str(launch.world_size),
            "LOCAL_RANK": str(launch.local_rank),
            "LOCAL_WORLD_SIZE": str(launch.local_world_size),
            "MASTER_ADDR": launch.master_addr, "MASTER_PORT": str(launch.master_port)}


def export_launch_env(launch: LaunchEnv) -> None:
    """Set the torchrun variables a Slurm launch lacks, for env:// rendezvous."""
    os.environ.update(exported(launch))
