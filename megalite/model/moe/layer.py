"""The MoE layer that replaces a block's MLP: [s, b, h] -> [s, b, h].

    routing = gate(x)                                   (`router`, fp32)
    y = experts(x, routing)                             (`experts`: dispatch, SwiGLUs, combine;
                                                         over EP ranks: `dispatcher`)
      + shared_experts(x) [· sigmoid(shared_experts_gate(x))]   (where configured)

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


class SharedExperts(nn.Module):
    """The shared experts: one dense SwiGLU of their joint hidden size (no TP split)."""

    def __init__(self, hidden: int, inner: int):
        super().__init__()
        self.gate_up_proj = nn.Linear(hidden, 2 * inner, bias=False)
        self.down_proj = nn.Linear(inner, hidden, bias=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        gate, up = self.gate_up_proj(x).chunk(2, dim=-1)
        return self.down_proj(F.silu(gate) * up)


class MoELayer(nn.Module):
    """Block `index`'s MoE layer of `moe` on h = `hidden` (module docstring)."""

    def __init__(self, moe: MoEConfig, hidden: int, n_inner: int, index: int,
                 ledger: Optional[RoutingLedger] = None,
                 dispatcher: Optional[TokenDispatcher] = None):
        """`dispatcher`: expert parallelism's token exchange (this layer then holds
        num_experts / ep of the experts); None: every expert here."""
        super().__init__()
        self.moe, self.index, self.ledger, self.dispatcher = moe, index, ledger, dispatcher
        self.gate = Router(moe, hidden)
        self.experts = Experts(moe, hidden, moe.expert_hidden(n_inner),
                               1 if dispatcher is None else dispatcher.size)
        if moe.shared_experts:
            self.shared_experts = SharedExperts(hidden, moe.shared_hidden(n_inner))
            if moe.shared_expert_gate:
                self.shared_experts_gate = nn.Linear(hidden, 1, bias=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        s, b, h = x.shape
        flat = x.reshape(s * b, h)
        routing = self.gate(flat)
        d = dispatch(routing.indices, routing.weights, self.moe.num_experts,
                     capacity(self.moe, s * b), self.moe.drop_policy)
        if self.dispatcher is None:
            y = self.experts(flat, routing.weights, d)
        else:
            y = self.dispatcher(self.experts, flat, routing.weights, routing.indices, d)
        if self.moe.shared_experts:
            shared = self.shared_experts(flat)
            if self.moe.shared_expert_gate:
                shared = torch.sigmoid(self.shared_experts_gate(flat)) * shared
            y = y + shared
        if self.ledger is not None:
            self.ledger.record(self.index, routing, d, b)
        return y.view(s, b, h)
