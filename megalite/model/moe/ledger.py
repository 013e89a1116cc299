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
forward), with z_coeff · z-loss per layer. The stage adds it to the loss's gradient, not to its
value (`with_penalty`): the gradient of loss + penalty, the value of the loss, so the logged
loss stays the language model's cross-entropy.

The step figures (`StepFigures`, one row per MoE layer of the stage) add up over the step's
forwards until `megalite.model.moe.step` reads and clears them after the step.
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


@dataclass
class StepFigures:
    """Sums over the step's training forwards, one row per MoE layer of the stage."""

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


class RoutingLedger:
    """The ledger of one stage's MoE layers `layers` (global block indices)."""

    def __init__(self, moe: MoEConfig, layers: List[int]):
        self.moe, self.layers = moe, list(layers)
        self.row = {layer: i for i, layer in enumerate(self.layers)}
        self._open = False
        self._terms: List[torch.Tensor] = []
        self._pooled: List[tuple] = []
        self.figures: Optional[StepFigures] = None

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

    def record(self, layer: int, routing: Routing, d: Dispatch, batch: int) -> None:
        """Layer `layer`'s routing of a forward's T tokens (`batch` sequences)."""
        if not self._open:
            return
        moe, figures = self.moe, self._figures(routing.logits.device)
        weighed = moe.aux_loss_coeff > 0 and moe.aux_loss != "hf"
        with torch.set_grad_enabled(torch.is_grad_enabled() and (weighed or moe.z_loss_coeff > 0)):
            probs = balance.balance_probs(routing, moe.score)
            aux = balance.layer_aux(probs, d.routed, moe.top_k)
            z = balance.z_loss(routing.logits)
        if weighed:
            value = aux if moe.aux_loss == "layer" else \
                balance.sequence_aux(probs, routing.indices, batch)
            self._terms.append(moe.aux_loss_coeff * value)
        if moe.z_loss_coeff > 0:
            self._terms.append(moe.z_loss_coeff * z)
        if moe.aux_loss == "hf":
            self._pooled.append((d.routed, routing.logits.softmax(-1).sum(0),
                                 routing.logits.shape[0]))
        i = self.row[layer]
        figures.counts[i] += d.routed.double()
        figures.aux[i] += aux.detach().double()
        figures.z[i] += z.detach().double()
        figures.dropped[i] += d.dropped.double()
        figures.assigned[i] += routing.indices.numel()  # a host int: no copy to the device

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
