"""How a micro-batch's tokens are split over the ranks an MoE layer runs on, and the
collectives that give the layer the routing of the whole micro-batch.

    TP (sequence parallelism; MoE with tp > 1 needs sp): TP rank r holds the positions
        [r·s/tp, (r+1)·s/tp) of its tokens, [s/tp, b, h]. The router runs on them (fp32); the
        experts, split over TP like the dense MLP, run on all s·b tokens: the tokens, the
        chosen experts (no gradient) and the combine weights are all-gathered over TP (their
        backward reduce-scatters: each TP rank's experts give a partial dL/dw, summed), the
        experts' partial outputs reduce-scattered back to the rank's own tokens (Megatron's
        all-gather token dispatcher does the same).
    CP: each CP rank holds two chunks of every sequence; experts are per token, so only the
        balancing reads the other CP ranks' tokens: the micro-batch's expert counts are
        all-reduced over CP (no gradient), once per MoE layer and training forward.

Balancing over split tokens (ARCHITECTURE.md section 15; Megatron's aux loss over its tp_cp
group): the penalty of a micro-batch is a sum over its tokens of terms that need only the
micro-batch's counts (E·Σ_e f_e·Σ_t p_te / T, Σ_t logsumexp² / T, ...). Each rank computes
the part of its own tokens with the micro-batch's counts and T, so the parts of the TP × CP
ranks add up to the serial value. The gradients of the router weight are summed over TP (a
TP-replicated parameter under SP, `megalite.parallel.grad_sums.sum_tp_replicated`) and averaged
over DP × CP, while each CP rank's cross-entropy is the mean over its own tokens (cp times its
part of the serial mean): so a rank's penalty gradient is taken `cp` times (`grad_times`), its
value kept (the value is logged, never added to the loss).
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Optional, Tuple

import torch

from megalite.parallel import comm, regions
from megalite.parallel.group import Group


class _GradTimes(torch.autograd.Function):
    """x's value; n times its gradient."""

    @staticmethod
    def forward(ctx, x, n: int):
        ctx.n = n
        return x.view_as(x)

    @staticmethod
    def backward(ctx, grad):
        return grad * ctx.n, None


@dataclass(frozen=True)
class TokenSplit:
    """`tp`: the TP group when sequence parallelism splits the tokens over it (None: every
    TP rank holds them all, or tp = 1); `cp`: the CP group (None: cp = 1)."""

    tp: Optional[Group] = None
    cp: Optional[Group] = None

    @classmethod
    def of(cls, tp_group: Optional[Group], sp: bool, cp_group: Optional[Group]) -> "TokenSplit":
        return cls(tp_group if sp and tp_group is not None and tp_group.size > 1 else None,
                   cp_group if cp_group is not None and cp_group.size > 1 else None)

    @property
    def tp_size(self) -> int:
        return 1 if self.tp is None else self.tp.size

    @property
    def cp_size(self) -> int:
        return 1 if self.cp is None else self.cp.size

    @property
    def ranks(self) -> int:
        """The ranks one micro-batch's tokens are split over (each with its own part)."""
        return self.tp_size * self.cp_size

    def gather(self, x: torch.Tensor, indices: torch.Tensor, weights: torch.Tensor
               ) -> Tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """This rank's tokens x [s', b, h] and their routing (indices, weights [s'·b, k]) ->
        those of every TP rank's tokens, [s'·tp, b, h] and [s'·tp·b, k] in position-major
        order (the serial order where cp = 1). Backward: x's and the weights' gradients
        reduce-scattered (summed over TP, each rank its own tokens')."""
        if self.tp is None:
            return x, indices, weights
        s, b = x.shape[:2]
        k = indices.shape[-1]
        x, indices = self.gather_tokens(x), self.gather_indices(indices, s, b)
        weights = regions.gather_from_seq(weights.view(s, b, k), self.tp).view(-1, k)
        return x, indices, weights

    def gather_tokens(self, x: torch.Tensor) -> torch.Tensor:
        """This rank's tokens [s', b, h] -> every TP rank's, [s'·tp, b, h] (backward: the
        gradient reduce-scattered)."""
        return x if self.tp is None else regions.gather_from_seq(x, self.tp)

    def gather_indices(self, indices: torch.Tensor, s: int, b: int) -> torch.Tensor:
        """The chosen experts [s·b, k] of this rank's tokens ([s, b] of them) -> every TP
        rank's, [s·tp·b, k] position-major (no gradient)."""
        if self.tp is None:
            return indices
        k = indices.shape[-1]
        return comm.gather_seq(indices.view(s, b, k), self.tp).view(-1, k)

    def scatter(self, y: torch.Tensor) -> torch.Tensor:
        """The TP ranks' partial outputs [s'·tp, b, h] summed, this rank's tokens kept."""
        return y if self.tp is None else regions.reduce_scatter_to_seq(y, self.tp)

    def own(self, tokens: torch.Tensor, local: int) -> torch.Tensor:
        """Which of the gathered token indices `tokens` are this rank's (`local` tokens a
        rank: rows [r·local, (r+1)·local) of the gathered order)."""
        if self.tp is None:
            return torch.ones_like(tokens, dtype=torch.bool)
        lo = self.tp.rank * local
        return (tokens >= lo) & (tokens < lo + local)

    def sum_over_cp(self, t: torch.Tensor) -> torch.Tensor:
        """`t` (no gradient) summed over the CP ranks, in place."""
        if self.cp is not None:
            comm.all_reduce(t, self.cp)
        return t

    def grad_times_cp(self, x: torch.Tensor) -> torch.Tensor:
        """x whose gradient is taken cp times (module docstring)."""
        return x if self.cp is None else _GradTimes.apply(x, self.cp.size)


NO_SPLIT = TokenSplit()
