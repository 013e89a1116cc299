"""Llama, architecturally identical to `transformers.LlamaForCausalLM` (Touvron et al. 2023;
Llama 3, Dubey et al. 2024), built from tensor-parallel layers; one instance is one pipeline
stage (the shared part, `megalite.model.causal_lm`: head, loss, recompute, offload).

Pre-RMSNorm blocks, rotary positions (`megalite.model.llama.rope`: rope_theta, Llama 3's scaling),
grouped-query attention (`n_kv_head` key/value heads shared by n_head / n_kv_head query heads
each) through `scaled_dot_product_attention`, a SwiGLU MLP (down(silu(gate(x)) · up(x))), no
biases, a final RMSNorm and an LM head of its own (or the token embedding, with
`tie_word_embeddings`, as Llama 3.2 1B/3B). Dropout where megalite's GPT-2 has it (all 0 in
the presets; transformers' Llama has attention dropout only).

Parallel layout (Megatron): q, k and v are column-parallel projections of one input — each a
parameter of its own with transformers' name, computed by one column-parallel product that
gathers (or copies) its input once (`column_parallel_linears`); o_proj row-parallel. TP splits
the query heads and the KV heads alike: with tp <= n_kv_head each rank holds n_kv_head / tp KV
heads; with tp > n_kv_head each rank holds the one KV head its query heads read, replicated
over the tp / n_kv_head ranks that share it (`ParamSpec.tp_replicas`; the engine sums their
gradients, `megalite.parallel.grad_sums.sum_tp_shares`). The MLP's gate and up projections are
one column-parallel parameter `mlp.gate_up_proj` ([gate | up], each block split over TP:
`tp_interleave=2`, transformers' Phi-3 name for the same fusion; the HF mapping splits it),
down_proj row-parallel. The token embedding and the LM head are split over the padded
vocabulary.
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
from megalite.model.llama.family import LLAMA_FAMILY, kv_split
from megalite.model.llama.rope import apply_rotary, cos_sin, inverse_frequencies
from megalite.parallel.context_attention import ContextParallel
from megalite.parallel.group import Group
from megalite.parallel.tensor import (
    ColumnParallelLinear,
    RowParallelLinear,
    VocabParallelEmbedding,
    column_parallel_linears,
)


class _RMSNormFunction(torch.autograd.Function):
    """y = w · (x / sqrt(mean(x²) + eps)), normalised in fp32 and cast back before the
    weight as transformers' LlamaRMSNorm does; saves only x and the fp32 reciprocal RMS (as
    LayerNorm saves its input and statistics), the normalised x recomputed in backward."""

    @staticmethod
    def forward(ctx, x, weight, eps: float):
        xf = x.float()
        rstd = torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + eps)
        ctx.save_for_backward(x, weight, rstd)
        return weight * (xf * rstd).to(x.dtype)

    @staticmethod
    def backward(ctx, grad):
        x, weight, rstd = ctx.saved_tensors
        normed = x.float() * rstd
        g = grad.float()
        grad_w = (g * normed.to(x.dtype).float()).reshape(-1, x.shape[-1]).sum(0)
        gn = g * weight.float()
        grad_x = rstd * (gn - normed * (gn * normed).mean(-1, keepdim=True))
        return grad_x.to(x.dtype), grad_w.to(weight.dtype), None


class RMSNorm(nn.Module):
    """Root-mean-square norm with a weight and no bias (Zhang & Sennrich 2019)."""

    def __init__(self, dim: int, eps: float):
        super().__init__()
        self.weight = nn.Parameter(torch.empty(dim))
        self.eps = eps

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return _RMSNormFunction.apply(x, self.weight, self.eps)


class Projection(nn.Module):
    """A column-parallel projection's weight (this rank's rows), computed together with its
    siblings' by `column_parallel_linears` (its module name gives transformers' name)."""

    def __init__(self, rows: int, in_features: int):
        super().__init__()
        self.weight = nn.Parameter(torch.empty(rows, in_features))


class LlamaAttention(nn.Module):
    """`inv_freq`: the rotary inverse frequencies (`rope.inverse_frequencies`), one tensor
    shared by a stage's blocks."""

    def __init__(self, cfg: ModelConfig, tp_group: Group, sp: bool, tp_region: RegionFactory,
                 residual_region: RegionFactory, attention: str = "auto",
                 cp: Optional[ContextParallel] = None, inv_freq: Optional[torch.Tensor] = None):
        super().__init__()
        tp = tp_group.size
        if cfg.n_head % tp:
            raise ValueError(f"n_head={cfg.n_head} not divisible by tp={tp}")
        self.head_dim = cfg.head_size
        self.heads = cfg.n_head // tp  # query heads of this TP rank
        self.kv_heads = kv_split(cfg.kv_heads, tp)[0]  # KV heads of this TP rank
        self.q_proj = Projection(self.heads * self.head_dim, cfg.n_embd)
        self.k_proj = Projection(self.kv_heads * self.head_dim, cfg.n_embd)
        self.v_proj = Projection(self.kv_heads * self.head_dim, cfg.n_embd)
        self.o_proj = RowParallelLinear(cfg.n_head * self.head_dim, cfg.n_embd, tp_group, sp,
                                        bias=False)
        self.tp_group, self.sequence_parallel = tp_group, sp
        self.attn_pdrop, self.resid_pdrop = cfg.attn_pdrop, cfg.resid_pdrop
        self.tp_region, self.residual_region = tp_region, residual_region
        self.kernel, self.kernel_region = attention, kernel_region(attention)
        self.cp = cp
        device = torch.empty(0).device  # the device the stage is being built on
        if inv_freq is None:
            inv_freq = inverse_frequencies(cfg)
        self.register_buffer("inv_freq", inv_freq.to(device), persistent=False)
        self.weight_grad_queue = None  # zero-bubble schedules: W deferred (parallel.tensor)

    def _heads(self, t: torch.Tensor, heads: int) -> torch.Tensor:
        s, b = t.shape[:2]
        return t.view(s, b, heads, self.head_dim).permute(1, 2, 0, 3)  # [b, heads, s, d]

    def head_norms(self, q: torch.Tensor, k: torch.Tensor):
        """q and k [b, heads, s, d] before RoPE: as they are (Qwen3 normalises each head)."""
        return q, k

    def forward(self, x: torch.Tensor, attn: Optional[AttentionInputs] = None) -> torch.Tensor:
        q, k, v = column_parallel_linears(
            x, [self.q_proj.weight, self.k_proj.weight, self.v_proj.weight], self.tp_group,
            self.sequence_parallel, self.weight_grad_queue)
        s, b = q.shape[:2]
        positions = token_positions(s, self.cp, self.inv_freq.device) \
            if attn is None or attn.positions is None else attn.positions
        cos, sin = cos_sin(self.inv_freq, positions, q.dtype)
        q, k = self.head_norms(self._heads(q, self.heads), self._heads(k, self.kv_heads))
        q, k = apply_rotary(q, cos, sin), apply_rotary(k, cos, sin)
        v = self._heads(v, self.kv_heads)
        p = self.attn_pdrop if self.training else 0.0
        with self.tp_region() if p > 0 else contextlib.nullcontext(), self.kernel_region():
            if attn is not None and attn.ids is not None:
                y = document_attention(q, k, v, attn, p, self.kernel, self.cp)
            else:
                y = causal_attention(q, k, v, p, self.cp)
        y = self.o_proj(y.permute(2, 0, 1, 3).reshape(s, b, self.heads * self.head_dim))
        return dropout(y, self.resid_pdrop, self.training, self.residual_region)


class LlamaMLP(nn.Module):
    def __init__(self, cfg: ModelConfig, tp_group: Group, sp: bool,
                 residual_region: RegionFactory):
        super().__init__()
        self.gate_up_proj = ColumnParallelLinear(cfg.n_embd, 2 * cfg.ffn_size, tp_group, sp,
                                                 bias=False)  # this rank's [gate_r | up_r]
        self.down_proj = RowParallelLinear(cfg.ffn_size, cfg.n_embd, tp_group, sp, bias=False)
        self.resid_pdrop, self.residual_region = cfg.resid_pdrop, residual_region

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        gate, up = self.gate_up_proj(x).chunk(2, dim=-1)
        y = self.down_proj(F.silu(gate) * up)
        return dropout(y, self.resid_pdrop, self.training, self.residual_region)


class LlamaBlock(nn.Module):
    attention_class = LlamaAttention  # the block's attention module (Qwen3's: with q/k norms)

    def __init__(self, cfg: ModelConfig, tp_group: Group, sp: bool, tp_region: RegionFactory,
                 residual_region: RegionFactory, attention: str = "auto",
                 cp: Optional[ContextParallel] = None, inv_freq: Optional[torch.Tensor] = None):
        super().__init__()
        eps = cfg.layer_norm_epsilon
        self.input_layernorm = RMSNorm(cfg.n_embd, eps)
        self.self_attn = self.attention_class(cfg, tp_group, sp, tp_region, residual_region,
                                              attention, cp, inv_freq)
        self.post_attention_layernorm = RMSNorm(cfg.n_embd, eps)
        self.mlp = LlamaMLP(cfg, tp_group, sp, residual_region)

    def forward(self, x: torch.Tensor, attn: Optional[AttentionInputs] = None) -> torch.Tensor:
        x = x + self.self_attn(self.input_layernorm(x), attn)
        return x + self.mlp(self.post_attention_layernorm(x))


class Llama(CausalLM):
    """One pipeline stage of a Llama (the whole model with the defaults: tp = pp = 1). The
    first stage holds `model.embed_tokens`, every stage its blocks `model.layers.<i>`, the last
    `model.norm` and the LM head (`lm_head`)."""

    family = LLAMA_FAMILY
    block_class = LlamaBlock  # a variant's block (Qwen3's: its q/k norms)

    @classmethod
    def make_block(cls, cfg: ModelConfig, tp_group: Group, sp: bool, tp_region: RegionFactory,
                   residual_region: RegionFactory, attention: str = "auto",
                   cp: Optional[ContextParallel] = None,
                   inv_freq: Optional[torch.Tensor] = None) -> nn.Module:
        return cls.block_class(cfg, tp_group, sp, tp_region, residual_region, attention, cp,
                               inv_freq)

    def build(self, attention: str) -> None:
        cfg, sp, tp_group = self.cfg, self.sequence_parallel, self.tp_group
        self.model = nn.Module()
        if self.first:
            self.model.embed_tokens = VocabParallelEmbedding(self.padded_vocab, cfg.n_embd,
                                                             tp_group, sp)
        inv_freq = inverse_frequencies(cfg)  # one table for the stage's blocks
        self.model.layers = nn.ModuleDict(
            {str(i): self.block_at(i, attention, inv_freq) for i in self.blocks})
        if self.last:
            self.model.norm = RMSNorm(cfg.n_embd, cfg.layer_norm_epsilon)

    def block_at(self, index: int, attention: str, inv_freq: torch.Tensor) -> nn.Module:
        """Block `index` of the stage (sharing the stage's rotary table `inv_freq`)."""
        return self.make_block(self.cfg, self.tp_group, self.sequence_parallel, self.tp_region,
                               self.residual_region, attention, self.cp, inv_freq)

    def block_list(self) -> List[nn.Module]:
        return list(self.model.layers.values())

    def final_norm(self) -> nn.Module:
        return self.model.norm

    def token_embedding(self) -> nn.Module:
        return self.model.embed_tokens

    def sharding_units(self) -> List[nn.Module]:
        """The modules ZeRO-3 gathers one at a time, in forward order."""
        units = [self.model.embed_tokens] if self.first else []
        units += self.block_list()
        if self.last:
            units += [self.model.norm, self.lm_head]
        return units

    def embed(self, ids: torch.Tensor, positions: Optional[torch.Tensor] = None
              ) -> torch.Tensor:
        """[b, s] token ids -> [s, b, h] (or this rank's [s/tp, b, h] with SP); positions are
        RoPE's, applied in attention."""
        self.check_length(ids.shape[1])
        x = self.model.embed_tokens(ids.t())
        return dropout(x, self.cfg.embd_pdrop, self.training, self.residual_region)
