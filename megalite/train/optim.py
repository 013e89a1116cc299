"""AdamW with decay / no-decay groups, the warmup + cosine schedule, global grad-norm clipping."""
from __future__ import annotations

import math
from typing import Iterable, List

import torch
import torch.nn as nn

from megalite.config import OptimConfig
from megalite.parallel import comm
from megalite.parallel.comm import Group


def param_groups(model: nn.Module, weight_decay: float) -> List[dict]:
    """Matrices (linear weights, embeddings) decay; biases and LayerNorm parameters do not
    (Loshchilov & Hutter 2019; as in GPT-2/nanoGPT/Megatron). The tied embedding appears once."""
    decay, no_decay = [], []
    for _, p in {id(p): (n, p) for n, p in model.named_parameters()}.values():
        if p.requires_grad:
            (decay if p.dim() >= 2 else no_decay).append(p)
    return [{"params": decay, "weight_decay": weight_decay},
            {"params": no_decay, "weight_decay": 0.0}]


def build_optimizer(model: nn.Module, cfg: OptimConfig, device: torch.device
                    ) -> torch.optim.AdamW:
    """AdamW; the fused CUDA kernel on GPUs, the foreach implementation otherwise."""
    extra = {"fused": True} if device.type == "cuda" else {"foreach": True}
    return torch.optim.AdamW(param_groups(model, cfg.weight_decay), lr=cfg.lr,
                             betas=tuple(cfg.betas), eps=cfg.eps, **extra)


def lr_at(step: int, cfg: OptimConfig, max_steps: int) -> float:
    """Learning rate for optimizer step `step` (0-based): linear warmup over `warmup_steps`
    from lr/warmup to lr, then cosine decay to `min_lr` at `decay_steps` (default max_steps),
    constant `min_lr` after (Loshchilov & Hutter 2017, SGDR without restarts)."""
    if cfg.warmup_steps > 0 and step < cfg.warmup_steps:
        return cfg.lr * (step + 1) / cfg.warmup_steps
    decay_steps = cfg.decay_steps or max_steps
    if step >= decay_steps:
        return cfg.min_lr
    progress = (step - cfg.warmup_steps) / max(1, decay_steps - cfg.warmup_steps)
    return cfg.min_lr + 0.5 * (1.0 + math.cos(math.pi * progress)) * (cfg.lr - cfg.min_lr)


def set_lr(optimizer: torch.optim.Optimizer, lr: float) -> None:
    for group in optimizer.param_groups:
        group["lr"] = lr


def global_grad_norm(params: Iterable[torch.Tensor], mp_group: Group) -> torch.Tensor:
    """L2 norm of all gradients of one model replica.

    Each rank sums the squares of the gradients it owns; the sums are all-reduced over the
    model-parallel group (TP x PP), so every rank gets the norm of the whole model. DP replicas
    hold identical (already averaged) gradients and need no reduction.
    """
    grads = [p.grad for p in params if p.grad is not None]
    device = grads[0].device if grads else torch.device("cpu")
    sq = torch.zeros((), dtype=torch.float32, device=device)
    if grads:
        sq = torch.stack([torch.linalg.vector_norm(g.float()) ** 2 for g in grads]).sum()
    comm.all_reduce(sq, mp_group)
    return sq.sqrt()


def clip_grads_(params: Iterable[torch.Tensor], max_norm: float, total_norm: torch.Tensor
                ) -> None:
    """Scale gradients so their global norm is at most `max_norm` (no-op when 0)."""
    if max_norm <= 0:
        return
    coef = torch.clamp(max_norm / (total_norm + 1e-6), max=1.0)
    grads = [p.grad for p in params if p.grad is not None]
    if grads:
        torch._foreach_mul_(grads, coef.to(grads[0].device))
