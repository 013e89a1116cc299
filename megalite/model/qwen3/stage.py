"""Qwen3 and Qwen3-MoE, architecturally identical to `transformers.Qwen3ForCausalLM` and
`Qwen3MoeForCausalLM`: Llama's (`megalite.model.llama.stage`) and Mixtral's
(`megalite.model.mixtral.stage`) stages whose attention normalises each query and key head
(RMSNorm over head_dim, one weight shared by the heads) before RoPE.
"""
from __future__ import annotations

import torch

from megalite.config.schema import ModelConfig
from megalite.model.llama.stage import Llama, LlamaAttention, LlamaBlock, RMSNorm
from megalite.model.mixtral.stage import Mixtral, MixtralBlock
from megalite.model.qwen3.family import QWEN3_FAMILY, QWEN3_MOE_FAMILY


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
    block_class = Qwen3Block


class Qwen3Moe(Mixtral):
    """One pipeline stage of a Qwen3-MoE (module tree and names as `Mixtral`'s)."""

    family = QWEN3_MOE_FAMILY
    block_class = Qwen3MoeBlock
