"""Host memory allocated as counted (`megalite.parallel.host_arena`): the offloaded optimizer
state of a rank is one allocation sliced into its ranges' buffers at ALIGN-byte offsets, and
what the rank holds is the plan's host bytes; pinned memory is registered in whole pages of its
own (the driver's calls faked here, on CPU: the CUDA tests pin for real) and the activation
offload's pool reuses a buffer by its size in pages, after its last holder's copies."""
from __future__ import annotations

from unittest import mock

import pytest
import torch

from megalite.config.schema import ModelConfig, OptimConfig
from megalite.parallel import host_arena
from megalite.parallel.host_arena import ALIGN, PAGE, HostArena, PinnedPool, arena_offsets

PARTS = [(3, torch.float32), (5, torch.bfloat16), (17, torch.float32), (1, torch.float16)]


def test_arena_slices_are_aligned_disjoint_views_of_one_buffer():
    offsets, total = arena_offsets(PARTS)
    ends = [o + n * d.itemsize for o, (n, d) in zip(offsets, PARTS)]
    assert offsets[0] == 0 and all(o % ALIGN == 0 for o in offsets)
    assert all(e <= o for e, o in zip(ends, offsets[1:]))  # in order, none overlapping
    assert all(o - e < ALIGN for e, o in zip(ends, offsets[1:]))  # no gap beyond alignment
    assert total == ends[-1]
    arena = HostArena(PARTS, pinned=False, device=torch.device("cpu"))
    assert arena.nbytes == total == arena.buffer.numel()
    base = arena.buffer.data_ptr()
    for i, (numel, dtype) in enumerate(PARTS):
        t = arena.tensor(i)
        assert (t.numel(), t.dtype) == (numel, dtype) and not t.any()
        assert t.untyped_storage().data_ptr() == arena.buffer.untyped_storage().data_ptr()
        assert t.data_ptr() - base == offsets[i]
        t.fill_(i + 1)
    assert [arena.tensor(i).unique().tolist() for i in range(len(PARTS))] == \
        [[i + 1] for i in range(len(PARTS))]  # writing one slice touched no other


class FakeDriver:
    """torch.cuda.cudart() (and torch.cuda.synchronize) on a CPU machine: records the ranges
    registered and unregistered, and whether the device was synchronized before each
    unregistration (a copy may still be using the pages)."""

    def __init__(self):
        self.registered, self.unregistered = {}, []
        self.synced, self.synced_first = False, []

    def synchronize(self):
        self.synced = True

    def cudaHostRegister(self, ptr, nbytes, flags):
        self.registered[ptr] = nbytes
        return 0

    def cudaHostUnregister(self, ptr):
        self.unregistered.append(ptr)
        self.synced_first.append(self.synced)
        self.synced = False
        return 0


@pytest.fixture
def driver():
    fake = FakeDriver()
    with mock.patch.object(torch.cuda, "cudart", lambda: fake), \
            mock.patch.object(torch.cuda, "synchronize", fake.synchronize):
        yield fake


def test_a_pinned_arena_registers_whole_pages_of_its_own_once(driver):
    arena = HostArena(PARTS, pinned=True, device=torch.device("cpu"))
    ((ptr, nbytes),) = driver.registered.items()
    assert ptr == arena.buffer.data_ptr() and ptr % PAGE == 0
    assert nbytes == host_arena.round_up(arena.nbytes, PAGE)
    raw = arena.buffer.untyped_storage()  # the registered pages lie inside the allocation
    assert raw.data_ptr() <= ptr and ptr + nbytes <= raw.data_ptr() + raw.nbytes()
    assert not arena.buffer.any()
    del arena
    assert driver.unregistered == [ptr] and driver.synced_first == [True]


def test_the_pool_reuses_a_buffer_by_its_pages_after_its_holders_copies(driver):
    pool = PinnedPool()
    a, after = pool.take(PAGE + 5)
    assert after == [] and a.numel() == PAGE + 5 and a.data_ptr() % PAGE == 0
    b, _ = pool.take(PAGE + 5)  # `a` is held: a second buffer
    assert b.data_ptr() != a.data_ptr() and pool.reserved == 2 * 2 * PAGE
    events = ["a's copy out", "a's restore"]
    pool.give(a, events)
    c, after = pool.take(2 * PAGE)  # the same pages: `a`'s buffer, after its copies
    assert c.data_ptr() == a.data_ptr() and c.numel() == 2 * PAGE and after == events
    d, _ = pool.take(10)  # one page: a new buffer
    assert pool.reserved == 2 * 2 * PAGE + PAGE == sum(driver.registered.values())
    registered = set(driver.registered)
    del pool, a, b, c, d
    assert set(driver.unregistered) == registered


def _offload_engine(fraction: float, zero: int, precision: str):
    from megalite.config.layout import Layout
    from megalite.model.gpt2.stage import GPT2
    from megalite.parallel.topology import build_topology
    from megalite.parallel.zero import ZeroEngine

    cfg = ModelConfig(n_layer=2, n_embd=64, n_head=4, n_positions=32, vocab_size=100)
    topo = build_topology(1, 1, 1)
    model = GPT2(cfg, topo.tp_group)
    layout = Layout.of(topo, precision=precision, zero_stage=zero)
    return ZeroEngine(model, topo, layout, OptimConfig(), bucket_mb=0.01,
                      offload_optimizer=fraction)


@pytest.mark.parametrize("zero,precision", [(1, "fp32"), (2, "bf16")])
def test_every_range_is_a_view_into_the_ranks_one_arena(zero, precision):
    """zero 1 fp32 (master, gradient) and zero 2 bf16 (+ copy staging, + the bf16 cast): every
    host buffer of every range is a slice of the one arena, none overlapping; the offload's
    host bytes are the arena's and the moments, the plan's formula within the alignment."""
    engine = _offload_engine(0.5, zero, precision)
    offload = engine.offload
    assert len(offload.ranges) > 1
    arena = offload.arena.buffer
    lo, hi = arena.data_ptr(), arena.data_ptr() + arena.numel()
    spans = []
    for r in offload.ranges.values():
        buffers = {id(t): t for t in (r.main, r.grad, r.staging, r.cast) if t is not None}
        assert len(buffers) == (2 if zero == 1 else 3) + (precision != "fp32")
        for t in buffers.values():
            assert t.untyped_storage().data_ptr() == arena.untyped_storage().data_ptr()
            assert lo <= t.data_ptr() and t.data_ptr() + t.numel() * t.element_size() <= hi
            spans.append((t.data_ptr(), t.data_ptr() + t.numel() * t.element_size()))
    spans.sort()
    assert all(end <= start for (_, end), (start, _) in zip(spans, spans[1:]))
    n = sum(r.main.numel() for r in offload.ranges.values())
    counted = (16 + (4 if zero >= 2 else 0) + (2 if precision == "bf16" else 0)) * n
    assert counted <= offload.host_bytes() < counted + ALIGN * len(spans)
