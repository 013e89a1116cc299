"""Weight initialisation that is the same in every parallel layout, for any model family.

Each parameter's *global* value is drawn from its own generator, seeded by the run seed and the
parameter's global name, and each rank keeps its TP slice of it (`ParamSpec.shard`; of a
routed expert weight under expert parallelism, its EP rank's experts). Block 7's
weights are thus the same whether block 7 sits on pipeline stage 0 or 3, whole or split over
TP ranks, and the two copies of a tied embedding start equal. Memory: one global tensor at a
time.

Values: the family's (`Family.initial_value`; GPT-2: weights N(0, 0.02), biases 0, LayerNorm
(1, 0), the residual output projections N(0, 0.02 / sqrt(2 n_layer)); Llama: weights
N(0, 0.02), RMSNorms 1). Vocabulary padding rows are 0.
"""
from __future__ import annotations

import zlib

import torch

from megalite.model.causal_lm import CausalLM
from megalite.parallel.param_spec import ParamSpec


def _generator(seed: int, name: str, device: torch.device) -> torch.Generator:
    g = torch.Generator(device) if device.type == "cuda" else torch.Generator()
    g.manual_seed((seed * 1_000_003 + zlib.crc32(name.encode())) % 2**63)
    return g


def global_init_value(spec: ParamSpec, model: CausalLM, seed: int, device: torch.device
                      ) -> torch.Tensor:
    initial = model.family.initial_value(model.cfg, spec.name)
    if initial.std is None:
        return torch.full(spec.shape, initial.fill, device=device)
    return torch.empty(spec.shape, device=device).normal_(
        0.0, initial.std, generator=_generator(seed, spec.name, device))


@torch.no_grad()
def init_parameters(model: CausalLM, seed: int) -> None:
    tp, tp_rank = model.tp_group.size, model.tp_group.rank
    for name, param in model.named_parameters():
        spec = model.param_specs[name]
        full = global_init_value(spec, model, seed, param.device)
        param.copy_(spec.shard(full, tp_rank, tp, model.ep_rank, model.ep_size))


@torch.no_grad()
def load_global_state(model: CausalLM, state: dict) -> None:
    """Copy this rank's slices of global tensors (HF names, nn.Linear orientation, unpadded
    vocabulary; of the routed experts its EP rank's) into the stage; every parameter of the
    stage must be present."""
    tp, tp_rank = model.tp_group.size, model.tp_group.rank
    for name, param in model.named_parameters():
        spec = model.param_specs[name]
        if spec.name not in state:
            raise KeyError(f"{spec.name} missing from the state being loaded")
        param.copy_(spec.shard(state[spec.name].to(param.device, param.dtype), tp_rank, tp,
                               model.ep_rank, model.ep_size))
