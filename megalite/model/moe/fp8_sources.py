"""FP8 tensorwise scales of the routed experts under expert parallelism (ep > 1): each segment
of an expert's rows scaled with the amax of its source's micro-batch, as the serial run scales
that micro-batch (`megalite.model.moe.fp8_experts` for the products, docs/moe.md).

Under EP an expert rank receives its local experts' rows from the ep ranks of its EP group
(`megalite.model.moe.dispatcher`), ordered expert-major and, within an expert, by source. The
sources may hold different micro-batches (EP over DP: other replicas) or other tokens of the
same one (EP over TP under SP, over CP), and the other tokens of a source's micro-batch may
have been sent to the same expert held on another EP group's rank. The serial run scales each
micro-batch alone, one amax per expert and token tensor; so here every (expert, source) segment
of a token tensor — the products' inputs x_e and silu(gate)·up, their output gradients dy_e —
takes the amax over all rows of that expert in the source's micro-batch, wherever they were
computed:

    1. the expert rank takes the amax of each of its segments, A[s, e] ([ep, local] fp32, 0 for
       an empty one);
    2. an all-to-all over EP returns row s to source s, which so holds, for every expert of the
       model, the amax of its own rows there: [E];
    3. the sources max-reduce that [E] over the ranks holding the other tokens of their
       micro-batch (the TP group under SP, the CP group: the dense ranks the serial tensor
       spans; a DP replica holds another micro-batch and is left out);
    4. an all-gather over EP gives each expert rank every source's micro-batch amaxes [ep, E],
       of which it keeps its local experts' columns: the scale of each of its segments.

Each kind is four small collectives a layer, forward or backward, launched in that order on
every rank whatever the routing sent it (an EP rank without rows takes part with zeros). The
rows are independent in every product, so each segment's product is the serial product's
rows; an expert's weight gradient sums its segments' products (from several micro-batches:
the gradient accumulation the serial run does over them). The experts are whole on every rank
under EP (expert TP = 1, `ParamSpec.tp_folded`): a weight's amax is its own, not reduced.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import List, Optional

import torch
import torch.distributed as dist

from megalite.model.moe.fp8_experts import segment_amaxes
from megalite.parallel import comm
from megalite.parallel.fp8 import Fp8Linear
from megalite.parallel.group import Group


@dataclass(frozen=True)
class Sources:
    """Where the rows an expert rank computes came from: `counts` [ep, local] the rows of each
    source (EP rank of `group`) for each local expert."""

    counts: torch.Tensor
    group: Group


class PerSource:
    """The scaling of `fp8_expert_products` under EP: one segment per (local expert, source),
    its token amax that of the source's micro-batch (module docstring); `dense` the groups
    holding the other tokens of a rank's micro-batch (TP under SP, CP; None: not split)."""

    def __init__(self, sources: Sources, dense: List[Optional[Group]]):
        ep, local = sources.counts.shape
        self.group, self.dense = sources.group, [g for g in dense if g is not None]
        self.sizes: List[int] = sources.counts.t().reshape(-1).tolist()  # expert-major
        self.experts = [e for e in range(local) for _ in range(ep)]
        self.shape = (ep, local)

    def token_amaxes(self, rows: torch.Tensor, tp_split: bool, layer: Fp8Linear
                     ) -> torch.Tensor:
        """Each segment's scale amax (the micro-batch's), in the segments' order: [local·ep]
        fp32. `tp_split`, `layer`: unused, the experts are whole under EP."""
        ep, local = self.shape
        own = segment_amaxes(rows, self.sizes).view(local, ep).t().contiguous()  # [source, e]
        return micro_batch_amaxes(own, self.group, self.dense).t().reshape(-1)

    def weight_amaxes(self, weight: torch.Tensor, layer: Fp8Linear) -> torch.Tensor:
        """Each local expert's weight amax: [local] fp32 (whole experts: not reduced)."""
        return torch.stack([w.abs().amax().float() for w in weight])


def micro_batch_amaxes(own: torch.Tensor, group: Group, dense: List[Group]) -> torch.Tensor:
    """`own` [ep, local]: this expert rank's amax of each source's rows for each of its
    experts -> [ep, local]: the amax over all rows of the source's micro-batch for that
    expert, wherever computed (module docstring, steps 2-4)."""
    ep, local = own.shape
    mine = torch.empty_like(own)  # [expert rank, its local expert]: this rank's rows, [E]
    comm.all_to_all(mine, own, group)
    for g in dense:
        comm.all_reduce(mine, g, op=dist.ReduceOp.MAX)
    every = own.new_empty(ep * ep * local)  # [source, expert rank, local expert]
    comm.all_gather(every, mine.reshape(-1), group)
    return every.view(ep, ep, local)[:, group.rank]
