"""The live-tensor census the memory plan is held to (`megalite_bench.memory`)."""
from __future__ import annotations

import torch

from megalite_bench.memory import live_storages


class _NoDataPointer(torch.Tensor):
    """A tensor whose storage has no data pointer, as the FakeTensors torchtitan's test
    leaves alive in the process (the full suite's memory-plan tests raised on them)."""

    def untyped_storage(self):
        raise RuntimeError("Cannot access data pointer of Tensor (e.g. FakeTensor)")


def test_tensors_without_memory_are_skipped_and_real_ones_counted():
    from torch._subclasses.fake_tensor import FakeTensorMode

    with FakeTensorMode():
        fake = torch.empty(1024)
    wrapper = torch.Tensor._make_subclass(_NoDataPointer, torch.zeros(8))
    real = torch.ones(4096)
    storages = live_storages()
    assert storages.get(real.untyped_storage().data_ptr()) == real.nbytes
    assert fake is not None and wrapper is not None  # alive during the census
