"""resilience.rerun_deterministic's switches for a CUDA run, so that a healthy re-execution of
a step reproduces it (`megalite.resilience.rerun`): cuBLAS's fixed workspace, set at launch,
and torch's deterministic algorithms."""
from __future__ import annotations

import os

import torch


def cublas_workspace_env(res) -> None:
    """With resilience.rerun on and rerun_deterministic: cuBLAS's fixed workspace
    (CUBLAS_WORKSPACE_CONFIG=:4096:8, unless the user set it), which cuBLAS reads when its
    first handle is created, so it is set at launch before any CUDA work (launcher-level
    environment, like the NCCL flight recorder's)."""
    if res.rerun != "off" and res.rerun_deterministic:
        os.environ.setdefault("CUBLAS_WORKSPACE_CONFIG", ":4096:8")


def use_deterministic_kernels(device: torch.device) -> bool:
    """resilience.rerun_deterministic: on CUDA, torch's deterministic algorithms for the whole
    run (a re-execution must reproduce a healthy step bitwise, and the first execution is any
    step's): deterministic implementations where torch has them (the embedding's and
    scatter/index_add backwards without atomics, e.g.), a warning where it has none, and
    cuBLAS's fixed workspace (`cublas_workspace_env`, set by `init_runtime` before any cuBLAS
    handle exists: the peak-rate measurement and the model's build use cuBLAS before the
    trainer is built). Uninitialised memory is not filled (it is no
    determinism concern for correct code and would cost a write per allocation). Costs the
    deterministic kernels' speed, typically a few percent of a step (not measured here: no
    GPU). Returns whether it was switched on (CPU kernels are deterministic already)."""
    if device.type != "cuda":
        return False
    torch.use_deterministic_algorithms(True, warn_only=True)
    torch.utils.deterministic.fill_uninitialized_memory = False
    return True
