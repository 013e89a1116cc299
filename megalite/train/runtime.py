"""Process start-up: device, backend, process group, topology (with the observers of its
collectives that the configuration asks for), precision.

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

from megalite.config.layout import GpuInfo, Layout, device_type_for
from megalite.config.schema import Config
from megalite.parallel.group import CollectiveWaits
from megalite.parallel.topology import Topology, build_topology
from megalite.resilience.deterministic import cublas_workspace_env
from megalite.resilience.flight import FlightRecorder
from megalite.resilience.nccl_flight import set_nccl_flight_env
from megalite.utils.clock import DeviceClock


@dataclass
class Runtime:
    layout: Layout
    topology: Topology
    device: torch.device
    local_rank: int = 0  # this process's index on its node

    @property
    def compute_dtype(self) -> torch.dtype:
        """dtype of the model's parameters and activations; the optimizer's master weights
        and moments are always fp32."""
        return self.layout.compute_dtype

    def synchronize(self) -> None:
        if self.device.type == "cuda":
            torch.cuda.synchronize(self.device)


def world_size_from_env() -> int:
    return int(os.environ.get("WORLD_SIZE", "1"))


def local_gpus() -> Optional[int]:
    """GPUs of this node (None without CUDA), for validating the TP size before launch."""
    return torch.cuda.device_count() if torch.cuda.is_available() else None


def local_gpu() -> Optional[GpuInfo]:
    """What this node's GPUs can do (the first one's name, bf16 support and compute
    capability), None without CUDA. bf16 by compute capability >= 8.0:
    `is_bf16_supported()` also answers True where bf16 is only emulated."""
    if not torch.cuda.is_available():
        return None
    capability = torch.cuda.get_device_capability(0)
    return GpuInfo(torch.cuda.get_device_name(0), capability[0] >= 8, capability)


def run_layout(cfg: Config) -> Layout:
    """The layout of this launch: `cfg` (validated) on the launcher's world size, on the
    device kind this node offers for `cfg.device`."""
    gpu = local_gpu()
    return Layout.from_config(cfg, world_size_from_env(), device_type_for(cfg.device, local_gpus()),
                              bf16=gpu is None or gpu.bf16)


def local_device(layout: Layout, local_rank: int) -> torch.device:
    """This process's device: its node-local GPU on CUDA (made current), else the CPU."""
    if layout.device_type == "cuda":
        torch.cuda.set_device(local_rank)
        return torch.device("cuda", local_rank)
    return torch.device("cpu")


def init_runtime(cfg: Config, layout: Optional[Layout] = None) -> Runtime:
    """Create the process group (if launched with WORLD_SIZE > 1 or under torchrun) and the
    topology. `cfg` must already be validated; `layout` defaults to `run_layout(cfg)`."""
    layout = layout or run_layout(cfg)
    local_rank = int(os.environ.get("LOCAL_RANK", "0"))
    device = local_device(layout, local_rank)
    if device.type == "cuda":
        cublas_workspace_env(cfg.resilience)  # before any cuBLAS handle exists
    if "RANK" in os.environ and not dist.is_initialized():
        backend = "nccl" if device.type == "cuda" else "gloo"
        kwargs = {"device_id": device} if device.type == "cuda" else {}
        if backend == "nccl" and cfg.resilience.hang_dump:  # read as the group is created
            set_nccl_flight_env()
        dist.init_process_group(backend=backend, timeout=timedelta(seconds=cfg.parallel.timeout_s),
                                **kwargs)
    rank = dist.get_rank() if dist.is_initialized() else 0
    res = cfg.resilience
    topo = build_topology(
        layout.tp_size, layout.pp_size, layout.dp_size, cp=layout.cp_size,
        ep=layout.ep_size, order=layout.rank_order,
        timeout_s=cfg.parallel.timeout_s,
        checkpoint_timeout_s=cfg.checkpoint.timeout_s,
        # straggler reports: the time each rank waits inside collectives
        waits=CollectiveWaits(DeviceClock(device)) if res.straggler_report_every else None,
        # hang dumps: every group's last collectives (the hang watch reads them)
        flight=_flight_recorder(cfg, rank) if res.hang_dump else None)
    return Runtime(layout=layout, topology=topo, device=device, local_rank=local_rank)


def _flight_recorder(cfg: Config, rank: int) -> FlightRecorder:
    """The hang dumps' recorder: an operation is stuck `resilience.hang_after_s` after its
    launch (the checkpoint group's threshold the same fraction of checkpoint.timeout_s)."""
    train_s, checkpoint_s = cfg.resilience.hang_thresholds(cfg.parallel.timeout_s,
                                                           cfg.checkpoint.timeout_s)
    return FlightRecorder(rank, cfg.resilience.hang_history, hang_after_s=train_s,
                          thresholds={"checkpoint": checkpoint_s})


def shutdown(runtime: Optional[Runtime] = None) -> None:
    if dist.is_available() and dist.is_initialized():
        dist.barrier()
        dist.destroy_process_group()
