"""Balancing losses of one MoE layer's routing of one micro-batch (T tokens, E experts, top k).

    layer     E · Σ_e f_e · P_e,  f_e = assignments to e / (k·T),  P_e = mean_t p_te
              (Switch Transformer; Megatron's aux_loss: 1 when perfectly balanced)
    sequence  the same over each sequence's tokens, averaged over the sequences
              (DeepSeek-V3's complementary sequence-wise loss)
    z-loss    mean_t logsumexp(logits_t)²  (ST-MoE)
    hf        transformers' load_balancing_loss_func: all layers pooled,
              E · Σ_e (Σ_l n_le / (L·T)) · (Σ_l Σ_t softmax(logits)_lte / (L·T)),
              n_le the assignments to e in layer l (k per token: 1 ≠ balanced, k is)

p is the softmax probability (softmax scores) or the score normalised over the experts
(sigmoid scores, as Megatron and DeepSeek-V3); f carries no gradient. The counts are the
router's choices before any capacity drop (Megatron's)."""
from __future__ import annotations

from typing import Optional

import torch

from megalite.model.moe.router import Routing


def balance_probs(routing: Routing, score: str) -> torch.Tensor:
    """[T, E] the probabilities the aux losses weigh (module docstring)."""
    if score == "softmax":
        return routing.scores
    return routing.scores / (routing.scores.sum(-1, keepdim=True) + 1e-20)


def layer_aux(probs: torch.Tensor, routed: torch.Tensor, top_k: int,
              tokens: Optional[int] = None) -> torch.Tensor:
    """E · Σ f·P of one layer; `routed` [E] the assignments per expert of the micro-batch's
    `tokens` tokens (default: the rows of `probs`). `probs` may be a part of those tokens
    (`megalite.model.moe.tokens`): then the value is that part's share of the sum over t."""
    tokens = probs.shape[0] if tokens is None else tokens
    experts = probs.shape[1]
    f = routed.to(probs.dtype) / (top_k * tokens)
    return experts * (f * probs.sum(0)).sum() / tokens


def expert_counts(indices: torch.Tensor, experts: int) -> torch.Tensor:
    """[E] the assignments per expert of `indices` [T, k] (int64; scatter_add, not bincount,
    which reads its range on the host)."""
    flat = indices.reshape(-1)
    return torch.zeros(experts, dtype=torch.long, device=flat.device).scatter_add_(
        0, flat, torch.ones_like(flat))


def sequence_counts(indices: torch.Tensor, batch: int, experts: int) -> torch.Tensor:
    """[batch, E] the assignments per sequence and expert of `indices` [s·batch, k] (tokens
    position-major, [s, b] flattened), fp32."""
    k = indices.shape[1]
    chosen = indices.view(-1, batch, k).transpose(0, 1).reshape(batch, -1)
    counts = torch.zeros(batch, experts, dtype=torch.float32, device=indices.device)
    return counts.scatter_add_(1, chosen, torch.ones_like(chosen, dtype=torch.float32))


def sequence_aux(probs: torch.Tensor, counts: torch.Tensor, top_k: int,
                 seq_len: int) -> torch.Tensor:
    """The layer loss per sequence, averaged over the sequences: `counts` [b, E] each
    sequence's assignments over its `seq_len` tokens, `probs` [s'·b, E] (position-major) of
    s' of them (all, or a part: that part's share)."""
    batch, experts = counts.shape
    f = counts.to(probs.dtype) / (top_k * seq_len)
    p = probs.view(-1, batch, experts).sum(0) / seq_len
    return experts * (f * p).sum(-1).mean()


def z_loss(logits: torch.Tensor, tokens: Optional[int] = None) -> torch.Tensor:
    """Σ_t logsumexp(logits_t)² / tokens (default: the rows; a part's share otherwise)."""
    tokens = logits.shape[0] if tokens is None else tokens
    return torch.logsumexp(logits, dim=-1).square().sum() / tokens


def pooled_aux(routed_sum: torch.Tensor, prob_sum: torch.Tensor, rows: int) -> torch.Tensor:
    """transformers' pooled value of the layers' summed counts and softmax sums over `rows`
    (L·T) rows."""
    return routed_sum.shape[0] * ((routed_sum / rows) * (prob_sum / rows)).sum()
