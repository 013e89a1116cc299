"""Process start-up: device, backend, process group, topology, precision.

CUDA + NCCL when GPUs are present (one GPU per local rank), CPU + gloo otherwise. The launcher
(torchrun) provides RANK / WORLD_SIZE / LOCAL_RANK; without them the process is a world of one
and no process group is created.
"""
from __future__ import annotations

import os
from dataclasses import dataclass
from datetime import timedelta
from typing import Optional

import torch
import torch.distributed as dist

from megalite.config import Config, dp_size, resolved_precision
from megalite.parallel.topology import Topology, build_topology


@dataclass
class Runtime:
    topology: Topology
    device: torch.device
    compute_dtype: torch.dtype  # dtype of the model's parameters and activations; the
    #                             optimizer's master weights and moments are always fp32

    def synchronize(self) -> None:
        if self.device.type == "cuda":
            torch.cuda.synchronize(self.device)


def world_size_from_env() -> int:
    return int(os.environ.get("WORLD_SIZE", "1"))


def local_gpus() -> Optional[int]:
    """GPUs of this node (None without CUDA), for validating the TP size before launch."""
    return torch.cuda.device_count() if torch.cuda.is_available() else None


def pick_device(setting: str, local_rank: int) -> torch.device:
    if setting == "cuda" or (setting == "auto" and torch.cuda.is_available()):
        if not torch.cuda.is_available():
            raise RuntimeError("device=cuda but torch.cuda.is_available() is False")
        torch.cuda.set_device(local_rank)
        return torch.device("cuda", local_rank)
    return torch.device("cpu")


DTYPES = {"bf16": torch.bfloat16, "fp16": torch.float16, "fp32": torch.float32}


def compute_dtype(precision: str, device: torch.device) -> torch.dtype:
    return DTYPES[resolved_precision(precision, device.type)]


def init_runtime(cfg: Config) -> Runtime:
    """Create the process group (if launched with WORLD_SIZE > 1 or under torchrun) and the
    topology. `cfg` must already be validated."""
    world = world_size_from_env()
    local_rank = int(os.environ.get("LOCAL_RANK", "0"))
    device = pick_device(cfg.device, local_rank)
    if "RANK" in os.environ and not dist.is_initialized():
        backend = "nccl" if device.type == "cuda" else "gloo"
        kwargs = {"device_id": device} if device.type == "cuda" else {}
        dist.init_process_group(backend=backend, timeout=timedelta(seconds=cfg.parallel.timeout_s),
                                **kwargs)
    topo = build_topology(cfg.tp, cfg.pp, dp_size(cfg, world), timeout_s=cfg.parallel.timeout_s,
                          checkpoint_group=cfg.checkpoint.async_save)
    return Runtime(topology=topo, device=device, compute_dtype=compute_dtype(cfg.precision, device))


def shutdown(runtime: Optional[Runtime] = None) -> None:
    if dist.is_available() and dist.is_initialized():
        dist.barrier()
        dist.destroy_process_group()
