"""Small CUDA-only branches, one GPU, one process: the RNG streams on the GPU's generator, the
collective waits timed with CUDA events, the device table's entry for this GPU, a command's
default device. (The larger ones have their own files; tests/unit/project/cuda_branches.py
maps every CUDA-only branch of megalite/ to its test.) Skipped without a GPU;
`megalite-bench gpu`'s cuda-tests part runs it. Written against CUDA semantics; not yet run on
a GPU."""
from __future__ import annotations

import time

import pytest
import torch

pytestmark = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")


def test_the_rng_streams_live_on_the_gpus_generator():
    """The replicated stream is the CUDA generator's state (the CPU's untouched), the TP
    stream another; a saved state restores both streams' draws."""
    from megalite.parallel.rng import RNGTracker

    device = torch.device("cuda")
    cpu_before = torch.get_rng_state()
    rng = RNGTracker(7, 1, 0, 0, device)
    assert torch.equal(torch.get_rng_state(), cpu_before)
    saved = rng.state_dict()
    assert torch.equal(saved["replicated"], torch.cuda.get_rng_state(device))
    first = torch.rand(8, device=device)
    with rng.tp_region():
        tp = torch.rand(8, device=device)
    assert not torch.equal(first, tp)
    rng.load_state_dict(saved)
    assert torch.equal(torch.rand(8, device=device), first)
    with rng.tp_region():
        assert torch.equal(torch.rand(8, device=device), tp)  # both streams restored


def test_collective_waits_are_the_streams_stall():
    """On CUDA a wait is a pair of events on the current stream: a kernel queued inside it
    counts (the stream's time), resolved only by `between`."""
    from megalite.parallel.group import CollectiveWaits
    from megalite.utils.clock import DeviceClock

    clock = DeviceClock(torch.device("cuda"))
    waits = CollectiveWaits(clock)
    assert clock.cuda
    cycles = _cycles_per_ms()
    start = waits.position()
    waits.timed(lambda: torch.cuda._sleep(50 * cycles))  # 50 ms on the stream
    end = waits.position()
    assert (start, end) == (0, 1) and waits.calls == 1
    assert 0.03 < waits.between(start, end) < 0.5


def _cycles_per_ms() -> int:
    torch.cuda.synchronize()
    t0 = time.perf_counter()
    torch.cuda._sleep(10**7)
    torch.cuda.synchronize()
    return int(10**7 / ((time.perf_counter() - t0) * 1e3))


def test_the_link_checks_table_entry_is_this_gpus():
    from megalite.plan.link_check import table_for

    entry = table_for(torch.device("cuda", 0))  # None: a GPU the table does not know
    assert entry is None or entry.name != "cpu"


def test_a_single_process_command_defaults_to_the_gpu():
    from megalite.utils.device import default_device

    assert default_device() == "cuda"


def test_an_fp8_runs_peak_is_read_for_this_gpu():
    from megalite.train.metrics import fp8_peak

    got = fp8_peak("tensorwise", torch.device("cuda"))
    name = torch.cuda.get_device_name()
    assert got["recipe"] == "tensorwise" and name in got["source"]
    assert (got["peak_tflops_fp8"] is None) == got["source"].startswith("no FP8 peak")
