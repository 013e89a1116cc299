"""Expert parallelism folded over TP ranks (expert TP = 1), at the layer: ep 2 over tp 2 with
sequence parallelism, the routed experts whole on each rank (E/ep of them) and each rank's own
positions dispatched over EP, the gated shared expert split over TP — outputs, every gradient
(an expert's: the serial expert's, from every rank's tokens; the router's and the shared gate's
summed over TP as the engine sums TP-replicated gradients under SP; the shared experts' the
rank's TP piece) and the figures (counts, aux, z-loss: the ranks' parts summed) equal the
serial layer's, with both dispatchers and each aux loss."""
from __future__ import annotations

import pytest
import torch

from megalite.config.moe import MoEConfig
from megalite.model.moe.dispatcher import TokenDispatcher
from megalite.model.moe.layer import MoELayer
from megalite.model.moe.ledger import RoutingLedger
from megalite.model.moe.tokens import TokenSplit
from megalite.parallel.topology import build_topology
from megalite.testing.spawn import run_ranks
from tests.moe_layers import random_serial_layer, serial_and_split, stacked_piece

pytestmark = pytest.mark.distributed

SHARED = {"shared_experts.gate_up_proj.weight": (0, 2), "shared_experts.down_proj.weight": (1, 1)}
ROUTED = ("experts.gate_up_proj", "experts.down_proj")


def test_ep2_folded_over_tp2_equals_the_serial_layer():
    for per_mode in run_ranks(_folded, 2):
        for mode, (y, y_ep, grads, figures, figures_ep) in per_mode.items():
            torch.testing.assert_close(y_ep, y, rtol=1e-5, atol=1e-6, msg=mode)
            for name, (g, g_ep) in grads.items():  # atol: fp32 sums in another order
                torch.testing.assert_close(g_ep, g, rtol=1e-5, atol=1e-7 * g.abs().max(),
                                           msg=f"{mode} {name}")
            assert figures["counts"].sum() == 2 * 16, mode  # top 2 of 16 tokens
            for key, value in figures.items():
                torch.testing.assert_close(figures_ep[key], value, rtol=1e-6, atol=0,
                                           msg=f"{mode} {key}")


def _piece(name: str, full: torch.Tensor, rank: int, world: int) -> torch.Tensor:
    """Rank `rank`'s piece of the serial layer's `full`: its EP rank's experts, its TP
    piece of a shared expert's weight (each of `blocks` stacked blocks split), else all."""
    if name in ROUTED:
        return full.chunk(world)[rank]
    if name not in SHARED:
        return full
    return stacked_piece(full, *SHARED[name], rank, world)


def _folded(rank, world):
    """Rank function: per (dispatcher, aux loss), this rank's outputs of the serial and the
    folded layer, each gradient (serial: this rank's piece) and the figures."""
    topo = build_topology(world, 1, 1, rank=rank, ep=world)
    split = TokenSplit.of(topo.tp_group, True, None)
    out = {}
    for mode in ("alltoall", "allgather"):
        for aux_loss in ("layer", "sequence"):
            moe = MoEConfig(num_experts=4, top_k=2, aux_loss=aux_loss, aux_loss_coeff=0.1,
                            z_loss_coeff=0.01, shared_experts=1, shared_expert_gate=True)
            serial = random_serial_layer(moe, 8, 16)
            layer = MoELayer(moe, 8, 16, 0, RoutingLedger(moe, [0]), world, split,
                             TokenDispatcher(topo.ep_group, mode))
            x = torch.randn(8, 2, 8, generator=torch.Generator().manual_seed(1))
            out[f"{mode} {aux_loss}"] = serial_and_split(
                serial, layer, x, lambda name, full: _piece(name, full, rank, world),
                {*SHARED, *ROUTED}, ("counts", "aux", "z"), rank, world)
    return out
