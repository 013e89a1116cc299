"""ZeRO-3 parameter gathering: each unit (embedding, position embedding, one block, ln_f, LM
head — a model chunk's `sharding_units()`, in forward order) keeps only its DP range between
uses and is all-gathered just before it runs. With expert parallelism a block's routed experts
are a bucket of their own, sharded over EDP: the unit's two buckets are gathered (in one order
on every rank), freed and reduced together.

    forward   pre-hook : gather (or wait for the prefetch), prefetch the next unit —
                         except under offload.optimizer (`prefetch_after_forward`)
              post-hook: offload.optimizer: prefetch the next unit (its host step waited for
                         here, after this unit's forward was queued, not before) — on every
                         rank at this point, whether or not the host step has finished (the
                         ranks must launch their collectives on different groups in one
                         order: NCCL's rule, `megalite.testing.collective_order`);
                         free the gathered parameters (reshard_after_forward), except for the
                         chunk's last unit, whose backward comes first (right away on the
                         last pipeline stage)
    backward  a hook on the unit's output gradient fires just before the unit's backward:
              gather again, prefetch the previous unit; with activation recomputation the
              unit's forward re-runs here and its pre-hook, finding the unit in backward,
              prefetches nothing (the next unit's backward is already done)
              when every parameter's gradient of a micro-batch is in (engine): its
              reduce-scatter; free once each of the unit's buckets has that micro-batch's
              (`after_backward`: under a zero-bubble schedule with EP, the experts' B and the
              dense weights' W)

Freeing shrinks the flat buffer's storage to 0 bytes; gathering grows it back and fills it, so
the tensors autograd saved in forward (views of that storage) are valid again in backward
(the technique of PyTorch FSDP1). The prefetch is an asynchronous all-gather: on GPUs NCCL runs
it on its own stream, on CPUs gloo on its own threads, overlapping the current unit's compute.

Across pipeline operations (`op_starts`, told by the pipeline before each F and B, with the
first unit of the stage's next F or B in its schedule's order — a W gathers nothing): the
chain goes on into the next operation, which may be another chunk's. At a fixed point of the
current operation — the forward pre-hook of its chunk's last unit (under offload.optimizer its
post-hook), the backward hook of its chunk's first unit — the next operation's first unit is
prefetched (FSDP2's and Megatron's prefetch across micro-batches) and held: not freed (by a
post-hook or `after_backward`, or by a W in between) until that operation starts. So only the
step's first unit is gathered where it is needed; at most one unit beyond the current one is
gathered ahead, and where the next operation starts with a unit the current one ends with (a
backward's first unit after the forward, the forward's first after the backward of the same
chunk) it is kept instead of freed and gathered again. The launch points depend only on the
schedule and the chain, the same on every rank of the DP x CP group (NCCL's rule).

`reshard_after_forward=False` keeps every unit gathered from its first use to the end of the
step: one all-gather per unit per step instead of two per micro-batch, at the memory cost of
the stage's full parameters during the step — the better choice under pipeline parallelism with
many micro-batches (docs/zero.md gives the traffic of both).
"""
from __future__ import annotations

from typing import Callable, Dict, List, Optional

import torch
import torch.nn as nn

from megalite.parallel import comm
from megalite.parallel.schedule import F, Op


def unit_groups(model: nn.Module) -> List[List[str]]:
    """Parameter names of each unit, in forward order; a parameter shared by two units (the
    tied embedding of a single-stage model) belongs to the first."""
    names = {id(p): n for n, p in model.named_parameters()}
    seen, groups = set(), []
    for module in model.sharding_units():
        group = [names[id(p)] for p in module.parameters() if id(p) not in seen]
        seen.update(id(p) for p in module.parameters())
        if group:
            groups.append(group)
    return groups


class _UnitState:
    """One unit's buckets (one; two with expert parallelism: its dense weights over DP x CP,
    its routed experts over EDP), gathered and freed together."""

    def __init__(self, buckets):
        self.buckets = buckets
        self.gathered = False
        self.works: List = []
        self.in_backward = False
        self.reported: Dict[int, int] = {}  # micro-batch -> its buckets whose gradients are in


class Zero3Gathering:
    """Gathering hooks on the units of `chunks` (each chunk's `sharding_units()`, a chain in
    forward order: prefetching follows the chain and stops at its ends, as the next unit to
    run after a chunk's last one may belong to any chunk)."""

    def __init__(self, chunks, engine, reshard_after_forward: bool):
        self.reshard_after_forward = reshard_after_forward
        # offload.optimizer: makes a unit's gather wait for its parameters' copy from the host
        self.params_needed: Optional[Callable[[List], None]] = None
        # offload.optimizer: the next unit's prefetch waits until this unit's forward is
        # queued (its parameters may still be stepped on the host)
        self.prefetch_after_forward = False
        # the running pipeline operation (True: a forward, False: a backward, None: none
        # announced), the next operation's first unit (prefetched at this operation's fixed
        # point) and the one prefetched for the next operation (not freed before it starts)
        self._op_forward: Optional[bool] = None
        self._ahead: Optional[_UnitState] = None
        self._held: Optional[_UnitState] = None
        # gathers that ran where the unit was needed, no prefetch having launched them
        self.exposed_gathers = 0
        by_param = {id(p): b for b in engine.buckets for p in b.params}
        self.state: Dict[int, _UnitState] = {}  # by id of each of its buckets
        self.unit_of: Dict[nn.Module, _UnitState] = {}
        self.chains: List[List[nn.Module]] = []  # each chunk's units, in forward order
        for chunk in chunks:
            chain: List[nn.Module] = list(chunk.sharding_units())
            self.chains.append(chain)
            for module in chain:
                buckets = list({id(by_param[id(p)]): by_param[id(p)]
                                for p in module.parameters()}.values())
                own = [b for b in buckets if id(b) not in self.state]
                if own:  # (else a unit sharing another's parameters: the tied LM head)
                    unit = _UnitState(own)
                    self.state.update((id(b), unit) for b in own)
                self.unit_of[module] = self.state[id(own[0] if own else buckets[0])]
            for i, module in enumerate(chain):
                module.register_forward_pre_hook(self._make_pre_forward(chain, i))
                module.register_forward_hook(self._make_post_forward(chain, i))
        for unit in self.state.values():
            self._free(unit)

    # --- gather / free ------------------------------------------------------------------

    def _start_gather(self, unit: _UnitState, async_op: bool) -> None:
        if unit.gathered or unit.works:
            return
        if self.params_needed is not None:
            self.params_needed(unit.buckets)
        for b in unit.buckets:
            full = b.param_full
            full.untyped_storage().resize_(full.numel() * full.element_size())
            work = comm.all_gather(full, b.param_region, b.group, async_op=async_op)
            if async_op:
                unit.works.append(work)
        unit.gathered = not async_op

    def _ensure(self, unit: _UnitState) -> None:
        if unit.works:
            self._wait(unit)
            unit.gathered = True
        elif not unit.gathered:
            self.exposed_gathers += 1
            self._start_gather(unit, async_op=False)

    @staticmethod
    def _wait(unit: _UnitState) -> None:
        works, unit.works = unit.works, []
        for work in works:
            work.wait()

    def _release(self, unit: _UnitState) -> None:
        """Free `unit` after a use, unless it is held for the next pipeline operation."""
        if unit is not self._held:
            self._free(unit)

    def _free(self, unit: _UnitState) -> None:
        self._wait(unit)
        for b in unit.buckets:
            b.param_full.untyped_storage().resize_(0)
        unit.gathered = False

    # --- across pipeline operations -----------------------------------------------------

    def op_starts(self, op: Op, next_op: Optional[Op]) -> None:
        """The pipeline's F or B `op` starts; `next_op` is the stage's next F or B, None after
        the step's last. The unit held for `op` may be freed again after its use."""
        self._held = None
        self._op_forward = op.kind is F
        self._ahead = None
        if next_op is not None:  # a forward starts with its chunk's first unit, a backward
            chain = self.chains[next_op.chunk]  # with its last
            self._ahead = self.unit_of[chain[0] if next_op.kind is F else chain[-1]]

    def _prefetch_ahead(self, forward: bool) -> None:
        """This operation's fixed point (`forward`: reached in a forward hook): the next
        operation's first unit gathered asynchronously and held for it."""
        if self._op_forward is not forward or self._ahead is None:
            return
        unit, self._ahead = self._ahead, None
        self._start_gather(unit, async_op=True)
        self._held = unit

    def _in_forward(self, unit: _UnitState) -> bool:
        """Whether a forward hook of `unit` runs in a forward, not in a backward's
        recomputation: the pipeline operation says so where one was announced (under a
        zero-bubble schedule a unit stays in backward from its B to its W, and a forward may
        run in between); else the unit's state."""
        return not unit.in_backward if self._op_forward is None else self._op_forward

    # --- hooks --------------------------------------------------------------------------

    def _make_pre_forward(self, chain: List[nn.Module], i: int):
        def hook(module, args):
            unit = self.unit_of[module]
            self._ensure(unit)
            if self.prefetch_after_forward:
                return
            if i + 1 < len(chain) and self._in_forward(unit):
                self._start_gather(self.unit_of[chain[i + 1]], async_op=True)
            elif i + 1 == len(chain):
                self._prefetch_ahead(forward=True)
        return hook

    def _make_post_forward(self, chain: List[nn.Module], i: int):
        last = i == len(chain) - 1

        def hook(module, args, output):
            unit = self.unit_of[module]
            if torch.is_tensor(output) and output.requires_grad:
                output.register_hook(self._make_pre_backward(chain, i))
            if not last and self._in_forward(unit) and self.prefetch_after_forward:
                self._start_gather(self.unit_of[chain[i + 1]], async_op=True)
            elif last and self.prefetch_after_forward:
                self._prefetch_ahead(forward=True)
            if self.reshard_after_forward and not last and not unit.in_backward:
                self._release(unit)
        return hook

    def _make_pre_backward(self, chain: List[nn.Module], i: int):
        def hook(grad):
            unit = self.unit_of[chain[i]]
            self._ensure(unit)
            unit.in_backward = True
            if i > 0:
                self._start_gather(self.unit_of[chain[i - 1]], async_op=True)
            else:
                self._prefetch_ahead(forward=False)
            return grad
        return hook

    def after_backward(self, bucket, micro_batch: int) -> None:
        """The engine's signal: every gradient of `bucket` for `micro_batch` is in (and its
        reduce-scatter launched); the unit is done with that micro-batch when all its buckets
        are. Counted per micro-batch: under a zero-bubble schedule with expert parallelism a
        block's experts' bucket completes in the micro-batch's B (their grouped GEMM computes
        both gradients) and its dense bucket in the deferred W, and the next micro-batch's B
        can come in between — one running count would take that B's expert bucket for the
        dense one still missing and free the unit while the B still reads it."""
        unit = self.state[id(bucket)]
        reported = unit.reported.get(micro_batch, 0) + 1
        if reported < len(unit.buckets):
            unit.reported[micro_batch] = reported
            return
        unit.reported.pop(micro_batch, None)
        unit.in_backward = False
        if self.reshard_after_forward:
            self._release(unit)

    def end_of_step(self) -> None:
        """Free every unit (after the step's last backward, or after a forward-only pass)."""
        self._op_forward = self._ahead = self._held = None
        for unit in self.state.values():
            unit.in_backward = False
            unit.reported.clear()
            if unit.gathered or unit.works:
                self._free(unit)
