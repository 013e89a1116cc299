"""GPT-2 weight initialisation that is the same in every parallel layout.

Each parameter's *global* value is drawn from its own generator, seeded by the run seed and the
parameter's global name, and each rank keeps its TP slice of it (`ParamSpec.shard`). Block 7's
weights are thus the same whether block 7 sits on pipeline stage 0 or 3, whole or split over
TP ranks, and the two copies of the tied embedding start equal. Memory: one global tensor at a
time.

Values (GPT-2 paper §2.3; HF `_init_weights`): weights N(0, 0.02), biases 0, LayerNorm (1, 0),
and the residual output projections (`attn.c_proj`, `mlp.c_proj`) N(0, 0.02 / sqrt(2 n_layer))
so the residual stream's variance does not grow with depth. Vocabulary padding rows are 0.
"""
from __future__ import annotations

import math
import zlib

import torch

from megalite.model.gpt2 import GPT2
from megalite.parallel.param_spec import ParamSpec


def _generator(seed: int, name: str, device: torch.device) -> torch.Generator:
    g = torch.Generator(device) if device.type == "cuda" else torch.Generator()
    g.manual_seed((seed * 1_000_003 + zlib.crc32(name.encode())) % 2**63)
    return g


def global_init_value(spec: ParamSpec, model: GPT2, seed: int, device: torch.device
                      ) -> torch.Tensor:
    cfg = model.cfg
    leaf = spec.name.rsplit(".", 1)[-1]
    owner = spec.name.rsplit(".", 2)[-2]
    if owner.startswith("ln_"):
        return torch.full(spec.shape, 1.0 if leaf == "weight" else 0.0, device=device)
    if leaf == "bias":
        return torch.zeros(spec.shape, device=device)
    std = cfg.initializer_range
    if owner == "c_proj":
        std /= math.sqrt(2 * cfg.n_layer)
    return torch.empty(spec.shape, device=device).normal_(
        0.0, std, generator=_generator(seed, spec.name, device))


@torch.no_grad()
def init_parameters(model: GPT2, seed: int) -> None:
    tp, tp_rank = model.tp_group.size, model.tp_group.rank
    for name, param in model.named_parameters():
        spec = model.param_specs[name]
        full = global_init_value(spec, model, seed, param.device)
        param.copy_(spec.shard(full, tp_rank, tp))


@torch.no_grad()
def load_global_state(model: GPT2, state: dict) -> None:
    """Copy this rank's slices of global tensors (HF names, nn.Linear orientation, unpadded
    vocabulary) into the stage; every parameter of the stage must be present."""
    tp, tp_rank = model.tp_group.size, model.tp_group.rank
    for name, param in model.named_parameters():
        spec = model.param_specs[name]
        if spec.name not in state:
            raise KeyError(f"{spec.name} missing from the state being loaded")
        param.copy_(spec.shard(state[spec.name].to(param.device, param.dtype), tp_rank, tp))
