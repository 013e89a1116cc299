"""What a stage's MoE layers record while it runs: the balancing penalty of a forward (added to
the objective, never to the logged loss) and the step's routing figures (the counts that
update the bias, the aux and z-loss values, the drops), per MoE layer.

A stage (`megalite.model.causal_lm.CausalLM`) opens the ledger at the start of a training
forward and closes it at the end; its MoE layers `record` in between. A forward that is not
training (evaluation, generation) records nothing. A recomputed block's re-run in backward
(train.recompute) records as its forward did, into scratch that is then dropped (`rerun`): the
same operations run — torch's non-reentrant checkpoint matches the tensors the re-run saves
with the forward's one by one, and the penalty's backward reads the re-run's — and nothing
is counted twice.
`close` returns the forward's penalty: Σ_layers coeff · aux + z_coeff · z-loss, or with
aux_loss=hf coeff · the pooled value of the forward's layers (transformers' value of one
forward), with z_coeff · z-loss per layer. The last stage adds it to the loss's gradient, not to
its value (`with_penalty`): the gradient of loss + penalty, the value of the loss, so the logged
loss stays the language model's cross-entropy. A stage without the LM head has no loss to carry
it: its output does (`with_scaled_penalty`, Megatron's MoEAuxLossAutoScaler), the output's
backward also sending the penalty the gradient the loss's scaling would give it on the last
stage (the objective's weight of a micro-batch: 1 / micro-batches × the fp16 loss scale, which
the pipeline schedule sets for the step). Both join the penalty's graph to the stage's output,
so one backward reaches the routers' weights and, through them, the earlier layers' inputs,
whether the backward runs whole or split in B and W (zero-bubble schedules: the routers'
weight gradients are computed in B, the split linears' in W, as for the rest of the block).

The step figures (`StepFigures`, one row per MoE layer of the stage) add up over the step's
forwards until `megalite.model.moe.step` reads and clears them after the step.

Where a micro-batch's tokens are split over ranks (TP under sequence parallelism, CP:
`megalite.model.moe.tokens`), a rank's penalty and figures are its own tokens' part of the
micro-batch's (computed with the micro-batch's counts), and `step` sums the parts.
"""
from __future__ import annotations

import contextlib
from dataclasses import dataclass
from typing import Iterator, List, Optional

import torch

from megalite.config.moe import MoEConfig
from megalite.model.moe import balance
from megalite.model.moe.experts import Dispatch
from megalite.model.moe.router import Routing
from megalite.model.moe.tokens import NO_SPLIT, TokenSplit


@dataclass
class StepFigures:
    """Sums over the step's training forwards, one row per MoE layer of the stage; each of
    this rank's tokens' part where TP (SP) or CP split a micro-batch's tokens."""

    counts: torch.Tensor  # [L, E] assignments the router chose (fp64)
    aux: torch.Tensor  # [L] the layer aux value (E·Σ f·P) summed over forwards
    z: torch.Tensor  # [L] the z-loss summed over forwards
    dropped: torch.Tensor  # [L] assignments over capacity
    assigned: torch.Tensor  # [L] assignments (T·k)
    pooled: torch.Tensor  # [1] aux_loss=hf: the pooled value summed over forwards
    forwards: int = 0


class WithPenalty(torch.autograd.Function):
    """loss's value; the gradient flows to loss and to penalty alike."""

    @staticmethod
    def forward(ctx, loss, penalty):
        return loss.clone()

    @staticmethod
    def backward(ctx, grad):
        return grad, grad


def with_penalty(loss: torch.Tensor, penalty: Optional[torch.Tensor]) -> torch.Tensor:
    """`loss` whose backward also runs `penalty`'s (its value unchanged)."""
    if penalty is None:
        return loss
    return WithPenalty.apply(loss, penalty.to(loss.dtype))


class WithScaledPenalty(torch.autograd.Function):
    """x's value (a new tensor on x's storage: the pipeline may free the sent output's data);
    the gradient flows to x, and `scale` flows to penalty."""

    @staticmethod
    def forward(ctx, x, penalty, scale: float):
        ctx.scale, ctx.penalty_like = scale, (penalty.dtype, penalty.device)
        return x.detach()

    @staticmethod
    def backward(ctx, grad):
        dtype, device = ctx.penalty_like
        return grad, torch.full((), ctx.scale, dtype=dtype, device=device), None


def with_scaled_penalty(x: torch.Tensor, penalty: Optional[torch.Tensor],
                        scale: float) -> torch.Tensor:
    """`x` (a stage's output) whose backward also runs `penalty`'s with gradient `scale`."""
    if penalty is None:
        return x
    return WithScaledPenalty.apply(x, penalty, scale)


class RoutingLedger:
    """The ledger of one stage's MoE layers `layers` (global block indices)."""

    def __init__(self, moe: MoEConfig, layers: List[int]):
        self.moe, self.layers = moe, list(layers)
        self.row = {layer: i for i, layer in enumerate(self.layers)}
        self._open = False
        self._terms: List[torch.Tensor] = []
        self._pooled: List[tuple] = []
        self.figures: Optional[StepFigures] = None
        self.split = NO_SPLIT  # how the recorded forwards' tokens were split (tokens.py)

    def _figures(self, device: torch.device) -> StepFigures:
        if self.figures is None:
            n, e = len(self.layers), self.moe.num_experts

            def zeros(*shape):
                return torch.zeros(*shape, dtype=torch.float64, device=device)

            self.figures = StepFigures(zeros(n, e), zeros(n), zeros(n), zeros(n), zeros(n),
                                       zeros(1))
        return self.figures

    def clear(self) -> None:
        """Forget the step's figures (a new step, or its re-execution)."""
        self.figures = None

    def open(self, training: bool) -> None:
        self._open, self._terms, self._pooled = training, [], []

    @contextlib.contextmanager
    def rerun(self) -> Iterator[None]:
        """A recomputed block's re-run in backward: `record` runs as in a training forward,
        into terms and figures dropped afterwards (the forward recorded them)."""
        kept = self._open, self._terms, self._pooled, self.figures
        self._open, self._terms, self._pooled, self.figures = True, [], [], None
        try:
            yield
        finally:
            self._open, self._terms, self._pooled, self.figures = kept

    def record(self, layer: int, routing: Routing, d: Dispatch, batch: int,
               split: TokenSplit = NO_SPLIT, chosen: Optional[torch.Tensor] = None,
               own_dispatch: bool = False) -> None:
        """Layer `layer`'s routing of a forward's tokens (`batch` sequences): `routing` this
        rank's tokens', `chosen` [T, k] the experts chosen for the TP ranks' tokens together
        (`split.gather`; None: this rank's, `routing.indices`) and `d` their dispatch
        (`own_dispatch`: of this rank's tokens only, EP folded over TP). The penalty and the
        figures are this rank's part of the micro-batch's (`tokens`)."""
        if not self._open:
            return
        moe, figures = self.moe, self._figures(routing.logits.device)
        self.split = split
        chosen = routing.indices if chosen is None else chosen
        # the micro-batch's assignments per sequence and expert (CP: every chunk's)
        counts = split.sum_over_cp(balance.sequence_counts(chosen, batch, moe.num_experts))
        tokens = chosen.shape[0] * split.cp_size
        weighed = moe.aux_loss_coeff > 0  # the aux loss (layer, sequence or hf) is weighed
        with torch.set_grad_enabled(torch.is_grad_enabled() and (weighed or moe.z_loss_coeff > 0)):
            probs = split.grad_times_cp(balance.balance_probs(routing, moe.score))
            aux = balance.layer_aux(probs, counts.sum(0), moe.top_k, tokens)
            z = balance.z_loss(split.grad_times_cp(routing.logits), tokens)
        if weighed and moe.aux_loss != "hf":
            value = aux if moe.aux_loss == "layer" else \
                balance.sequence_aux(probs, counts, moe.top_k, tokens // batch)
            self._terms.append(moe.aux_loss_coeff * value)
        if moe.z_loss_coeff > 0:
            self._terms.append(moe.z_loss_coeff * z)
        if moe.aux_loss == "hf":  # softmax scores: probs are the softmax of the logits
            self._pooled.append((counts.sum(0), probs.sum(0), tokens))
        i = self.row[layer]
        own = routing.indices.numel()
        figures.counts[i] += (d.routed if split.tp is None or own_dispatch  # this rank's tokens'
                              else balance.expert_counts(routing.indices, moe.num_experts)
                              ).double()
        figures.aux[i] += aux.detach().double()
        figures.z[i] += z.detach().double()
        if moe.capacity_factor is not None:  # this rank's tokens' assignments over capacity
            kept = d.order.new_tensor(d.order.numel()) if own_dispatch else split.own(
                torch.div(d.order, moe.top_k, rounding_mode="floor"),
                routing.indices.shape[0]).sum()
            figures.dropped[i] += (own - kept).double()
        figures.assigned[i] += own  # a host int: no copy to the device

    def close(self) -> Optional[torch.Tensor]:
        """End of a forward: its penalty (None when nothing is weighed)."""
        if not self._open:
            return None
        self._open = False
        terms = self._terms
        if self._pooled:
            routed = sum(r for r, _, _ in self._pooled)
            probs = sum(p for _, p, _ in self._pooled)
            value = balance.pooled_aux(routed.to(probs.dtype), probs,
                                       sum(n for _, _, n in self._pooled))
            self.figures.pooled += value.detach().double()
            if self.moe.aux_loss_coeff > 0:
                terms = terms + [self.moe.aux_loss_coeff * value]
        if self.figures is not None:
            self.figures.forwards += 1
        self._terms, self._pooled = [], []
        return sum(terms) if terms else None
