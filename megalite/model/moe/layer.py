"""The MoE layer that replaces a block's MLP: [s, b, h] -> [s, b, h] ([s/tp, b, h] under
sequence parallelism).

    routing = gate(x)                                   (`router`, fp32, this rank's tokens)
    X, routing = gathered over TP                       (`tokens`: under SP, all s·b tokens)
    y = experts(X, routing)                             (`experts`: dispatch, SwiGLUs, combine;
                                                         over EP ranks: `dispatcher`)
      + shared_experts(X) [· sigmoid(shared_experts_gate(X))]   (where configured)
    y = reduce-scattered over TP                        (the TP ranks' partial outputs summed)

TP splits each expert's SwiGLU and the shared experts' as the dense MLP's (gate and up by
rows, each block split, down by columns); the router and the shared experts' gate are
replicated (their gradients summed over TP with the norms'). EP (any cp and pp, each stage its
own EP group) holds num_experts / ep of the experts and exchanges each rank's own tokens
(under CP its two chunks of every sequence; `megalite.model.moe.dispatcher`). EP folded over
TP ranks (tp > 1, SP; Megatron-Core's MoE parallel folding with expert TP = 1, as torchtitan):
the routed experts are whole on each rank and run on the rank's own s/tp positions, exchanged
over EP, not gathered over TP; only the chosen experts are gathered (the balancing's counts
of the micro-batch), and the shared experts stay TP-split:

    y = dispatcher(experts, x_own, routing_own)
      + reduce_scatter_TP(shared_experts(all_gather_TP(x)) [· gate])

Parameter names are transformers 5's (`mlp.gate.weight`, `mlp.experts.gate_up_proj`,
`mlp.experts.down_proj`); the shared experts' are `mlp.shared_experts.gate_up_proj.weight`,
`mlp.shared_experts.down_proj.weight` and `mlp.shared_experts_gate.weight`. Each forward
records its routing in the stage's `RoutingLedger` (`ledger`) under the block's index.
"""
from __future__ import annotations

from typing import Optional

import torch
import torch.nn as nn
import torch.nn.functional as F

from megalite.config.moe import MoEConfig
from megalite.model.moe.dispatcher import TokenDispatcher
from megalite.model.moe.experts import Experts, capacity, dispatch
from megalite.model.moe.ledger import RoutingLedger
from megalite.model.moe.router import Router
from megalite.model.moe.tokens import NO_SPLIT, TokenSplit


class SharedExperts(nn.Module):
    """The shared experts: one dense SwiGLU of their joint hidden size, split over TP like the
    dense MLP ([gate_r | up_r] rows, down's columns): a TP rank computes a partial output, its
    communication the layer's (`TokenSplit`)."""

    def __init__(self, hidden: int, inner: int):
        super().__init__()
        self.gate_up_proj = nn.Linear(hidden, 2 * inner, bias=False)
        self.down_proj = nn.Linear(inner, hidden, bias=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        gate, up = self.gate_up_proj(x).chunk(2, dim=-1)
        return self.down_proj(F.silu(gate) * up)


class MoELayer(nn.Module):
    """Block `index`'s MoE layer of `moe` on h = `hidden` (module docstring); `tp` the TP size
    its experts are split over and `split` how its tokens are (`megalite.model.moe.tokens`)."""

    def __init__(self, moe: MoEConfig, hidden: int, n_inner: int, index: int,
                 ledger: Optional[RoutingLedger] = None, tp: int = 1,
                 split: TokenSplit = NO_SPLIT, dispatcher: Optional[TokenDispatcher] = None):
        """`dispatcher`: expert parallelism's token exchange (this layer then holds
        num_experts / ep of the experts); None: every expert here."""
        super().__init__()
        if tp != split.tp_size:
            raise ValueError(f"an MoE layer with tp={tp} needs its tokens split over TP "
                             "(sequence parallelism)")
        self.moe, self.index, self.ledger, self.split = moe, index, ledger, split
        self.dispatcher = dispatcher
        self.gate = Router(moe, hidden)
        # EP folded over TP (expert TP = 1): each expert whole, the rank's own tokens
        self.folded = dispatcher is not None and split.tp is not None
        self.experts = Experts(moe, hidden, moe.expert_hidden(n_inner) // (
            1 if self.folded else tp), split, 1 if dispatcher is None else dispatcher.size)
        if moe.shared_experts:
            self.shared_experts = SharedExperts(hidden, moe.shared_hidden(n_inner) // tp)
            if moe.shared_expert_gate:
                self.shared_experts_gate = nn.Linear(hidden, 1, bias=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.folded:
            return self._folded(x)
        s, b, h = x.shape
        routing = self.gate(x.reshape(s * b, h))
        # TP: every TP rank's tokens and routing (the micro-batch's where cp = 1)
        xs, chosen, weights = self.split.gather(x, routing.indices, routing.weights)
        flat = xs.reshape(-1, h)
        d = dispatch(chosen, weights, self.moe.num_experts,
                     capacity(self.moe, flat.shape[0]), self.moe.drop_policy)
        if self.dispatcher is None:
            y = self.experts(flat, weights, d)
        else:  # ep > 1, tp = 1: this rank's own tokens (its CP chunks under cp > 1)
            y = self.dispatcher(self.experts, flat, weights, chosen, d)
        if self.moe.shared_experts:
            y = y + self._shared(flat)
        if self.ledger is not None:
            self.ledger.record(self.index, routing, d, b, self.split, chosen)
        return self.split.scatter(y.view(xs.shape))

    def _folded(self, x: torch.Tensor) -> torch.Tensor:
        """EP folded over TP (module docstring): the routed experts on this rank's own tokens
        over EP, the shared experts over the TP-gathered ones."""
        s, b, h = x.shape
        flat = x.reshape(s * b, h)
        routing = self.gate(flat)
        d = dispatch(routing.indices, routing.weights, self.moe.num_experts,
                     capacity(self.moe, flat.shape[0]), self.moe.drop_policy)
        y = self.dispatcher(self.experts, flat, routing.weights, routing.indices, d)
        if self.moe.shared_experts:
            xs = self.split.gather_tokens(x)
            y = y + self.split.scatter(self._shared(xs.reshape(-1, h)).view(xs.shape)
                                       ).reshape(s * b, h)
        if self.ledger is not None:  # the counts of the micro-batch: the TP ranks' choices
            self.ledger.record(self.index, routing, d, b, self.split,
                               self.split.gather_indices(routing.indices, s, b),
                               own_dispatch=True)
        return y.view(s, b, h)

    def _shared(self, flat: torch.Tensor) -> torch.Tensor:
        shared = self.shared_experts(flat)
        if self.moe.shared_expert_gate:
            shared = torch.sigmoid(self.shared_experts_gate(flat)) * shared
        return shared
