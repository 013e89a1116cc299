"""The data-parallel engine: ZeRO stages 0-3 over the DP group (Rajbhandari et al. 2019) —
DP x CP with context parallelism (`Topology.grad_group`: CP ranks hold the same parameters).

Parameters live in flat buffers ("buckets", or per-block "units" for stage 3; see
`megalite.parallel.flat`). Each DP rank owns one contiguous range of every buffer — the whole
buffer for stage 0 — and runs AdamW on the fp32 master copy of that range only:

What each stage keeps and sends per rank is the ZeRO table of `megalite.plan.zero_table.zero_table()`
(stage 0: everything full, gradients all-reduced; 1: optimizer state sharded, one
reduce-scatter per step; 2: gradients sharded too, a reduce-scatter every micro-batch; 3:
parameters sharded too, gathered per block on demand); the engine reads the stage through the
`Layout`'s `shards_*` properties and reduces with the stage's `GradReduction`.

Gradients reach the engine through post-accumulate-grad hooks: each parameter's gradient is
added (in fp32) into its bucket's flat gradient and released; when the last parameter of a
bucket has reported for a micro-batch (counted per micro-batch: zero-bubble schedules interleave
micro-batches' deferred weight gradients), the bucket's collective is launched asynchronously,
so communication overlaps the rest of the backward pass. Stages 0 and 1 accumulate micro-batches
locally and communicate once per optimizer step, once a bucket has all the step's micro-batches
(during the last backward, or under a zero-bubble schedule the last W); stages 2 and 3 keep
no full gradient and reduce-scatter after every micro-batch.

After the reductions, on the owned range only: gradients of TP-replicated parameters are summed
over TP when sequence parallelism gave each TP rank part of them, and the two copies of the tied
embedding (first and last pipeline stage) are summed over the embedding group — the tied
embedding is a bucket of its own on both stages, so both own the same elements. The global
gradient norm counts each element once: TP-replicated pieces on TP rank 0, the tied copy not at
all, DP ranges summed over DP (stages 1-3); with expert parallelism the experts' buckets
are reduced and sharded over EDP (`Bucket`), their squares summed over EDP (stages 1-2) and
over EP (each EP rank holds other experts) — so clipping equals the serial run.

After the optimizer step the fp32 master range is copied into the model-dtype parameters; stages
1 and 2 all-gather the updated ranges, stage 3 keeps its range (see `megalite.parallel.zero3`).
"""
from __future__ import annotations

import weakref
from collections import deque
from typing import Callable, Deque, Dict, List, Optional, Tuple

import torch
import torch.nn as nn

from megalite.config.layout import Layout
from megalite.parallel.bucket import REDUCTIONS_IN_FLIGHT, Bucket, chunk_buckets
from megalite.parallel.flat import Segment
from megalite.parallel.grad_sums import sum_tied_embedding, sum_tp_replicated, sum_tp_shares
from megalite.parallel.host_range import AdamWSettings, build_adamw
from megalite.parallel.norms import by_device, global_norm
from megalite.parallel.offload import OptimizerOffload
from megalite.parallel.param_gather import OverlappedParamGather
from megalite.parallel.topology import Topology
from megalite.parallel.zero3 import Zero3Gathering
from megalite.parallel.zero_state import EngineState


class ZeroEngine(EngineState):
    """Owns the parameters, gradients and optimizer state of one model stage on one rank
    (`model.chunks`: the stage's model chunks, one without an interleaved schedule). Its
    checkpoint pieces and byte accounting: `megalite.parallel.zero_state`."""

    def __init__(self, model: nn.Module, topo: Topology, layout: Layout, optim: AdamWSettings,
                 bucket_mb: float = 25.0, reshard_after_forward: bool = True,
                 overlap_param_gather: bool = False, offload_optimizer: float = 0.0,
                 offload_timers=None):
        """`offload_timers`: where offload.optimizer's waits on its copies are timed (an
        object with `phase(name)`, the trainer's `StepTimers`: the `offload_wait` phase)."""
        self.topo, self.layout, self.model = topo, layout, model
        self.sequence_parallel = layout.sequence_parallel
        self.buckets: List[Bucket] = []
        owner: Dict[int, Bucket] = {}  # a parameter two chunks share (zb-v's tied embedding)
        for chunk in model.chunks:  # a bucket never spans chunks: each syncs after its own
            named, specs = list(chunk.named_parameters()), chunk.param_specs  # last backward
            for _, p in named:  # in an earlier chunk's bucket: one more gradient to expect
                if id(p) in owner:
                    owner[id(p)].reports += 1
            named = [(n, p) for n, p in named if id(p) not in owner]
            params = dict(named)
            for names, expert in chunk_buckets(chunk, named, specs, topo, layout, bucket_mb):
                tied = topo.pp_size > 1 and any(specs[n].tied for n in names)
                self.buckets.append(Bucket(names, [params[n] for n in names],
                                           [specs[n] for n in names], topo, layout, tied,
                                           expert))
                owner.update((id(params[n]), self.buckets[-1]) for n in names)
        self._where: Dict[nn.Parameter, Tuple[Bucket, int]] = {}
        hook = _weak_hook(self)
        for b in self.buckets:
            for i, p in enumerate(b.params):
                self._where[p] = (b, i)
                p.register_post_accumulate_grad_hook(hook)
        self.bucket_reduced: List[Callable[[Bucket, torch.Tensor], None]] = []
        # listeners called with (bucket, its full local gradient) just before the DP reduction
        # starts (megalite.resilience: the rerun's fingerprint of the rank's own gradient)
        self.grad_launching: List[Callable[[Bucket, torch.Tensor], None]] = []
        self._in_flight: Deque[Bucket] = deque()  # zero 2/3: buckets whose reduce-scatter runs
        self.peak_in_flight = 0  # the most reduce-scatter inputs alive at once, so far
        self._micro_batch, self._micro_batches = 0, 1  # whose gradients arrive (before_backward)
        self.zero3 = None
        if layout.shards_parameters:
            self.zero3 = Zero3Gathering(model.chunks, self, reshard_after_forward)
        self.param_gather = None  # zero 1/2 with overlap_param_gather: see param_gather.py
        if overlap_param_gather and layout.shards_optimizer and not layout.shards_parameters:
            self.param_gather = OverlappedParamGather(model.chunks, self.buckets)
        self.offload: Optional[OptimizerOffload] = None  # offload.optimizer: see offload.py
        if offload_optimizer > 0:
            self.offload = OptimizerOffload(model.chunks, self.buckets, offload_optimizer,
                                            self.buckets[0].main_grad.device, offload_timers)
            if self.zero3 is not None:  # each unit's gather waits for its parameters' copy
                self.zero3.params_needed = self.offload.params_needed
                self.zero3.prefetch_after_forward = True
        self._build_optimizer(optim)

    # --- optimizer ----------------------------------------------------------------------

    def _build_optimizer(self, cfg: AdamWSettings) -> None:
        """AdamW over the owned segments of every bucket: one leaf tensor per piece of a
        parameter, a view of the fp32 master range, its gradient a view of `main_grad` (an
        offloaded piece's: views of host tensors, stepped by the host AdamW of its bucket).
        `self.optimizer` is the device's (None when everything is offloaded)."""
        pieces, decays = [], []
        self._main_params: List[Tuple[nn.Parameter, Segment, Bucket]] = []
        for b in self.buckets:
            host = None if self.offload is None else self.offload.range_of(b)
            for seg in b.segments:
                if host is not None and seg.flat_lo >= host.cut:
                    self._main_params.append((host.piece(seg), seg, b))
                    continue
                piece = nn.Parameter(b.region_view(b.main, seg))
                piece.grad = b.region_view(b.main_grad, seg)
                pieces.append(piece)
                decays.append(seg.spec.weight_decay)
                self._main_params.append((piece, seg, b))
        kind = "fused" if self.buckets[0].main_grad.device.type == "cuda" else "foreach"
        self.optimizer = build_adamw(pieces, decays, cfg, kind) if pieces else None
        self.optimizers = ([self.optimizer] if pieces else []) + (
            [] if self.offload is None else self.offload.build_optimizers(cfg))
        self._optimizer_of = {id(p): o for o in self.optimizers
                              for g in o.param_groups for p in g["params"]}
        self._on_host = [self._optimizer_of[id(p)] is not self.optimizer
                         for p, _, _ in self._main_params]  # offloaded pieces
        self._norm_grads = self._norm_split([p.grad for p, _, _ in self._main_params])
        self._device_grads = [p.grad for (p, _, _), host in zip(self._main_params,
                                                                  self._on_host) if not host]
        if self.offload is not None:  # host pieces no later sum changes: squared by the
            rest = []                 # offload's worker as their gradients become final
            for (p, seg, b), host in zip(self._main_params, self._on_host):
                if not host or not self._counted(seg) or b.expert:  # (experts: their own sum)
                    continue
                if (b.tied or (self.sequence_parallel and seg.spec.tp_replicated)
                        or seg.spec.tp_replicas > 1):  # (KV heads shared over TP ranks)
                    rest.append(p.grad)  # summed after the reduction: squared in grad_norm
                else:
                    self.offload.count_in_norm(b, p.grad)
            self._norm_grads = (self._norm_grads[0], rest, *self._norm_grads[2:])

    @property
    def main_params(self) -> List[Tuple[nn.Parameter, Segment, Bucket]]:
        """(fp32 master piece, its segment, its bucket) of every owned range, device and host
        (offload.optimizer: once the host step queued by the last `clip_and_step` is done, so
        whoever reads them — checkpoints, norms, the replica check — reads the update)."""
        if self.offload is not None:
            self.offload.step_done()
        return self._main_params

    def _counted(self, seg: Segment) -> bool:
        """Whether this rank counts `seg` in a global norm: the tied embedding's second copy
        never, TP-replicated tensors on TP rank 0 only, TP-shared slices on the first rank
        of each group that holds them (`ParamSpec.tp_writer`)."""
        spec = seg.spec
        return not spec.tied_copy and spec.tp_writer(self.topo.coords.tp_rank)

    # --- gradient flow ------------------------------------------------------------------

    def _on_grad(self, p: nn.Parameter) -> None:
        """A parameter's gradient of the current micro-batch is in. A bucket is complete for
        a micro-batch when all its parameters reported for that micro-batch: counted per
        micro-batch, since under a zero-bubble schedule the deferred weight gradients (W) of
        several micro-batches interleave with other micro-batches' B (whose LayerNorm and bias
        gradients come at once), and one running count would call a bucket complete while a
        micro-batch's gradients are still missing."""
        bucket, index = self._where[p]
        bucket.add_grad(index, p.grad)
        p.grad = None
        mb = self._micro_batch
        reported = bucket.reported.get(mb, 0) + 1
        if reported < bucket.reports:
            bucket.reported[mb] = reported
            return
        bucket.reported.pop(mb, None)
        bucket.completed += 1
        if bucket.reduction.every_micro_batch:
            self._launch_bounded(bucket)
        elif bucket.completed == self._micro_batches:  # the step's last: its one reduction
            self._launch(bucket)
        if self.zero3 is not None:
            self.zero3.after_backward(bucket, mb)

    def before_backward(self, micro_batch: int, micro_batches: int) -> None:
        """Called before each backward (or each of its B and W halves) of `micro_batch`, one
        of the step's `micro_batches`: the gradients that arrive next belong to it. Stages
        0-1 reduce a bucket once it is complete for all `micro_batches` (after the step's
        last W under a zero-bubble schedule, not its last B). Stages 2-3: first fold in the
        previous micro-batch's reduce-scatters — by now long finished behind a forward — so
        that at most one micro-batch's reductions and their buffers are ever alive (the
        backend keeps each pending reduction's full-size input until it is waited on)."""
        self._micro_batch, self._micro_batches = micro_batch, micro_batches
        self._in_flight.clear()
        for b in self.buckets:
            if b.reduction.every_micro_batch:
                self._complete(b)

    def before_op(self, op, next_op) -> None:
        """Before each pipeline F and B, with the stage's next F or B (None after the last):
        ZeRO-3 prefetches the next one's first unit during this one (`op_starts`)."""
        if self.zero3 is not None:
            self.zero3.op_starts(op, next_op)

    def _launch_bounded(self, bucket: Bucket) -> None:
        """Zero 2/3: launch `bucket`'s reduce-scatter with at most REDUCTIONS_IN_FLIGHT inputs
        alive: NCCL keeps an asynchronous collective's input until it is waited for (its
        tensor stashing, pytorch#148590), so without a bound every bucket's full fp32
        gradient of a micro-batch could be alive at once (4Ψ of the stage, where the plan
        says 4Ψ/N); the oldest is folded in first."""
        while len(self._in_flight) >= REDUCTIONS_IN_FLIGHT:
            self._complete(self._in_flight.popleft())
        self._launch(bucket)
        self._in_flight.append(bucket)
        self.peak_in_flight = max(self.peak_in_flight,
                                  sum(len(b.pending) for b in self.buckets))

    def _launch(self, bucket: Bucket) -> None:
        """Start `bucket`'s DP reduction, after telling the grad_launching listeners."""
        grad = bucket.grad_full if bucket.grad_full is not None else bucket._full_temp()
        for listener in self.grad_launching:
            listener(bucket, grad)
        bucket.launch()
        if self.offload is not None:  # the host part's copy, ordered after this reduction
            work, out = bucket.pending[-1]
            self.offload.on_launched(bucket, work, bucket.main_grad if out is None else out,
                                     grad)

    def grad_staging_bytes(self) -> int:
        """Zero 2/3's declared staging: the full-size fp32 gradients of the buckets being
        filled or reduced — REDUCTIONS_IN_FLIGHT in flight plus one filling — of the largest
        bucket each (the plan counts the same)."""
        if not self.buckets[0].reduction.every_micro_batch:
            return 0
        return (REDUCTIONS_IN_FLIGHT + 1) * 4 * max(b.flat.padded_numel for b in self.buckets)

    def _complete(self, bucket: Bucket) -> None:
        """Fold in `bucket`'s launched reductions and announce each reduced gradient to the
        `bucket_reduced` listeners (called per bucket per reduction: once per step for stages
        0-1, per micro-batch for 2-3), the hook for consumers of reduced gradients."""
        for reduced, work in bucket.complete():
            for listener in self.bucket_reduced:
                listener(bucket, reduced)
            if self.offload is not None:  # CPU: a copy that waited for this reduction
                self.offload.on_reduced(bucket, reduced, work)

    def finish_grad_sync(self) -> None:
        """After the step's last backward: every bucket's gradient reduced over DP (and TP /
        the embedding group where needed) on this rank's range."""
        self._in_flight.clear()
        for b in self.buckets:
            if b.reported:
                raise RuntimeError(f"a gradient bucket is missing gradients of micro-batches "
                                   f"{sorted(b.reported)} at the end of the step")
            b.completed = 0
            if not b.reduction.every_micro_batch and not b.launched:
                self._launch(b)  # a bucket no gradient reached this step (reduces zeros)
            self._complete(b)
        if self.offload is not None:
            self.offload.drain()
        sum_tied_embedding(self.buckets, self.offload, self.topo)
        if self.sequence_parallel:
            sum_tp_replicated(self.main_params, self.topo.tp_group,
                              self.buckets[0].main_grad.device)
        sum_tp_shares(self.main_params, self.topo.tp_group, self.buckets[0].main_grad.device)
        if self.zero3 is not None:
            self.zero3.end_of_step()

    def _norm_split(self, tensors: List[torch.Tensor]) -> Tuple[List, ...]:
        """Of tensors laid out like `main_params`, those this rank counts in a global norm:
        (the device's, the host's) of the dense parameters, then of the EP-split experts."""
        counted = [(t, host, b.expert) for t, host, (_, seg, b) in zip(
            tensors, self._on_host, self._main_params) if self._counted(seg)]
        return tuple([t for t, host, expert in counted if host == on and expert == kind]
                     for kind in (False, True) for on in (False, True))

    def _global_norm(self, pieces: Tuple[List, ...],
                     host_squares: Optional[torch.Tensor] = None) -> torch.Tensor:
        """L2 norm over the whole model of `_norm_split`'s pieces (`global_norm`)."""
        return global_norm(pieces, self.topo, self.layout.shards_optimizer,
                           self.buckets[0].main_grad.device, host_squares)

    def grad_norm(self) -> torch.Tensor:
        """Global L2 norm of the gradient of the whole model (offload.optimizer: most host
        pieces' squares were taken by the offload's worker during the backward)."""
        return self._global_norm(self._norm_grads, None if self.offload is None
                                 else self.offload.grad_squares())

    def param_norm(self) -> torch.Tensor:
        """Global L2 norm of the fp32 master weights (Megatron's --log-params-norm)."""
        return self._global_norm(self._norm_split([p.detach() for p, _, _ in self.main_params]))

    def clip_and_step(self, lr: float, max_norm: float, norm: Optional[torch.Tensor] = None,
                      grad_scale: float = 1.0) -> torch.Tensor:
        """Global-norm clipping (no-op when max_norm = 0), AdamW on the owned ranges, and the
        parameters brought up to date. Returns the pre-clipping norm.

        `grad_scale`: the factor the gradients carry (fp16 loss scaling); they are divided by
        it in the same pass as the clipping, and `norm`, if given, is the unscaled norm.
        offload.optimizer: the host pieces' factor goes into their AdamW's one pass (queued
        on the offload's worker, `OptimizerOffload.step`); this returns before it ran (zero
        1/2 with overlap_param_gather: the gathers of buckets still stepping are deferred to
        the next forward, `OverlappedParamGather`)."""
        if norm is None:
            norm = self.grad_norm() / grad_scale
        coef = torch.clamp(max_norm / (norm + 1e-6), max=1.0) if max_norm > 0 else None
        if grad_scale != 1.0:
            coef = 1.0 / grad_scale if coef is None else coef / grad_scale
        if coef is not None:
            coef = coef.to(torch.float32) if isinstance(coef, torch.Tensor) else \
                torch.tensor(coef, dtype=torch.float32)  # the gradients' dtype
        # the host's factor read before the device's AdamW is queued: read after it, it would
        # wait for that AdamW too (the norm it comes from was synced by the finiteness check)
        host_coef = None if self.offload is None or coef is None else coef.item()
        if coef is not None:
            for grads in by_device(self._device_grads).values():
                torch._foreach_mul_(grads, coef.to(grads[0].device))
        for optimizer in self.optimizers:
            for group in optimizer.param_groups:
                group["lr"] = lr
        if self.optimizer is not None:
            self.optimizer.step()  # on CUDA queued: the host steps meanwhile
        if self.offload is not None:
            self.offload.step(host_coef, lr)
        if self.param_gather is not None:  # waited for by the next forward, unit by unit
            if self.offload is None:
                self.param_gather.launch()
            else:  # a bucket whose host part still steps: gathered where first needed
                self.param_gather.launch(self.offload.gather_after_copy,
                                         self.offload.stepping)
        else:
            for b in self.buckets:
                if self.offload is not None and b.gathers_params:
                    self.offload.params_needed([b])  # the gather reads the host's part
                b.after_step()
        return norm

    def wait_for_params(self) -> None:
        """Make the model parameters current (they are after every step unless the
        parameter gather overlaps the next forward)."""
        if self.param_gather is not None:
            self.param_gather.wait()
        if self.offload is not None:
            self.offload.params_needed(self.buckets)

    def zero_grad(self) -> None:
        for b in self.buckets:
            b.zero_grad()
        if self.offload is not None:
            self.offload.zero_grad()

    def release_params(self) -> None:
        """Stage 3: free every gathered unit (after a forward-only pass)."""
        if self.zero3 is not None:
            self.zero3.end_of_step()


def _weak_hook(engine: "ZeroEngine"):
    """The parameters' gradient hook, holding the engine weakly: hooks live in C++ where
    Python's garbage collector cannot see them, so a strong reference would keep every engine
    (and its buffers) alive forever through parameter -> hook -> engine -> parameter."""
    ref = weakref.ref(engine)

    def hook(p: nn.Parameter) -> None:
        live = ref()
        if live is not None:
            live._on_grad(p)
    return hook
