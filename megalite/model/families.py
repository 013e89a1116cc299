"""The model families by `model.arch` (the interface: `megalite.model.family`; the registry the
config asks: `megalite.config.families`), and what the shared code asks of a model through
them: its stage, its parameter count and FLOPs. A family registers once, by its stage
(`register`): GPT-2's, Llama's, Mixtral's, Qwen3's and Qwen3-MoE's here; a family of one's
own the same way."""
from __future__ import annotations

from typing import Dict, Iterator, Optional, Type, Union

from megalite.config.families import arch_names, register_family, registered_family
from megalite.config.schema import ModelConfig
from megalite.model.causal_lm import CausalLM
from megalite.model.family import Family
from megalite.model.gpt2.stage import GPT2
from megalite.model.llama.stage import Llama
from megalite.model.mixtral.stage import Mixtral
from megalite.model.qwen3.stage import Qwen3, Qwen3Moe

_STAGES: Dict[str, Type[CausalLM]] = {}


def register(stage: Type[CausalLM]) -> Family:
    """Register the family of `stage` (a `CausalLM` whose `family` names it, `model.arch`):
    the config's rules, the plan's terms, the HF mapping and the stage, in one call."""
    family_ = stage.family
    register_family(family_)
    _STAGES[family_.name] = stage
    return family_


def family(cfg: Union[ModelConfig, str]) -> Family:
    """The family of a model config (its `arch`) or of an arch name."""
    return registered_family(cfg if isinstance(cfg, str) else cfg.arch)


def families() -> Iterator[Family]:
    """The registered families, in registration order."""
    return (registered_family(arch) for arch in arch_names())


def family_of_model_type(model_type: Optional[str]) -> Optional[Family]:
    """The family whose `transformers` model has config.json's `model_type`, if any."""
    return next((f for f in families() if f.hf.model_type == model_type), None)


def causal_lm(cfg: ModelConfig, **kwargs) -> CausalLM:
    """A stage of `cfg`'s family (`CausalLM`'s arguments); the whole model by default."""
    return _STAGES[cfg.arch](cfg, **kwargs)


def make_block(cfg: ModelConfig, **kwargs):
    """One block of `cfg`'s family, alone (`CausalLM.make_block`'s arguments): what
    `megalite.plan.calibrate_block` times."""
    return _STAGES[cfg.arch].make_block(cfg, **kwargs)


def num_parameters(cfg: ModelConfig) -> int:
    """Parameters of the whole model (a tied embedding once, no vocabulary padding)."""
    return family(cfg).num_parameters(cfg)


def flops_per_token(cfg: ModelConfig, seq_len: int) -> int:
    """Training FLOPs per token of the model at `seq_len` (the family's formula)."""
    return family(cfg).flops_per_token(cfg, seq_len)


register(GPT2)
register(Llama)
register(Mixtral)
register(Qwen3)
register(Qwen3Moe)
