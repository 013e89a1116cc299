"""The router: a token's scores over the experts and the k it is sent to, in fp32.

    logits = x · Wᵀ (fp32)                                  [T, E]
    softmax: scores = softmax(logits)          (Mixtral, Qwen3-MoE, OLMoE)
    sigmoid: scores = sigmoid(logits)          (DeepSeek-V3)
    choice  = scores + bias                    (the selection bias, where the router has one)
    group-limited (n_groups > 1): a group's rank is the sum of its top-2 choice scores; only
        the top_groups best groups' experts may be chosen (DeepSeek-V3's n_group / topk_group)
    indices = top-k of choice;  weights = scores at indices (the bias never weighs)
    normalize_top_k: weights /= their sum (sigmoid: + 1e-20, as DeepSeek-V3);  × scaling_factor

transformers' MixtralTopKRouter and DeepseekV3TopkRouter compute the same (tests compare
choices and weights). The bias is a buffer (`e_score_correction_bias`, DeepSeek-V3's name)
updated once per optimizer step (`megalite.model.moe.step`), never by the optimizer.
"""
from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn as nn
import torch.nn.functional as F

from megalite.config.moe import MoEConfig


@dataclass
class Routing:
    """One micro-batch's routing: fp32 logits and scores [T, E], the chosen experts and their
    weights [T, k] (indices in top-k order)."""

    logits: torch.Tensor
    scores: torch.Tensor
    indices: torch.Tensor
    weights: torch.Tensor


class Router(nn.Module):
    """`weight` [E, h] (transformers' `mlp.gate.weight`); `e_score_correction_bias` [E] fp32
    where `moe.has_bias`."""

    def __init__(self, moe: MoEConfig, hidden: int):
        super().__init__()
        self.moe = moe
        self.weight = nn.Parameter(torch.empty(moe.num_experts, hidden))
        if moe.has_bias:
            self.register_buffer("e_score_correction_bias",
                                 torch.zeros(moe.num_experts, dtype=torch.float32))
        else:
            self.e_score_correction_bias = None

    def forward(self, x: torch.Tensor) -> Routing:
        """x [T, h] -> the routing."""
        logits = F.linear(x.float(), self.weight.float())
        return route(logits, self.moe, self.e_score_correction_bias)


def route(logits: torch.Tensor, moe: MoEConfig, bias=None) -> Routing:
    """The routing of fp32 router logits [T, E] (module docstring)."""
    scores = logits.softmax(-1) if moe.score == "softmax" else logits.sigmoid()
    choice = scores if bias is None else scores + bias
    if moe.n_groups > 1:
        choice = group_limited(choice, moe.n_groups, moe.top_groups)
    indices = choice.topk(moe.top_k, dim=-1).indices
    weights = scores.gather(1, indices)
    if moe.normalize_top_k:
        total = weights.sum(-1, keepdim=True)
        weights = weights / (total + 1e-20 if moe.score == "sigmoid" else total)
    if moe.scaling_factor != 1.0:
        weights = weights * moe.scaling_factor
    return Routing(logits, scores, indices, weights)


def group_limited(choice: torch.Tensor, n_groups: int, top_groups: int) -> torch.Tensor:
    """`choice` [T, E] with the experts outside each token's `top_groups` best groups (by the
    sum of a group's top-2 choice scores) set to -inf."""
    t, e = choice.shape
    grouped = choice.view(t, n_groups, e // n_groups)
    group_scores = grouped.topk(2, dim=-1).values.sum(-1)  # [T, groups]
    best = group_scores.topk(top_groups, dim=-1).indices
    keep = torch.zeros_like(group_scores, dtype=torch.bool).scatter_(1, best, True)
    return grouped.masked_fill(~keep[..., None], float("-inf")).view(t, e)
