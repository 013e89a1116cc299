"""Mixtral, architecturally identical to `transformers.MixtralForCausalLM` (Jiang et al. 2024):
Llama's pre-RMSNorm blocks, rotary positions and grouped-query attention
(`megalite.model.llama.stage`), each block's MLP an MoE layer (`megalite.model.moe.layer`;
blocks `model.moe.is_moe_layer` does not name keep Llama's dense SwiGLU). One instance is one
pipeline stage; its MoE layers record their routing in the stage's ledger (`routing`), whose
penalty the shared forward adds to the loss's gradient (`megalite.model.causal_lm`).
"""
from __future__ import annotations

from typing import Optional

import torch
import torch.nn as nn

from megalite.config.schema import ModelConfig
from megalite.model.causal_lm import RegionFactory, dropout
from megalite.model.document_attention import AttentionInputs
from megalite.model.llama.stage import Llama, LlamaAttention, LlamaMLP, RMSNorm
from megalite.model.mixtral.family import MIXTRAL_FAMILY
from megalite.model.moe.dispatcher import TokenDispatcher
from megalite.model.moe.layer import MoELayer
from megalite.model.moe.ledger import RoutingLedger
from megalite.model.moe.tokens import TokenSplit
from megalite.parallel.context_attention import ContextParallel
from megalite.parallel.group import Group


class MixtralBlock(nn.Module):
    """Block `index`: attention, then the MoE layer (or a dense MLP) on the residual stream."""

    attention_class = LlamaAttention  # the block's attention module (Qwen3-MoE's: q/k norms)

    def __init__(self, cfg: ModelConfig, tp_group: Group, sp: bool, tp_region: RegionFactory,
                 residual_region: RegionFactory, attention: str = "auto",
                 cp: Optional[ContextParallel] = None, inv_freq: Optional[torch.Tensor] = None,
                 index: int = 0, ledger: Optional[RoutingLedger] = None,
                 dispatcher: Optional[TokenDispatcher] = None):
        super().__init__()
        eps = cfg.layer_norm_epsilon
        self.input_layernorm = RMSNorm(cfg.n_embd, eps)
        self.self_attn = self.attention_class(cfg, tp_group, sp, tp_region, residual_region,
                                              attention, cp, inv_freq)
        self.post_attention_layernorm = RMSNorm(cfg.n_embd, eps)
        self.moe = cfg.moe.is_moe_layer(index)
        split = TokenSplit.of(tp_group, sp, None if cp is None else cp.group)
        self.mlp = MoELayer(cfg.moe, cfg.n_embd, cfg.ffn_size, index, ledger, tp_group.size,
                            split, dispatcher) if self.moe \
            else LlamaMLP(cfg, tp_group, sp, residual_region)
        self.resid_pdrop, self.residual_region = cfg.resid_pdrop, residual_region

    def forward(self, x: torch.Tensor, attn: Optional[AttentionInputs] = None) -> torch.Tensor:
        x = x + self.self_attn(self.input_layernorm(x), attn)
        y = self.mlp(self.post_attention_layernorm(x))
        if self.moe:
            y = dropout(y, self.resid_pdrop, self.training, self.residual_region)
        return x + y


class Mixtral(Llama):
    """One pipeline stage of a Mixtral (the whole model with the defaults); module tree and
    names as `Llama`'s, the MLPs `MoELayer`s."""

    family = MIXTRAL_FAMILY
    block_class = MixtralBlock

    @classmethod
    def make_block(cls, cfg: ModelConfig, tp_group: Group, sp: bool, tp_region: RegionFactory,
                   residual_region: RegionFactory, attention: str = "auto",
                   cp: Optional[ContextParallel] = None,
                   inv_freq: Optional[torch.Tensor] = None, index: int = 0,
                   ledger: Optional[RoutingLedger] = None,
                   dispatcher: Optional[TokenDispatcher] = None) -> nn.Module:
        return cls.block_class(cfg, tp_group, sp, tp_region, residual_region, attention, cp,
                               inv_freq, index, ledger, dispatcher)

    def block_at(self, index: int, attention: str, inv_freq: torch.Tensor) -> nn.Module:
        return self.make_block(self.cfg, self.tp_group, self.sequence_parallel, self.tp_region,
                               self.residual_region, attention, self.cp, inv_freq, index,
                               self.routing, self.expert_dispatch)
