"""torch.profiler over a window of training steps (`log.profile_steps=[first, last]`, steps as
numbered in metrics.jsonl; Megatron's --profile-step-start/--profile-step-end with its PyTorch
profiler, torchtitan's profiling.*).

Every rank profiles the window and writes, under `<run dir>/profile/`:

    rank00003.json.gz   Chrome trace (chrome://tracing, ui.perfetto.dev): CPU operators, and on
                        CUDA the kernels and NCCL collectives on their streams; each step is
                        a "megalite step N" range
    rank00003.txt       the operators that took the most time (self device time on CUDA,
                        self CPU time otherwise)

The profiled steps run slower than the others (the profiler records every operator); the
export after the last one is left out of the throughput figures.
"""
from __future__ import annotations

import contextlib
import time
from pathlib import Path
from typing import Iterator, Optional, Sequence

import torch
from torch.profiler import ProfilerActivity, profile, record_function

from megalite.utils.log import get_logger

TABLE_ROWS = 30


class StepProfiler:
    def __init__(self, steps: Optional[Sequence[int]], out_dir: Path, rank: int,
                 device: torch.device):
        self.window = (int(steps[0]), int(steps[1])) if steps else None
        self.out_dir, self.rank, self.device = Path(out_dir), rank, device
        self._prof: Optional[profile] = None
        self._export_s = 0.0

    def take_export_seconds(self) -> float:
        """Seconds spent writing results since the last call (to leave out of throughput)."""
        seconds, self._export_s = self._export_s, 0.0
        return seconds

    @contextlib.contextmanager
    def step(self, number: int) -> Iterator[None]:
        """Run optimizer step `number` (1-based), profiled if it is inside the window."""
        if self.window is None or not self.window[0] <= number <= self.window[1]:
            yield
            return
        if self._prof is None:
            cuda = self.device.type == "cuda"
            self._prof = profile(activities=[ProfilerActivity.CPU]
                                 + ([ProfilerActivity.CUDA] if cuda else []))
            self._prof.start()
        with record_function(f"megalite step {number}"):
            yield
        if number == self.window[1]:
            self.close()

    def close(self) -> None:
        """Stop and write the results (also when the run ends inside the window)."""
        if self._prof is None:
            return
        t0 = time.perf_counter()
        if self.device.type == "cuda":
            torch.cuda.synchronize(self.device)
        prof, self._prof = self._prof, None
        prof.stop()
        self.out_dir.mkdir(parents=True, exist_ok=True)
        trace = self.out_dir / f"rank{self.rank:05d}.json.gz"
        prof.export_chrome_trace(str(trace))
        key = "self_cuda_time_total" if self.device.type == "cuda" else "self_cpu_time_total"
        table = self.out_dir / f"rank{self.rank:05d}.txt"
        table.write_text(prof.key_averages().table(sort_by=key, row_limit=TABLE_ROWS,
                                                   max_name_column_width=70))
        get_logger().info(f"profile of steps {self.window[0]}-{self.window[1]} "
                          f"written to {self.out_dir}")
        self._export_s += time.perf_counter() - t0
