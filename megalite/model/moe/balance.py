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

import torch

from megalite.model.moe.router import Routing


def balance_probs(routing: Routing, score: str) -> torch.Tensor:
    """[T, E] the probabilities the aux losses weigh (module docstring)."""
    if score == "softmax":
        return routing.scores
    return routing.scores / (routing.scores.sum(-1, keepdim=True) + 1e-20)


def layer_aux(probs: torch.Tensor, routed: torch.Tensor, top_k: int) -> torch.Tensor:
    """E · Σ f·P of one layer; `routed` [E] the assignments per expert."""
    tokens, experts = probs.shape
    f = routed.to(probs.dtype) / (top_k * tokens)
    return experts * (f * probs.mean(0)).sum()


def sequence_aux(probs: torch.Tensor, indices: torch.Tensor, batch: int) -> torch.Tensor:
    """The layer loss per sequence, averaged; tokens are position-major ([s, b] flattened)."""
    tokens, experts = probs.shape
    s, k = tokens // batch, indices.shape[1]
    chosen = indices.view(s, batch, k).transpose(0, 1).reshape(batch, s * k)
    counts = torch.zeros(batch, experts, dtype=probs.dtype, device=probs.device)
    counts.scatter_add_(1, chosen, torch.ones_like(chosen, dtype=probs.dtype))
    f = counts / (k * s)
    return experts * (f * probs.view(s, batch, experts).mean(0)).sum(-1).mean()


def z_loss(logits: torch.Tensor) -> torch.Tensor:
    return torch.logsumexp(logits, dim=-1).square().mean()


def pooled_aux(routed_sum: torch.Tensor, prob_sum: torch.Tensor, rows: int) -> torch.Tensor:
    """transformers' pooled value of the layers' summed counts and softmax sums over `rows`
    (L·T) rows."""
    return routed_sum.shape[0] * ((routed_sum / rows) * (prob_sum / rows)).sum()
