"""MoE helpers the tests of both tiers share: the routers' outputs of the next forwards, and one
MoE layer run serially and split over spawned ranks (TP, EP folded over TP, CP), for comparing
the split layer with the serial one."""
from __future__ import annotations

from typing import Callable, Collection, Sequence

import torch

from megalite.config.moe import MoEConfig
from megalite.model.moe.layer import MoELayer
from megalite.model.moe.ledger import RoutingLedger
from megalite.model.moe.router import Router

Piece = Callable[[str, torch.Tensor], torch.Tensor]


def router_outputs(model) -> list:
    """Each MoE layer's Routing of the next forwards, in block order (forward hooks on every
    Router of `model`; clear the list between forwards)."""
    seen = []
    for m in model.modules():
        if isinstance(m, Router):
            m.register_forward_hook(lambda _m, _i, out: seen.append(out))
    return seen


def stacked_piece(full: torch.Tensor, dim: int, blocks: int, rank: int,
                  world: int) -> torch.Tensor:
    """Rank `rank`'s piece of `full` split along `dim` over `world` ranks, the dim holding
    `blocks` stacked blocks (gate and up: 2) each split alike (ParamSpec's rule)."""
    return torch.cat([b.chunk(world, dim)[rank] for b in full.chunk(blocks, dim)], dim)


def random_serial_layer(moe: MoEConfig, hidden: int, ffn: int) -> MoELayer:
    """The serial MoE layer (layer 0) every rank builds alike: seed 0, every parameter drawn
    from N(0, 0.5²) so that routing and experts differ visibly."""
    torch.manual_seed(0)
    serial = MoELayer(moe, hidden, ffn, 0, RoutingLedger(moe, [0]))
    for p in serial.parameters():
        torch.nn.init.normal_(p, std=0.5)
    return serial


def copy_pieces(layer: MoELayer, serial: MoELayer, piece: Piece) -> None:
    """Set each parameter of the split `layer` to `piece(name, serial's parameter)`."""
    full = dict(serial.named_parameters())
    with torch.no_grad():
        for name, p in layer.named_parameters():
            p.copy_(piece(name, full[name]))


def serial_and_split(serial: MoELayer, layer: MoELayer, x: torch.Tensor, piece: Piece,
                     split: Collection[str], figures: Sequence[str], rank: int,
                     world: int) -> tuple:
    """Run `serial` on all of `x` and the split `layer` (its parameters set here from
    `serial`'s by `piece`) on this rank's rows `x.chunk(world)[rank]`, each backward from
    Σ y² + its ledger's penalty. Returns this rank's rows of the serial output, the layer's
    output, per parameter (the serial gradient's piece, the layer's gradient: summed over the
    ranks where the name is not in `split`, as the engine sums replicated gradients under SP),
    and each ledger's `figures` (serial's, then the layer's summed over the ranks)."""
    copy_pieces(layer, serial, piece)
    ys = []
    for module, inputs in ((serial, x), (layer, x.chunk(world)[rank])):
        module.ledger.open(True)
        y = module(inputs)
        (y.square().sum() + module.ledger.close()).backward()
        ys.append(y.detach())
    full = dict(serial.named_parameters())
    grads = {}
    for name, p in layer.named_parameters():
        if name not in split:
            torch.distributed.all_reduce(p.grad)
        grads[name] = (piece(name, full[name].grad), p.grad)
    taken = [{k: getattr(m.ledger.figures, k) for k in figures} for m in (serial, layer)]
    for t in taken[1].values():
        torch.distributed.all_reduce(t)
    return (ys[0].chunk(world)[rank], ys[1], grads, *taken)
