"""The hang watch against a stuck CUDA stream (needs one CUDA GPU; skipped without): rank 0 holds
its tensor on the GPU, rank 1 on the CPU, over gloo (which carries CUDA tensors for all-reduce).
Rank 0's stream is stuck in a kernel (`torch.cuda._sleep`) when its host launches an
asynchronous all-reduce, and its host then blocks in a CUDA synchronisation (`.item()`), not in
a wait: NCCL's semantics on one GPU. Rank 1's all-reduce is not complete after
resilience.hang_after_s: every rank dumps, and the summary names rank 0, whose host launched the
all-reduce but whose device has not arrived at it (the arrival event recorded before the
launch has not fired). The kernel ends, the all-reduce completes, the dumps become live ones.

    python -m pytest -q tests/integration/resilience/test_cuda_hang.py     # on a machine with a GPU

What this does not cover: NCCL between ranks (one GPU cannot run it)."""
from __future__ import annotations

import json
import time
from pathlib import Path

import pytest
import torch

from megalite.testing.spawn import run_ranks
from tests.unit.resilience.test_hang import wait_for

STUCK_S = 8.0  # how long rank 0's stream is stuck in a kernel
HANG_AFTER_S = 1.0


def _cycles_per_second() -> float:
    """`torch.cuda._sleep` spins for clock cycles: how many make a second on this GPU."""
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    cycles = 100_000_000
    start.record()
    torch.cuda._sleep(cycles)
    end.record()
    end.synchronize()
    return cycles / (start.elapsed_time(end) / 1e3)


def _stuck_stream(rank, world, run_dir):
    from megalite.parallel import comm
    from megalite.parallel.topology import build_topology
    from megalite.resilience.flight import FlightRecorder
    from megalite.resilience.hang import HangWatch
    from megalite.resilience.hang_store import default_store

    device = torch.device("cuda", 0) if rank == 0 else torch.device("cpu")
    if rank == 0:
        torch.cuda.set_device(0)
        cycles = int(_cycles_per_second() * STUCK_S)
    topo = build_topology(1, 1, 2)  # dp 2 over the harness's gloo
    recorder = FlightRecorder(rank, 32, hang_after_s=HANG_AFTER_S)
    topo.counter.flight = recorder
    hang = Path(run_dir) / "hang"
    watch = HangWatch(recorder, Path(run_dir), rank, world, wait_s=3.0, signal_name=None,
                      store=default_store())
    seen, t0 = None, time.monotonic()
    with watch:
        t = torch.ones(4, device=device)
        if rank == 0:
            torch.cuda._sleep(cycles)  # the stuck stream (the fault, in this rank only)
        work = comm.all_reduce(t, topo.dp_group, async_op=True)
        if rank == 0:
            t.sum().item()  # the host blocks in a CUDA synchronisation, outside any wait
            work.wait()
            torch.cuda.synchronize()
        else:
            wait_for((hang / "summary.json").exists, "no summary", 60)
            seen = json.loads((hang / "summary.json").read_text())
            work.wait()
        wait_for(lambda: (hang / "live" / f"rank{rank:05d}.json").exists()
                 and not (hang / f"rank{rank:05d}.json").exists(), "not a live dump", 60)
    return {"seen": seen, "sum": t.tolist(), "seconds": time.monotonic() - t0}


@pytest.mark.distributed
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
def test_a_stuck_cuda_stream_is_named_though_its_host_launched(tmp_path):
    res = run_ranks(_stuck_stream, 2, args=(str(tmp_path),), timeout_s=120)
    seen = res[1]["seen"]
    assert seen["request"]["kind"] == "stuck" and seen["request"]["rank"] == 1, seen["request"]
    assert seen["did_not_arrive"] == [0], seen
    (wait,) = [w for w in seen["waits"] if w["behind"]]
    assert wait["rank"] == 1 and wait["behind"] == {"0": 0} and wait["launched"] == {"0": 1}
    text = (tmp_path / "hang" / "live" / "summary.txt").read_text()
    assert "rank 0 (launched 1 there, its device at 0)" in text, text
    assert res[0]["sum"] == res[1]["sum"] == [2.0] * 4  # it completed after all
    assert res[0]["seconds"] >= STUCK_S - 1
