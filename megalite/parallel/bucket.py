"""A ZeRO bucket: a group of parameters in one flat buffer (`megalite.parallel.flat`) with
its fp32 gradient, the rank's owned range of master weights, and the DP reduction of the
gradient — one `GradReduction` strategy per ZeRO stage, so neither the bucket nor the engine
branches on the stage number:

    stage 0  AllReduceGrad      whole gradient kept, one all-reduce per bucket per step
    stage 1  ReduceScatterGrad  whole gradient kept, one reduce-scatter per bucket per step
    stage 2-3 ShardedGrad       no whole gradient: a reduce-scatter every micro-batch into the
                                owned range

and which parameters share a bucket (`bucket_groups`, `chunk_buckets`: pure, so the plan
buckets the same way without a model).
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Dict, List, Optional, Tuple

import torch
import torch.nn as nn

from megalite.config.layout import Layout
from megalite.parallel import comm
from megalite.parallel.flat import FlatShards, Segment
from megalite.parallel.param_spec import ParamSpec
from megalite.parallel.topology import Topology
from megalite.parallel.zero3 import unit_groups

MOMENTS = ("exp_avg", "exp_avg_sq")
REDUCTIONS_IN_FLIGHT = 2  # zero 2/3: reduce-scatter inputs alive at once (ZeroEngine bounds it)


@dataclass
class StatePiece:
    """One owned range [lo, hi) of one parameter's flattened TP slice and its state by kind."""

    spec: ParamSpec
    lo: int
    hi: int
    tensors: Dict[str, torch.Tensor]
    index: int  # the engine's own handle
    dp_share: Tuple[int, int]  # the part of [lo, hi) in this DP rank's shard of its bucket:
    #                            all of it when the optimizer is sharded; under zero 0 the part
    #                            zero >= 1 would give this rank (empty: lo == hi)


class GradReduction:
    """How a ZeRO stage reduces a bucket's gradient over DP (one strategy per stage, so the
    bucket and the engine hold no `if stage == ...` branches).

    `keeps_full_grad`: the bucket accumulates the whole gradient over the step's micro-batches
    (stages 0-1) instead of reduce-scattering each micro-batch into its own range (2-3)."""

    keeps_full_grad = True
    every_micro_batch = False

    def launch(self, bucket: "Bucket", grad: torch.Tensor) -> None:
        raise NotImplementedError

    def fold(self, bucket: "Bucket", work, out: Optional[torch.Tensor]) -> torch.Tensor:
        """Wait for one launched reduction and put its result into the bucket's `main_grad`;
        returns the reduced gradient of the owned range it brought."""
        work.wait()
        return bucket.main_grad


class AllReduceGrad(GradReduction):
    """Stage 0: every rank keeps the whole gradient; one all-reduce per bucket per step."""

    def launch(self, bucket: "Bucket", grad: torch.Tensor) -> None:
        bucket.pending.append((comm.all_reduce(grad, bucket.group, async_op=True), None))


class ReduceScatterGrad(GradReduction):
    """Stage 1: the whole gradient accumulates locally; one reduce-scatter per bucket per step
    leaves each rank the sum of its own range."""

    def launch(self, bucket: "Bucket", grad: torch.Tensor) -> None:
        out = torch.empty(bucket.hi - bucket.lo, dtype=torch.float32, device=grad.device)
        bucket.pending.append((comm.reduce_scatter(out, grad, bucket.group, async_op=True), out))

    def fold(self, bucket: "Bucket", work, out: Optional[torch.Tensor]) -> torch.Tensor:
        work.wait()
        bucket.main_grad.copy_(out)
        return out  # what the reduction wrote (the copy into main_grad is the compute's)


class ShardedGrad(ReduceScatterGrad):
    """Stages 2-3: no whole gradient is kept; each micro-batch's gradient is reduce-scattered
    (as stage 1's once per step) and added to the rank's range."""

    keeps_full_grad = False
    every_micro_batch = True

    def fold(self, bucket: "Bucket", work, out: Optional[torch.Tensor]) -> torch.Tensor:
        work.wait()
        bucket.main_grad.add_(out[:bucket.main_grad.numel()])  # offload: the device's part
        return out


def grad_reduction(layout: Layout) -> GradReduction:
    if layout.shards_gradients:
        return ShardedGrad()
    return ReduceScatterGrad() if layout.shards_optimizer else AllReduceGrad()


class Bucket:
    """One flat buffer of parameters with its gradient and master-weight state."""

    def __init__(self, names: List[str], params: List[nn.Parameter], specs, topo: Topology,
                 layout: Layout, tied: bool = False, expert: bool = False):
        """`expert`: routed expert weights split over EP (ep > 1), held alike by the EDP
        ranks, over which they are reduced and sharded; else DP x CP's."""
        group = topo.expert_grad_group if expert else topo.grad_group
        self.group, self.tied, self.expert = group, tied, expert
        # the mean over DP x CP, of the dense and (summed over EDP) the experts' gradients
        self.grad_divisor = layout.grad_replicas
        self.reduction = grad_reduction(layout)
        self.gathers_params = layout.shards_optimizer and not layout.shards_parameters
        self.flat = FlatShards(names, params, specs, shards=group.size)
        padded = self.flat.padded_numel
        self.lo, self.hi = self.flat.shard_range(group.rank) if layout.shards_optimizer \
            else (0, padded)
        device, param_dtype = params[0].device, layout.compute_dtype
        values = torch.zeros(padded, dtype=torch.float32, device=device)
        for view, p in zip(self.flat.views(values), params):
            view.copy_(p.detach())
        self.param_full = values.to(param_dtype) if param_dtype != torch.float32 else values
        if layout.shards_parameters:
            self.param_region = self.param_full[self.lo:self.hi].clone()
        else:
            self.param_region = self.param_full[self.lo:self.hi]
        for view, p in zip(self.flat.views(self.param_full), params):
            p.data = view
        self.main = self.param_region if param_dtype == torch.float32 \
            else values[self.lo:self.hi].clone()
        self.grad_full: Optional[torch.Tensor] = None
        if self.reduction.keeps_full_grad:
            self.grad_full = torch.zeros(padded, dtype=torch.float32, device=device)
            self.main_grad = self.grad_full[self.lo:self.hi]
        else:
            self.main_grad = torch.zeros(self.hi - self.lo, dtype=torch.float32, device=device)
        self.segments: List[Segment] = self.flat.segments(self.lo, self.hi)
        self.dp_share = self.flat.shard_range(group.rank)  # what zero >= 1 would give it
        self.reported: Dict[int, int] = {}  # micro-batch -> its parameters reported so far
        # gradient accumulations per micro-batch: one per parameter, two for a parameter two
        # chunks use (zb-v's embedding and LM head on stage 0; `ZeroEngine` counts them)
        self.reports = len(params)
        self.completed = 0  # micro-batches whose every gradient is in, this step
        self._temp: Optional[torch.Tensor] = None  # zero 2/3: this backward's full gradient
        self.pending: List[Tuple[object, Optional[torch.Tensor]]] = []  # launched reductions
        self.launched = False

    @property
    def params(self) -> List[nn.Parameter]:
        return self.flat.params

    def region_view(self, flat: torch.Tensor, seg: Segment) -> torch.Tensor:
        """`seg`'s elements in a tensor that holds this rank's range [lo, hi)."""
        return flat[seg.flat_lo - self.lo:seg.flat_hi - self.lo]

    # --- gradients ----------------------------------------------------------------------

    def add_grad(self, index: int, grad: torch.Tensor) -> None:
        target = self.grad_full if self.grad_full is not None else self._full_temp()
        off = self.flat.offsets[index]
        target[off:off + grad.numel()].add_(grad.reshape(-1))

    def _full_temp(self) -> torch.Tensor:
        """This backward's full gradient (zero 2/3); zeros until a gradient reaches it."""
        if self._temp is None:
            self._temp = torch.zeros(self.flat.padded_numel, dtype=torch.float32,
                                     device=self.main_grad.device)
        return self._temp

    def launch(self) -> None:
        """Start this bucket's reduction over DP x CP (the gradient of the mean over those
        ranks: each CP rank's loss is the mean over its equal share of the sequences' tokens,
        so their mean is the serial run's loss).

        An expert bucket (ep > 1) reduces over EDP with the same factor 1/(DP·CP): an expert's
        gradient on its EP rank already sums the gradients of the losses of every EP rank
        whose tokens it computed (the all-to-all's backward brings them), so the sum over EDP
        covers each of the DP x CP losses once."""
        self.launched = True
        grad = self.grad_full if self.grad_full is not None else self._full_temp()
        if self.grad_divisor > 1:  # the mean over the ranks (one rank's gradient is the mean)
            grad.div_(self.grad_divisor)
        self.reduction.launch(self, grad)
        self._temp = None

    def complete(self) -> List[Tuple[torch.Tensor, object]]:
        """Wait for launched reductions and fold their results into `main_grad`; returns the
        reduced gradients (of the owned range) they brought, oldest first, each with its
        reduction's handle (whose `wait()` orders a stream after that reduction)."""
        pending, self.pending = self.pending, []
        reduced = [(self.reduction.fold(self, work, out), work) for work, out in pending]
        self.launched = False
        return reduced

    def zero_grad(self) -> None:
        (self.grad_full if self.grad_full is not None else self.main_grad).zero_()

    # --- parameters ---------------------------------------------------------------------

    def after_step(self, async_op: bool = False):
        """Master range -> model-dtype parameters; stages 1-2 gather every rank's range (with
        `async_op`, returns the gather's handle to wait on; None when there is none)."""
        if self.main is not self.param_region:  # (offload: the host sent the rest)
            self.param_region[:self.main.numel()].copy_(self.main)
        if self.gathers_params:
            return comm.all_gather(self.param_full, self.param_region, self.group,
                                   async_op=async_op)
        return None


def chunk_buckets(chunk, named, specs, topo: Topology, layout: Layout, bucket_mb: float
                   ) -> List[Tuple[List[str], bool]]:
    """(parameter names, whether they are EP-split experts) per bucket of one chunk: ZeRO-3's
    units, else `bucket_groups` — with ep > 1 the routed experts in buckets of their own
    (reduced and sharded over EDP, the others over DP x CP; under ZeRO 3 a unit's two buckets
    are gathered together, `megalite.parallel.zero3`)."""
    if layout.shards_parameters:  # a unit's experts (ep > 1) in a bucket of their own
        params, split = dict(named), topo.ep_size > 1
        return [(names, expert) for g in unit_groups(chunk) for expert in (False, True)
                for names in [[n for n in g if n in params
                               and (split and specs[n].expert) == expert]] if names]
    parts = [(named, False)]
    if topo.ep_size > 1:
        parts = [([(n, p) for n, p in named if specs[n].expert == expert], expert)
                 for expert in (False, True)]
    out = []
    for part, expert in parts:
        sizes = [(n, p.numel(), specs[n].tied) for n, p in part]
        out += [(names, expert) for names in filter(None, bucket_groups(
            sizes, bucket_mb * 2**20 / 4, tied_alone=topo.pp_size > 1))]
    return out


def bucket_groups(sizes: List[Tuple[str, int, bool]], bucket_numel: float,
                  tied_alone: bool) -> List[List[str]]:
    """Parameter names per bucket from (name, elements, tied) in registration order: reverse
    order (the order backward produces gradients), closed at `bucket_numel` elements; the tied
    embedding alone when pipelined. Pure, so the plan buckets the same way without a model."""
    groups: List[List[str]] = []
    size, closed = 0.0, True
    for name, numel, tied in reversed(sizes):
        if tied_alone and tied:
            groups.append([name])
            closed = True  # nothing joins the tied bucket
            continue
        if closed or size + numel > bucket_numel:
            groups.append([])
            size, closed = 0.0, False
        groups[-1].append(name)
        size += numel
    return groups
