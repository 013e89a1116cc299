"""The model families by `model.arch` (the interface: `megalite.model.family`), and what the
shared code asks of a model through them: its stage, its parameter count and FLOPs."""
from __future__ import annotations

from typing import Dict, Optional, Union

from megalite.config.schema import ModelConfig
from megalite.model.causal_lm import CausalLM
from megalite.model.family import Family
from megalite.model.gpt2 import GPT2
from megalite.model.llama import Llama

STAGES: Dict[str, type] = {"gpt2": GPT2, "llama": Llama}
FAMILIES: Dict[str, Family] = {arch: stage.family for arch, stage in STAGES.items()}


def family(cfg: Union[ModelConfig, str]) -> Family:
    """The family of a model config (its `arch`) or of an arch name."""
    arch = cfg if isinstance(cfg, str) else cfg.arch
    return FAMILIES[arch]


def family_of_model_type(model_type: Optional[str]) -> Optional[Family]:
    """The family whose `transformers` model has config.json's `model_type`, if any."""
    return next((f for f in FAMILIES.values() if f.hf.model_type == model_type), None)


def causal_lm(cfg: ModelConfig, **kwargs) -> CausalLM:
    """A stage of `cfg`'s family (`CausalLM`'s arguments); the whole model by default."""
    return STAGES[cfg.arch](cfg, **kwargs)


def make_block(cfg: ModelConfig, **kwargs):
    """One block of `cfg`'s family, alone (`CausalLM.make_block`'s arguments): what
    `megalite.plan.calibrate_block` times."""
    return STAGES[cfg.arch].make_block(cfg, **kwargs)


def num_parameters(cfg: ModelConfig) -> int:
    """Parameters of the whole model (a tied embedding once, no vocabulary padding)."""
    return family(cfg).num_parameters(cfg)


def flops_per_token(cfg: ModelConfig, seq_len: int) -> int:
    """Training FLOPs per token of the model at `seq_len` (the family's formula)."""
    return family(cfg).flops_per_token(cfg, seq_len)
