"""Activation offload: the tensors autograd saves inside a transformer block go to host memory
in forward and come back in backward (PyTorch's saved-tensor hooks, as in
`torch.autograd.graph.save_on_cpu` and Megatron-Core's activation offloading), overlapping
the copies with compute on CUDA.

Forward, one `saved_tensors_hooks` scope around each offloaded block's call (`BlockChain`):

    pack(t)    t shares the storage of one of the block's parameters (a weight a linear layer
               saves, a ZeRO-3 unit's gathered flat buffer, which is freed after the forward and
               gathered again for the backward) -> kept as it is: only activations move.
               Otherwise t's storage is copied device -> host once (q, k and v are views of one
               qkv storage: one copy, three handles), on CUDA into pinned memory on a side
               stream that first waits for the compute stream; the block keeps the device
               storage until its forward ends, then lets it go with `record_stream`, so the
               allocator reuses it only after the copy has read it.
Backward (autograd unpacks a block's tensors as its nodes run, last block first):

    unpack(h)  at the block's first unpack every storage of the block goes host -> device on
               the side stream, and so does the previous block of the same forward (the next
               one backward: a prefetch that overlaps this block's backward); the compute stream
               waits for the copies' event. A storage's device copy is let go once every view
               of it was unpacked (autograd holds it from then on, as long as it needs it).

A block's host copies live as long as autograd holds one of its handles (until its backward
ran, or the graph is dropped). `ActivationOffload.held_bytes` counts them; the metrics report
the peak per step. On CPU host = device: the same path runs (copies into separate CPU tensors,
no streams) and saves nothing.

Which blocks: with `offload.activations_layers=N` the first N blocks of each model chunk that
are not recomputed (`offloaded_blocks`); a recomputed block keeps only its input and re-runs
its forward in backward, so it has nothing worth moving.
"""
from __future__ import annotations

import contextlib
import weakref
from dataclasses import dataclass
from typing import Dict, Iterator, List, Optional

import torch
import torch.nn as nn


def offloaded_blocks(blocks: int, recomputed: int, limit: Optional[int]) -> range:
    """Local indices of a chunk's blocks whose saved tensors are offloaded: after the
    `recomputed` first ones (train.recompute_layers), the next `limit` (all when None)."""
    stop = blocks if limit is None else min(blocks, recomputed + limit)
    return range(recomputed, max(recomputed, stop))


class ActivationOffload:
    """One rank's activation offload: the copy stream (CUDA) and the host bytes held, shared by
    every model chunk of the stage (interleaved chunks and 1F1B's micro-batches in flight all
    count against the same host memory)."""

    def __init__(self, device: torch.device, layers: Optional[int] = None):
        self.device = torch.device(device)
        self.layers = layers  # offload.activations_layers
        self.cuda = self.device.type == "cuda"
        self.stream = torch.cuda.Stream(self.device) if self.cuda else None
        self.held_bytes = 0  # host bytes of the blocks autograd still holds
        self.peak_bytes = 0  # most held since the last `take_peak`
        self.offloaded_tensors = 0  # saved tensors moved to host (counted at pack)
        self.kept_tensors = 0  # saved tensors left in place: parameters, other devices

    def chain(self) -> "BlockChain":
        """The offloaded blocks of one forward of a chunk (one micro-batch)."""
        return BlockChain(self)

    def take_peak(self) -> int:
        """The most host bytes held since the last call (the metrics' per-interval peak)."""
        peak, self.peak_bytes = self.peak_bytes, self.held_bytes
        return peak

    def _hold(self, nbytes: int) -> None:
        self.held_bytes += nbytes
        self.peak_bytes = max(self.peak_bytes, self.held_bytes)

    def _release(self, nbytes: int) -> None:
        self.held_bytes -= nbytes


class BlockChain:
    """The blocks one forward of a model chunk offloads, in order: backward visits them in
    reverse, so the block before the one being restored is the one to prefetch."""

    def __init__(self, offload: ActivationOffload):
        self.offload = offload
        self.last: Optional[_SavedBlock] = None

    @contextlib.contextmanager
    def block(self, module: nn.Module) -> Iterator[None]:
        """Offload what autograd saves while `module` runs forward."""
        record = _SavedBlock(self.offload, module, self.last)
        self.last = record
        try:
            with torch.autograd.graph.saved_tensors_hooks(record.pack, _unpack):
                yield
        finally:
            record.forward_done()


@dataclass
class _Slot:
    """One offloaded storage: its host copy and, while restored, its device copy."""

    host: torch.Tensor  # uint8 [nbytes]
    users: int = 0  # handles (views) packed into it
    unpacked: int = 0  # handles unpacked since it was last restored
    consumed: bool = False  # every handle unpacked: autograd holds the device copy
    device: Optional[torch.Tensor] = None


@dataclass(frozen=True, eq=False)
class _Handle:
    """What autograd keeps for one saved tensor: where its bytes are and how to view them."""

    block: "_SavedBlock"
    slot: int
    dtype: torch.dtype
    size: torch.Size
    stride: tuple
    offset: int


def _unpack(packed):
    return packed.block.unpack(packed) if isinstance(packed, _Handle) else packed


def _storage_bytes(t: torch.Tensor) -> torch.Tensor:
    """A uint8 tensor over the whole storage of `t`."""
    return torch.empty(0, dtype=torch.uint8, device=t.device).set_(t.untyped_storage())


class _SavedBlock:
    """The tensors one block saved in one forward, on the host."""

    def __init__(self, offload: ActivationOffload, module: nn.Module,
                 previous: Optional["_SavedBlock"]):
        self.offload = offload
        self.param_storages = {p.untyped_storage()._cdata for p in module.parameters()}
        self.previous = weakref.ref(previous) if previous is not None else None
        self.slots: List[_Slot] = []
        self.by_storage: Dict[int, int] = {}  # forward only: storage -> slot
        self.in_transit: List[torch.Tensor] = []  # forward only: the device storages copied
        self.host_bytes = 0
        self.restored: Optional[torch.cuda.Event] = None
        self.prefetched_previous = False

    # --- forward ------------------------------------------------------------------------

    def pack(self, t: torch.Tensor):
        offload = self.offload
        storage = t.untyped_storage()
        if (isinstance(t, nn.Parameter) or storage._cdata in self.param_storages
                or t.device.type != offload.device.type):
            offload.kept_tensors += 1
            return t
        index = self.by_storage.get(storage._cdata)
        if index is None:
            index = self.by_storage[storage._cdata] = len(self.slots)
            self.slots.append(_Slot(self._copy_out(t)))
        self.slots[index].users += 1
        offload.offloaded_tensors += 1
        return _Handle(self, index, t.dtype, t.size(), t.stride(), t.storage_offset())

    def _copy_out(self, t: torch.Tensor) -> torch.Tensor:
        """The host copy of t's storage (started; on CUDA complete in stream order)."""
        src = _storage_bytes(t)
        offload = self.offload
        if offload.cuda:
            host = torch.empty(src.numel(), dtype=torch.uint8, pin_memory=True)
            offload.stream.wait_stream(torch.cuda.current_stream(offload.device))
            with torch.cuda.stream(offload.stream):
                host.copy_(src, non_blocking=True)
        else:
            host = src.clone()
        self.in_transit.append(src)  # also keeps the storage's identity (the key) unique
        self.host_bytes += host.numel()
        offload._hold(host.numel())
        return host

    def forward_done(self) -> None:
        """The block's forward ended: its device storages may go once copied."""
        if self.offload.cuda:
            for src in self.in_transit:
                src.record_stream(self.offload.stream)
        self.in_transit.clear()
        self.by_storage.clear()

    # --- backward -----------------------------------------------------------------------

    def unpack(self, h: _Handle) -> torch.Tensor:
        slot = self.slots[h.slot]
        if slot.consumed:  # a second backward through the graph (retain_graph=True)
            for other in self.slots:
                other.consumed = False
        self.restore()
        if not self.prefetched_previous:
            self.prefetched_previous = True
            previous = self.previous() if self.previous is not None else None
            if previous is not None:
                previous.restore()
        data = slot.device
        if self.offload.cuda:
            current = torch.cuda.current_stream(self.offload.device)
            current.wait_event(self.restored)
            data.record_stream(current)
        slot.unpacked += 1
        if slot.unpacked == slot.users:  # every view handed out: autograd holds it now
            slot.device, slot.unpacked, slot.consumed = None, 0, True
        whole = data[:data.numel() - data.numel() % h.dtype.itemsize].view(h.dtype)
        return whole.as_strided(h.size, h.stride, h.offset)

    def restore(self) -> None:
        """Start the host -> device copies of the slots not on the device and not yet
        consumed by this backward (side stream)."""
        missing = [s for s in self.slots if s.device is None and not s.consumed]
        if not missing:
            return
        offload = self.offload
        if not offload.cuda:
            for slot in missing:
                slot.device = slot.host.clone()
            return
        with torch.cuda.stream(offload.stream):
            for slot in missing:
                slot.device = torch.empty_like(slot.host, device=offload.device)
                slot.device.copy_(slot.host, non_blocking=True)
            self.restored = offload.stream.record_event()

    def __del__(self):
        self.offload._release(self.host_bytes)
