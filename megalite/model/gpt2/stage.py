"""GPT-2, architecturally identical to `transformers.GPT2LMHeadModel` (Radford et al. 2019),
built from tensor-parallel layers; one instance is one pipeline stage.

Learned absolute positions, pre-LayerNorm blocks, tanh-approximated GELU, causal attention via
`scaled_dot_product_attention`, final LayerNorm, LM head tied to the token embedding. Dropout
sits where HF puts it: after the embedding sum (embd_pdrop), on the attention probabilities
(attn_pdrop), after each residual branch (resid_pdrop).

Parallel layout (Megatron): attention is split by heads (fused QKV column-parallel, output
projection row-parallel), the MLP's fc column-parallel and proj row-parallel, the token
embedding and LM head split over the (padded) vocabulary with a vocab-parallel cross-entropy.
Activations are [s, b, h]; with sequence parallelism the residual stream, LayerNorms and dropout
work on [s/tp, b, h]. A stage holds blocks `blocks` (global indices, so parameter names are the
HF names: `transformer.h.7.attn.c_attn.weight`), plus the embeddings if it is the first stage
and ln_f + LM head if it is the last. A last stage that is not also the first holds its own copy
of the token embedding as `lm_head.weight` (initialised identically; its gradient is summed with
the first stage's over the embedding group).

Each parameter has a `ParamSpec` in `model.param_specs` (global name, global shape, TP split;
the family's lists, `megalite.model.gpt2.family`); weights use nn.Linear's [out, in] (HF's
Conv1D stores [in, out]; `megalite.model.gpt2.hf` transposes). The stage's shared part (head, loss,
recompute, offload): `megalite.model.causal_lm`.
"""
from __future__ import annotations

import contextlib
from typing import List, Optional

import torch
import torch.nn as nn
import torch.nn.functional as F

from megalite.config.schema import ModelConfig
from megalite.model.attention import causal_attention, kernel_region, token_positions
from megalite.model.causal_lm import CausalLM, RegionFactory, dropout
from megalite.model.document_attention import AttentionInputs, document_attention
from megalite.model.gpt2.family import GPT2_FAMILY
from megalite.parallel.context_attention import ContextParallel
from megalite.parallel.group import Group
from megalite.parallel.tensor import (
    ColumnParallelLinear,
    RowParallelLinear,
    VocabParallelEmbedding,
    sequence_chunk,
)


class CausalSelfAttention(nn.Module):
    def __init__(self, cfg: ModelConfig, tp_group: Group, sp: bool, tp_region: RegionFactory,
                 residual_region: RegionFactory, attention: str = "auto",
                 cp: Optional[ContextParallel] = None):
        super().__init__()
        if cfg.n_head % tp_group.size:
            raise ValueError(f"n_head={cfg.n_head} not divisible by tp={tp_group.size}")
        self.heads = cfg.n_head // tp_group.size  # heads of this TP rank
        self.head_dim = cfg.n_embd // cfg.n_head
        self.c_attn = ColumnParallelLinear(cfg.n_embd, 3 * cfg.n_embd, tp_group, sp)  # [q|k|v]
        self.c_proj = RowParallelLinear(cfg.n_embd, cfg.n_embd, tp_group, sp)
        self.attn_pdrop, self.resid_pdrop = cfg.attn_pdrop, cfg.resid_pdrop
        self.tp_region, self.residual_region = tp_region, residual_region
        self.kernel, self.kernel_region = attention, kernel_region(attention)
        self.cp = cp

    def forward(self, x: torch.Tensor, attn: Optional[AttentionInputs] = None) -> torch.Tensor:
        qkv = self.c_attn(x)  # [s, b, 3 * heads * head_dim], this rank's [q_r | k_r | v_r]
        s, b = qkv.shape[:2]
        q, k, v = qkv.view(s, b, 3, self.heads, self.head_dim).permute(2, 1, 3, 0, 4).unbind(0)
        p = self.attn_pdrop if self.training else 0.0
        with self.tp_region() if p > 0 else contextlib.nullcontext(), self.kernel_region():
            if attn is not None and attn.ids is not None:
                y = document_attention(q, k, v, attn, p, self.kernel, self.cp)
            else:
                y = causal_attention(q, k, v, p, self.cp)
        y = self.c_proj(y.permute(2, 0, 1, 3).reshape(s, b, self.heads * self.head_dim))
        return dropout(y, self.resid_pdrop, self.training, self.residual_region)


class MLP(nn.Module):
    def __init__(self, cfg: ModelConfig, tp_group: Group, sp: bool,
                 residual_region: RegionFactory):
        super().__init__()
        self.c_fc = ColumnParallelLinear(cfg.n_embd, cfg.ffn_size, tp_group, sp)
        self.c_proj = RowParallelLinear(cfg.ffn_size, cfg.n_embd, tp_group, sp)
        self.resid_pdrop, self.residual_region = cfg.resid_pdrop, residual_region

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        y = self.c_proj(F.gelu(self.c_fc(x), approximate="tanh"))
        return dropout(y, self.resid_pdrop, self.training, self.residual_region)


class Block(nn.Module):
    def __init__(self, cfg: ModelConfig, tp_group: Group, sp: bool, tp_region: RegionFactory,
                 residual_region: RegionFactory, attention: str = "auto",
                 cp: Optional[ContextParallel] = None):
        super().__init__()
        self.ln_1 = nn.LayerNorm(cfg.n_embd, eps=cfg.layer_norm_epsilon)
        self.attn = CausalSelfAttention(cfg, tp_group, sp, tp_region, residual_region, attention,
                                        cp)
        self.ln_2 = nn.LayerNorm(cfg.n_embd, eps=cfg.layer_norm_epsilon)
        self.mlp = MLP(cfg, tp_group, sp, residual_region)

    def forward(self, x: torch.Tensor, attn: Optional[AttentionInputs] = None) -> torch.Tensor:
        x = x + self.attn(self.ln_1(x), attn)
        return x + self.mlp(self.ln_2(x))


class GPT2(CausalLM):
    """One pipeline stage of GPT-2 (the whole model with the defaults: tp = pp = 1); the
    forward, loss, recompute and offload are `CausalLM`'s. The first stage holds
    `transformer.wte` and `transformer.wpe`, every stage its blocks `transformer.h.<i>`, the
    last `transformer.ln_f` and the LM head."""

    family = GPT2_FAMILY

    @staticmethod
    def make_block(cfg: ModelConfig, tp_group: Group, sp: bool, tp_region: RegionFactory,
                   residual_region: RegionFactory, attention: str = "auto",
                   cp: Optional[ContextParallel] = None) -> nn.Module:
        return Block(cfg, tp_group, sp, tp_region, residual_region, attention, cp)

    def build(self, attention: str) -> None:
        cfg, sp, tp_group = self.cfg, self.sequence_parallel, self.tp_group
        self.transformer = nn.Module()
        if self.first:
            self.transformer.wte = VocabParallelEmbedding(self.padded_vocab, cfg.n_embd,
                                                          tp_group, sp)
            self.transformer.wpe = nn.Embedding(cfg.n_positions, cfg.n_embd)
        self.transformer.h = nn.ModuleDict(
            {str(i): self.make_block(cfg, tp_group, sp, self.tp_region, self.residual_region,
                                     attention, self.cp) for i in self.blocks})
        if self.last:
            self.transformer.ln_f = nn.LayerNorm(cfg.n_embd, eps=cfg.layer_norm_epsilon)

    def block_list(self) -> List[nn.Module]:
        return list(self.transformer.h.values())

    def final_norm(self) -> nn.Module:
        return self.transformer.ln_f

    def token_embedding(self) -> nn.Module:
        return self.transformer.wte

    def sharding_units(self) -> List[nn.Module]:
        """The modules ZeRO-3 gathers one at a time, in forward order."""
        t = self.transformer
        units = [t.wte, t.wpe] if self.first else []
        units += list(t.h.values())
        if self.last:
            units += [t.ln_f, self.lm_head]
        return units

    def embed(self, ids: torch.Tensor, positions: Optional[torch.Tensor] = None
              ) -> torch.Tensor:
        """[b, s] token ids -> [s, b, h] (or this rank's [s/tp, b, h] with SP); with CP `s`
        is this rank's chunks' tokens, at their global positions. `positions` [b, s] (restarting
        per document) index the learned position embedding instead."""
        s = ids.shape[1]
        self.check_length(s)
        t = self.transformer
        x = t.wte(ids.t())
        chunk = sequence_chunk(s, self.tp_group, self.sequence_parallel)
        if positions is None:
            pos = token_positions(s, self.cp, ids.device)[chunk.start:chunk.stop]
            x = x + t.wpe(pos).unsqueeze(1)
        else:
            x = x + t.wpe(positions[:, chunk].t())
        return dropout(x, self.cfg.embd_pdrop, self.training, self.residual_region)
