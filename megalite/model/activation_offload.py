"""Activation offload: the tensors autograd saves inside a transformer block go to host memory
in forward and come back in backward (PyTorch's saved-tensor hooks, as in
`torch.autograd.graph.save_on_cpu` and Megatron-Core's activation offloading), overlapping
the copies with compute on CUDA — each direction on a stream of its own, so a block's copy
out and another block's copy back share the link at once (PCIe is full duplex).

Every block of a chunk's forward runs through one `BlockChain`, which knows which of them are
offloaded (`offloaded_blocks`) and which keep their activations on the device:

    pack(t)    (an offloaded block's forward) t shares the storage of one of the block's
               parameters (a weight a linear layer saves, a ZeRO-3 unit's gathered flat
               buffer, which is freed after the forward and gathered again for the backward)
               -> kept as it is: only activations move. Otherwise t's storage is copied
               device -> host once (q, k and v are views of one qkv storage: one copy, three
               handles), on CUDA into pinned memory on the device -> host stream, which first
               waits for the compute stream (a buffer of the rank's `PinnedPool`, pinned at
               its size in pages and reused once its last holder's copies are done, where
               torch's pinned allocator would round it up to a power of two); the block keeps
               the device storage until its forward ends, then lets it go with
               `record_stream`, and records the event of its copies out
    reached(j) (a hook on the gradient of block j's output: block j's backward is about to
               start, every block after it is done) the blocks after j let their restored
               storages go from the count; then the offloaded blocks up to j not yet back
               are restored, last first, as far as the budget below allows (a prefetch: the
               first offloaded block's copies start as soon as memory allows, under the
               backward of the blocks after it)
    unpack(h)  (autograd, during block j's backward) block j is restored if it is not yet —
               whatever the budget says, after waiting for older copies out to make room —
               and the compute stream waits for its restore's event. A restore allocates its
               storages on the compute stream (so they return to memory the compute stream
               reuses), orders the host -> device stream after the compute stream's work so
               far and after the block's own copies out, and copies. A storage's device copy
               is let go once every view of it was unpacked (autograd holds it from then on)

The budget, in blocks of activations on the device beyond those the plan counts as kept
there: at most IN_TRANSIT (2: the plan's "layers in transit", `megalite.plan.memory`) blocks
being copied out or restored at once, plus the room of the chunk's own non-offloaded blocks —
before block j's forward, those not yet run (their memory is not used yet); at block j in the
backward, those whose backward is done (their memory is free again). So the activations on
the device never exceed the plan's: the non-offloaded blocks' + IN_TRANSIT, and a chunk whose
first blocks are offloaded (`offload.activations_layers`) copies them out under the forward of
the later blocks and back under their backward without a wait. The forward enforces the budget
by waiting on the CPU for the oldest copies out (the caching allocator frees their storages
once it sees them done); the backward's prefetch stops where the budget ends.

A block's host copies live as long as autograd holds one of its handles (until its backward
ran, or the graph is dropped). `ActivationOffload.held_bytes` counts them; the metrics report
the peak per step. On CPU host = device: the same path runs (copies into separate CPU tensors,
no streams, no copy is ever pending) and saves nothing.

Which blocks: with `offload.activations_layers=N` the first N blocks of each model chunk that
are not recomputed (`offloaded_blocks`); a recomputed block keeps only its input and re-runs
its forward in backward, so it has nothing worth moving.
"""
from __future__ import annotations

import contextlib
import weakref
from collections import deque
from dataclasses import dataclass
from typing import Deque, Dict, Iterator, List, Optional, Sequence

import torch
import torch.nn as nn

from megalite.parallel.host_arena import PinnedPool

IN_TRANSIT = 2  # offloaded blocks' activations on the device at once beyond the kept ones


def offloaded_blocks(blocks: int, recomputed: int, limit: Optional[int]) -> range:
    """Local indices of a chunk's blocks whose saved tensors are offloaded: after the
    `recomputed` first ones (train.recompute_layers), the next `limit` (all when None)."""
    stop = blocks if limit is None else min(blocks, recomputed + limit)
    return range(recomputed, max(recomputed, stop))


class ActivationOffload:
    """One rank's activation offload: the copy streams (CUDA), the blocks in transit and the
    host bytes held, shared by every model chunk of the stage (interleaved chunks and 1F1B's
    micro-batches in flight all count against the same device and host memory)."""

    def __init__(self, device: torch.device, layers: Optional[int] = None):
        self.device = torch.device(device)
        self.layers = layers  # offload.activations_layers
        self.cuda = self.device.type == "cuda"
        self.d2h = torch.cuda.Stream(self.device) if self.cuda else None  # copies out
        self.h2d = torch.cuda.Stream(self.device) if self.cuda else None  # restores
        self.pool = PinnedPool() if self.cuda else None  # the host copies' pinned buffers
        self.leaving: Deque = deque()  # events of blocks' copies out, oldest first
        self.restored = 0  # blocks restored whose backward has not been passed yet
        self.held_bytes = 0  # host bytes of the blocks autograd still holds
        self.peak_bytes = 0  # most held since the last `take_peak`
        self.offloaded_tensors = 0  # saved tensors moved to host (counted at pack)
        self.kept_tensors = 0  # saved tensors left in place: parameters, other devices
        self.waits_for_room = 0  # times the CPU waited for a copy out to make room

    def chain(self, offloaded: Optional[Sequence[int]] = None,
              blocks: Optional[int] = None) -> "BlockChain":
        """The blocks of one forward of a chunk (one micro-batch): `offloaded`, the local
        indices of the `blocks` whose activations go to the host (None: only the modules
        given to `BlockChain.block`, with no room from other blocks)."""
        return BlockChain(self, offloaded, blocks)

    def take_peak(self) -> int:
        """The most host bytes held since the last call (the metrics' per-interval peak)."""
        peak, self.peak_bytes = self.peak_bytes, self.held_bytes
        return peak

    def _hold(self, nbytes: int) -> None:
        self.held_bytes += nbytes
        self.peak_bytes = max(self.peak_bytes, self.held_bytes)

    def _release(self, nbytes: int) -> None:
        self.held_bytes -= nbytes

    # --- the budget of blocks in transit --------------------------------------------------

    def _copied_out_event(self):
        """The event after the current block's copies out (CUDA; None on CPU: done)."""
        return self.d2h.record_event() if self.cuda else None

    def leaving_blocks(self) -> int:
        """Blocks whose copies out may still run (those seen complete are dropped)."""
        while self.leaving and self.leaving[0].query():
            self.leaving.popleft()
        return len(self.leaving)

    def in_transit(self) -> int:
        """Offloaded blocks with activations on the device: being copied out or restored."""
        return self.leaving_blocks() + self.restored

    def make_room(self, allowed: int) -> None:
        """The CPU waits for the oldest copies out until at most `allowed` blocks are in
        transit (or none is still leaving)."""
        while self.in_transit() > allowed and self.leaving:
            self.waits_for_room += 1
            self.leaving.popleft().synchronize()


class BlockChain:
    """The blocks of one forward of a model chunk, in order: backward visits them in reverse.
    Held by its saved blocks (so it lives while autograd holds any of their tensors); the
    hooks on the graph hold it weakly."""

    def __init__(self, offload: ActivationOffload, offloaded: Optional[Sequence[int]],
                 blocks: Optional[int]):
        self.offload = offload
        self.offloaded = None if offloaded is None else set(offloaded)
        self.blocks = blocks
        self.saved: Dict[int, weakref.ref] = {}  # index -> its _SavedBlock
        self.last_index = -1  # `block()` without an index: numbered in order
        self.input_hooked = False

    def kept_from(self, index: int) -> int:
        """Non-offloaded blocks of the chunk with a local index >= `index`."""
        if self.offloaded is None or self.blocks is None:
            return 0
        return sum(1 for i in range(max(0, index), self.blocks) if i not in self.offloaded)

    def run(self, index: int, module: nn.Module, x: torch.Tensor, *args) -> torch.Tensor:
        """Block `index`'s forward: offloaded or not, within the budget of blocks in transit,
        with the backward's hooks on its input (the first) and output."""
        if not self.input_hooked and x.requires_grad:
            self.input_hooked = True  # fires once the first block's backward is done
            x.register_hook(self._hook(index - 1))
        self.offload.make_room(IN_TRANSIT - 1 + self.kept_from(index))
        if self.offloaded is not None and index in self.offloaded:
            with self.block(module, index):
                out = module(x, *args)
        else:
            out = module(x, *args)
        if out.requires_grad:
            out.register_hook(self._hook(index))
        return out

    @contextlib.contextmanager
    def block(self, module: nn.Module, index: Optional[int] = None) -> Iterator[None]:
        """Offload what autograd saves while `module` (block `index`) runs forward."""
        index = self.last_index + 1 if index is None else index
        self.last_index = index
        record = _SavedBlock(self.offload, module, self, index)
        self.saved[index] = weakref.ref(record)
        try:
            with torch.autograd.graph.saved_tensors_hooks(record.pack, _unpack):
                yield
        finally:
            record.forward_done()

    def _hook(self, index: int):
        chain = weakref.ref(self)

        def hook(grad: torch.Tensor) -> None:
            live = chain()
            if live is not None:
                live.reached(index)
        return hook

    def reached(self, index: int) -> None:
        """The backward reached block `index` (every block after it is done): their restored
        storages leave the count; the offloaded blocks up to `index` come back, last first,
        as far as the budget goes."""
        for i, ref in self.saved.items():
            record = ref()
            if i > index and record is not None:
                record.passed()
        self.prefetch(index)

    def prefetch(self, index: int) -> None:
        """Restore the offloaded blocks up to `index` not yet back, last first, while fewer
        than IN_TRANSIT + the chunk's non-offloaded blocks after `index` are in transit."""
        offload = self.offload
        room = IN_TRANSIT + self.kept_from(index + 1) - offload.in_transit()
        for i in sorted((i for i in self.saved if i <= index), reverse=True):
            record = self.saved[i]()
            if record is None or record.back:
                continue
            if room <= 0:
                return
            record.restore()
            room -= 1


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

    def __init__(self, offload: ActivationOffload, module: nn.Module, chain: BlockChain,
                 index: int):
        self.offload, self.chain, self.index = offload, chain, index
        self.param_storages = {p.untyped_storage()._cdata for p in module.parameters()}
        self.slots: List[_Slot] = []
        self.by_storage: Dict[int, int] = {}  # forward only: storage -> slot
        self.in_transit: List[torch.Tensor] = []  # forward only: the device storages copied
        self.host_bytes = 0
        self.copied_out = None  # CUDA: the event after this block's copies out
        self.restored: Optional[torch.cuda.Event] = None
        self.counted = False  # restored and in the offload's count of blocks in transit

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
        """The host copy of t's storage (started; on CUDA complete in the d2h stream's order)."""
        src = _storage_bytes(t)
        offload = self.offload
        if offload.cuda:
            host, after = offload.pool.take(src.numel())
            offload.d2h.wait_stream(torch.cuda.current_stream(offload.device))
            for event in after:  # the buffer's last holder's copies are done with it
                offload.d2h.wait_event(event)
            with torch.cuda.stream(offload.d2h):
                host.copy_(src, non_blocking=True)
        else:
            host = src.clone()
        self.in_transit.append(src)  # also keeps the storage's identity (the key) unique
        self.host_bytes += host.numel()
        offload._hold(host.numel())
        return host

    def forward_done(self) -> None:
        """The block's forward ended: its device storages may go once copied."""
        offload = self.offload
        if offload.cuda:
            for src in self.in_transit:
                src.record_stream(offload.d2h)
        if self.slots:
            self.copied_out = offload._copied_out_event()
            if self.copied_out is not None:
                offload.leaving.append(self.copied_out)
        self.in_transit.clear()
        self.by_storage.clear()

    # --- backward -----------------------------------------------------------------------

    @property
    def back(self) -> bool:
        """Restored already (or every storage consumed by this backward)."""
        return all(s.device is not None or s.consumed for s in self.slots)

    def unpack(self, h: _Handle) -> torch.Tensor:
        slot = self.slots[h.slot]
        if slot.consumed:  # a second backward through the graph (retain_graph=True)
            for other in self.slots:
                other.consumed = False
        if not self.back:  # not prefetched: now, once older copies out made room
            self.offload.make_room(IN_TRANSIT - 1 + self.chain.kept_from(self.index + 1))
            self.restore()
            self.chain.prefetch(self.index - 1)
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
        consumed by this backward (the h2d stream; storages allocated on the compute
        stream)."""
        missing = [s for s in self.slots if s.device is None and not s.consumed]
        if not missing:
            return
        offload = self.offload
        if not self.counted:
            self.counted = True
            offload.restored += 1
        if not offload.cuda:
            for slot in missing:
                slot.device = slot.host.clone()
            return
        compute = torch.cuda.current_stream(offload.device)
        for slot in missing:  # the compute stream's memory: it returns there when freed
            slot.device = torch.empty_like(slot.host, device=offload.device)
        offload.h2d.wait_stream(compute)  # whatever used that memory before is done
        if self.copied_out is not None:
            offload.h2d.wait_event(self.copied_out)  # the host copies are complete
        with torch.cuda.stream(offload.h2d):
            for slot in missing:
                slot.device.copy_(slot.host, non_blocking=True)
            self.restored = offload.h2d.record_event()
        for slot in missing:  # not reused before the copy wrote it, even if never read
            slot.device.record_stream(offload.h2d)

    def passed(self) -> None:
        """The backward is past this block: its restored storages leave the count."""
        if self.counted:
            self.counted = False
            self.offload.restored -= 1

    def __del__(self):
        self.passed()
        self.offload._release(self.host_bytes)
        if self.offload.cuda:  # the host copies back to the pool, after their last uses
            after = [e for e in (self.copied_out, self.restored) if e is not None]
            for slot in self.slots:
                self.offload.pool.give(slot.host, after)
