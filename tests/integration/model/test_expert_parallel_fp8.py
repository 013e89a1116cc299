"""FP8 tensorwise experts under expert parallelism, at the layer: at ep 2 over dp 2 (each rank
another micro-batch, which the serial layer runs one at a time), ep 2 folded over tp 2 + SP
and ep 2 over cp 2 (each rank other tokens of one micro-batch), with both dispatchers, every
FP8 product every expert runs, forward and backward, takes the amaxes (so the scales) of the
serial layer's product for that expert and micro-batch: each (expert, source) segment of rows
scaled with its source's micro-batch's amax (`megalite.model.moe.fp8_sources`), also when
the routing sends one EP rank no rows. With a segment's own amax, or one over all the rows
an expert rank received, the check fails."""
from __future__ import annotations

from collections import Counter

import pytest
import torch

import megalite.model.moe.fp8_sources as fp8_sources
from megalite.config.moe import MoEConfig
from megalite.model.moe.dispatcher import TokenDispatcher
from megalite.model.moe.layer import MoELayer
from megalite.model.moe.ledger import RoutingLedger
from megalite.model.moe.tokens import TokenSplit
from megalite.parallel.fp8 import E4M3
from megalite.parallel.topology import build_topology
from megalite.testing.spawn import run_ranks

pytestmark = pytest.mark.distributed

ROUTED = ("experts.gate_up_proj", "experts.down_proj")
SKEW = (2.0, 1.0, 0.0, 0.0)  # the router's selection bias: experts 0 and 1, on EP rank 0, only


# the deliberate breaks: each segment's own amax (no reduction over the micro-batch's ranks),
# the amax over all rows an expert rank received (over the sources' micro-batches)
BREAKS = {"own": lambda own, group, dense: own,
          "received": lambda own, group, dense: own.amax(0, keepdim=True).expand_as(own)}


@pytest.fixture(scope="module")
def amaxes():
    """One launch: per scaling (None: the library's; else a break) and layout, every rank's
    FP8 products (`_fp8_amaxes`)."""
    return run_ranks(_fp8_amaxes, 2)


def test_fp8_experts_under_ep_scale_each_segment_as_the_serial_layer(amaxes):
    """Per layout and dispatcher, over both ranks: each forward product's (x, W) amaxes with
    its number of rows, and each backward product's amaxes, are the serial layer's over its
    micro-batches (2 forward and 4 backward products an expert with rows, every micro-batch;
    routing skewed onto experts 0 and 1, EP rank 1 receives no rows and takes part in the
    reductions with zeros)."""
    runs = [run[None] for run in amaxes]
    for name in runs[0]:
        serial, parallel = _merged(runs, name)
        assert len(serial[1]) >= 2 * 4 * (2 if name.startswith("dp") else 1), name
        assert parallel == serial, name
    for mode in ("alltoall", "allgather"):  # skewed: EP rank 1 computes no product
        assert runs[0][f"dp skewed {mode}"][1] and not runs[1][f"dp skewed {mode}"][1]


def test_a_scale_over_other_rows_fails_the_check(amaxes):
    """The check fails with a segment's own amax where the micro-batch's rows of an expert
    come from several ranks (tp, cp), and with an expert rank's amax over all its received
    rows where they hold several micro-batches (dp)."""
    for broken in BREAKS:
        runs = [run[broken] for run in amaxes]
        for name in runs[0]:
            serial, parallel = _merged(runs, name)
            assert (parallel != serial) == (name.startswith("dp") == (broken == "received")), \
                (broken, name)


def _merged(runs, name):
    """(serial, parallel), each (forward Counter {(x amax, W amax): rows}, backward set of
    amax pairs): the serial layer's (the same on every rank) and every rank's."""
    out = []
    for i, ranks in ((0, runs[:1]), (1, runs)):
        forward, backward = Counter(), set()
        for run in ranks:
            for fwd, amaxes, rows in run[name][i]:
                if fwd:
                    forward[amaxes] += rows
                else:
                    backward.add(amaxes)
        out.append((forward, backward))
    return out


def _layouts(rank, world):
    """name -> (topology, token split, the micro-batches the serial layer runs, this rank's
    part of the one it holds): two micro-batches [s, b, h] and their output gradients."""
    gen = torch.Generator().manual_seed(1)
    batches = [tuple(torch.randn(2, 8, 2, 16, generator=gen)) for _ in range(world)]
    dp = build_topology(1, 1, world, rank=rank, ep=world)
    tp = build_topology(world, 1, 1, rank=rank, ep=world)
    cp = build_topology(1, 1, 1, rank=rank, cp=world, ep=world)
    x, g = batches[0]
    part = (x.chunk(world)[rank], g.chunk(world)[rank])
    return {"dp": (dp, TokenSplit(), batches, batches[rank]),
            "dp skewed": (dp, TokenSplit(), batches, batches[rank]),
            "tp": (tp, TokenSplit.of(tp.tp_group, True, None), batches[:1], part),
            "cp": (cp, TokenSplit.of(None, False, cp.cp_group), batches[:1], part)}


def _fp8_amaxes(rank, world):
    """Rank function: per scaling (None, or a break of `BREAKS`), `_fp8_runs`."""
    reduced = fp8_sources.micro_batch_amaxes
    out = {None: _fp8_runs(rank, world)}
    for broken, scale in BREAKS.items():
        fp8_sources.micro_batch_amaxes = scale
        out[broken] = _fp8_runs(rank, world)
    fp8_sources.micro_batch_amaxes = reduced
    return out


def _fp8_runs(rank, world):
    """Per layout and dispatcher, the serial layer's and this rank's FP8 products:
    (forward?, (amax a, amax b), rows of a)."""
    import megalite.model.moe.fp8_experts as fp8_experts

    seen, product = [], fp8_experts.scaled_product

    def recorded(a, b, dtypes, layer, groups, out_dtype, amaxes):
        seen.append((dtypes == (E4M3, E4M3), tuple(a.item() for a in amaxes), a.shape[0]))
        return product(a, b, dtypes, layer, groups, out_dtype, amaxes)

    fp8_experts.scaled_product = recorded
    out = {}
    for name, (topo, split, batches, mine) in _layouts(rank, world).items():
        moe = MoEConfig(num_experts=4, top_k=2, aux_loss_coeff=0.1, z_loss_coeff=0.01,
                        bias_update_rate=0.01 if name == "dp skewed" else 0.0)
        for mode in ("alltoall", "allgather"):
            torch.manual_seed(0)
            serial = MoELayer(moe, 16, 32, 0, RoutingLedger(moe, [0]))
            for p in serial.parameters():
                torch.nn.init.normal_(p, std=0.5)
            layer = MoELayer(moe, 16, 32, 0, RoutingLedger(moe, [0]), split.tp_size, split,
                             TokenDispatcher(topo.ep_group, mode))
            full = dict(serial.named_parameters())
            with torch.no_grad():
                for p_name, p in layer.named_parameters():
                    p.copy_(full[p_name].chunk(world)[rank] if p_name in ROUTED
                            else full[p_name])
                for module in (serial, layer) if name == "dp skewed" else ():
                    module.gate.e_score_correction_bias.copy_(torch.tensor(SKEW))
            runs = []
            for module, inputs in ((serial, batches), (layer, [mine])):
                module.experts.fp8 = "tensorwise"
                seen.clear()
                for x, g in inputs:
                    module.ledger.open(True)
                    ((module(x) * g).sum() + module.ledger.close()).backward()
                runs.append(list(seen))
            out[f"{name} {mode}"] = runs
    fp8_experts.scaled_product = product
    return out
