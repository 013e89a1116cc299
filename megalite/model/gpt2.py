"""GPT-2, architecturally identical to `transformers.GPT2LMHeadModel` (Radford et al. 2019).

Learned absolute positions, pre-LayerNorm blocks, tanh-approximated GELU, causal attention via
`scaled_dot_product_attention`, final LayerNorm, LM head tied to the token embedding. Dropout
sits where HF puts it: after the embedding sum (embd_pdrop), on the attention probabilities
(attn_pdrop), after each residual branch (resid_pdrop).

Parameter names follow HF (`transformer.h.3.attn.c_attn.weight`, ...) so that `megalite.model.hf`
is a transpose-only mapping: HF stores Conv1D weights as [in, out], we use nn.Linear [out, in].

Init (GPT-2 paper §2.3, as in HF `_init_weights`): weights N(0, 0.02), biases 0, LayerNorm (1, 0),
and the residual output projections (`attn.c_proj`, `mlp.c_proj`) N(0, 0.02 / sqrt(2 n_layer)) so
the residual stream's variance does not grow with depth.
"""
from __future__ import annotations

import math
from typing import Optional

import torch
import torch.nn as nn
import torch.nn.functional as F

from megalite.config import ModelConfig


class CausalSelfAttention(nn.Module):
    def __init__(self, cfg: ModelConfig):
        super().__init__()
        self.n_head = cfg.n_head
        self.head_dim = cfg.n_embd // cfg.n_head
        self.c_attn = nn.Linear(cfg.n_embd, 3 * cfg.n_embd)  # fused [q | k | v]
        self.c_proj = nn.Linear(cfg.n_embd, cfg.n_embd)
        self.attn_pdrop = cfg.attn_pdrop
        self.resid_dropout = nn.Dropout(cfg.resid_pdrop)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        b, s, h = x.shape
        q, k, v = self.c_attn(x).split(h, dim=-1)
        q, k, v = (t.view(b, s, self.n_head, self.head_dim).transpose(1, 2) for t in (q, k, v))
        y = F.scaled_dot_product_attention(
            q, k, v, dropout_p=self.attn_pdrop if self.training else 0.0, is_causal=True)
        y = y.transpose(1, 2).reshape(b, s, h)
        return self.resid_dropout(self.c_proj(y))


class MLP(nn.Module):
    def __init__(self, cfg: ModelConfig):
        super().__init__()
        self.c_fc = nn.Linear(cfg.n_embd, cfg.ffn_size)
        self.c_proj = nn.Linear(cfg.ffn_size, cfg.n_embd)
        self.dropout = nn.Dropout(cfg.resid_pdrop)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.dropout(self.c_proj(F.gelu(self.c_fc(x), approximate="tanh")))


class Block(nn.Module):
    def __init__(self, cfg: ModelConfig):
        super().__init__()
        self.ln_1 = nn.LayerNorm(cfg.n_embd, eps=cfg.layer_norm_epsilon)
        self.attn = CausalSelfAttention(cfg)
        self.ln_2 = nn.LayerNorm(cfg.n_embd, eps=cfg.layer_norm_epsilon)
        self.mlp = MLP(cfg)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = x + self.attn(self.ln_1(x))
        return x + self.mlp(self.ln_2(x))


class Transformer(nn.Module):
    def __init__(self, cfg: ModelConfig):
        super().__init__()
        self.wte = nn.Embedding(cfg.vocab_size, cfg.n_embd)
        self.wpe = nn.Embedding(cfg.n_positions, cfg.n_embd)
        self.drop = nn.Dropout(cfg.embd_pdrop)
        self.h = nn.ModuleList(Block(cfg) for _ in range(cfg.n_layer))
        self.ln_f = nn.LayerNorm(cfg.n_embd, eps=cfg.layer_norm_epsilon)


class GPT2(nn.Module):
    """GPT-2 LM. `forward(input_ids, labels)` returns the mean token cross-entropy."""

    def __init__(self, cfg: ModelConfig):
        super().__init__()
        self.cfg = cfg
        self.transformer = Transformer(cfg)
        self.lm_head = nn.Linear(cfg.n_embd, cfg.vocab_size, bias=False)
        self.lm_head.weight = self.transformer.wte.weight  # tied input/output embedding
        self.reset_parameters()

    @torch.no_grad()
    def reset_parameters(self) -> None:
        std = self.cfg.initializer_range
        residual_std = std / math.sqrt(2 * self.cfg.n_layer)
        for name, module in self.named_modules():
            if isinstance(module, nn.Linear):
                is_residual_out = name.endswith("c_proj")
                module.weight.normal_(0.0, residual_std if is_residual_out else std)
                if module.bias is not None:
                    module.bias.zero_()
            elif isinstance(module, nn.Embedding):
                module.weight.normal_(0.0, std)
            elif isinstance(module, nn.LayerNorm):
                module.weight.fill_(1.0)
                module.bias.zero_()

    def hidden_states(self, input_ids: torch.Tensor) -> torch.Tensor:
        t = self.transformer
        s = input_ids.shape[1]
        if s > self.cfg.n_positions:
            raise ValueError(f"sequence length {s} > model.n_positions={self.cfg.n_positions}")
        pos = torch.arange(s, device=input_ids.device)
        x = t.drop(t.wte(input_ids) + t.wpe(pos))
        for block in t.h:
            x = block(x)
        return t.ln_f(x)

    def forward(self, input_ids: torch.Tensor, labels: Optional[torch.Tensor] = None
                ) -> torch.Tensor:
        """Logits [b, s, vocab] without labels; mean cross-entropy over all tokens with them."""
        logits = self.lm_head(self.hidden_states(input_ids))
        if labels is None:
            return logits
        return F.cross_entropy(logits.float().view(-1, logits.shape[-1]), labels.reshape(-1))


def count_parameters(model: nn.Module) -> int:
    """Unique parameters (the tied embedding counted once)."""
    return sum(p.numel() for p in {id(p): p for p in model.parameters()}.values())


def flops_per_token(cfg: ModelConfig, seq_len: int) -> int:
    """Training FLOPs per token: 6N + 12·L·h·s (Kaplan et al. 2020; Chowdhery et al. 2022, App. B).

    N = parameters that take part in matmuls or elementwise ops per token: every parameter except
    the position embedding (a lookup), the token embedding counted once as the LM-head matmul.
    6N = forward (2N) + backward (4N); 12·L·h·s = the attention score and value matmuls
    (QK^T and AV, forward + backward) not covered by N.
    """
    h, L, f, v = cfg.n_embd, cfg.n_layer, cfg.ffn_size, cfg.vocab_size
    block = 4 * h + (h * 3 * h + 3 * h) + (h * h + h) + (h * f + f) + (f * h + h)
    n = L * block + 2 * h + v * h
    return 6 * n + 12 * L * h * seq_len
