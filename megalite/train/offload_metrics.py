"""The offload figures of a metrics line (`StepReport._record`'s memory section): the host bytes
each offload holds and the PCIe bytes the optimizer offload copied per step, the most of any
rank (collective over the world). The time blocked on the copies is the step phase
`offload_wait` (`megalite.train.timers`)."""
from __future__ import annotations

from typing import Optional

import torch
import torch.distributed as dist

from megalite.model.activation_offload import ActivationOffload
from megalite.parallel import comm
from megalite.parallel.offload import OptimizerOffload


def offload_memory(activations: Optional[ActivationOffload],
                   optimizer: Optional[OptimizerOffload], world_group,
                   device: torch.device, steps: int = 1) -> dict:
    """{} when nothing is offloaded. activation_offload_host_peak_bytes: the most host bytes
    offloaded activations held during the interval; optimizer_offload_host_bytes: the host
    optimizer state; optimizer_offload_pcie_bytes: device->host + host->device bytes per
    step (gradients in, parameters out)."""
    keys, values = [], []
    if activations is not None:
        keys.append("activation_offload_host_peak_bytes")
        values.append(float(activations.take_peak()))
    if optimizer is not None:
        copied = optimizer.take_copied_bytes()
        keys += ["optimizer_offload_host_bytes", "optimizer_offload_pcie_bytes"]
        values += [float(optimizer.host_bytes()), (copied["d2h"] + copied["h2d"]) / steps]
    if not keys:
        return {}
    values = comm.all_reduce_scalars(values, world_group, device, op=dist.ReduceOp.MAX)
    return {k: int(v) for k, v in zip(keys, values)}
