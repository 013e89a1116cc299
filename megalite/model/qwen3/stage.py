"""Qwen3 and Qwen3-MoE, architecturally identical to `transformers.Qwen3ForCausalLM` and
`Qwen3MoeForCausalLM`: Llama's (`megalite.model.llama.stage`) and Mixtral's
(`megalite.model.mixtral.stage`) stages whose attention normalises each query and key head
(RMSNorm over head_dim, one weight shared by the heads) before RoPE.
"""
from __future__ import annotations

from typing import Optional

import torch
import torch.nn as nn

from megalite.config.schema import ModelConfig
from megalite.model.causal_lm import RegionFactory
from megalite.model.llama.stage import Llama, LlamaAttention, LlamaBlock, RMSNorm
from megalite.model.mixtral.stage import Mixtral, MixtralBlock
from megalite.model.moe.ledger import RoutingLedger
from megalite.model.qwen3.family import QWEN3_FAMILY, QWEN3_MOE_FAMILY
from megalite.parallel.context_attention import ContextParallel
from megalite.parallel.group import Group


class Qwen3Attention(LlamaAttention):
    """Llama's attention with `q_norm` and `k_norm` (RMSNorm over each head, before RoPE)."""

    def __init__(self, cfg: ModelConfig, *args, **kwargs):
        super().__init__(cfg, *args, **kwargs)
        self.q_norm = RMSNorm(self.head_dim, cfg.layer_norm_epsilon)
        self.k_norm = RMSNorm(self.head_dim, cfg.layer_norm_epsilon)

    def head_norms(self, q: torch.Tensor, k: torch.Tensor):
        return self.q_norm(q), self.k_norm(k)


class Qwen3Block(LlamaBlock):
    attention_class = Qwen3Attention


class Qwen3MoeBlock(MixtralBlock):
    attention_class = Qwen3Attention


class Qwen3(Llama):
    """One pipeline stage of a Qwen3 (module tree and names as `Llama`'s)."""

    family = QWEN3_FAMILY

    @staticmethod
    def make_block(cfg: ModelConfig, tp_group: Group, sp: bool, tp_region: RegionFactory,
                   residual_region: RegionFactory, attention: str = "auto",
                   cp: Optional[ContextParallel] = None,
                   inv_freq: Optional[torch.Tensor] = None) -> nn.Module:
        return Qwen3Block(cfg, tp_group, sp, tp_region, residual_region, attention, cp,
                          inv_freq)


class Qwen3Moe(Mixtral):
    """One pipeline stage of a Qwen3-MoE (module tree and names as `Mixtral`'s)."""

    family = QWEN3_MOE_FAMILY

    @staticmethod
    def make_block(cfg: ModelConfig, tp_group: Group, sp: bool, tp_region: RegionFactory,
                   residual_region: RegionFactory, attention: str = "auto",
                   cp: Optional[ContextParallel] = None,
                   inv_freq: Optional[torch.Tensor] = None, index: int = 0,
                   ledger: Optional[RoutingLedger] = None) -> nn.Module:
        return Qwen3MoeBlock(cfg, tp_group, sp, tp_region, residual_region, attention, cp,
                             inv_freq, index, ledger)
