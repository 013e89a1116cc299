"""Checkpoint saves that do not stop training (torchtitan's `checkpoint.async_mode`).

A save in the training thread holds every rank for as long as the slowest rank takes to write
its share and fsync it. With `checkpoint.async_save=true` the training thread only takes a
snapshot: it copies the rank's pieces (fp32 master weights and AdamW moments, the part this
rank writes) into a host staging buffer (pinned memory on CUDA, allocated at start-up and
reused from save to save),
and a background thread writes, fsyncs and publishes them while the next steps run. The
publication protocol is the one of `megalite.checkpoint.save.write_snapshot`: rank 0 renames
`step_N.tmp/` to `step_N/` only after every rank reported its files written, so a crash
during a background save leaves an unfinished directory that is never picked.

The background thread's collectives (a barrier, the gather of the piece index, the verdict)
run over their own gloo process group spanning the world (`Topology.checkpoint_group`), so
they never interleave with the training thread's collectives on the other groups. One save is
in flight at a time: a save first waits for the previous one, and its error (if any) is raised
there, in the training thread, on every rank. The cost is host memory: one copy of the
rank's written state, 12 bytes per parameter it owns.
"""
from __future__ import annotations

from concurrent.futures import Future, ThreadPoolExecutor
from pathlib import Path
from typing import Optional

import torch

from megalite.checkpoint import save as ckpt
from megalite.checkpoint.state import SavedState
from megalite.config.schema import Config
from megalite.parallel.topology import Topology


def _host_buffer(numel: int, pinned: bool) -> torch.Tensor:
    """A flat fp32 host buffer, its pages touched now rather than during the first save.
    `pinned` (CUDA) registers exactly these pages with the driver (`cudaHostRegister`, as
    `torch.distributed.checkpoint` does for its staging), where `pin_memory()` would round the
    allocation up to a power of two."""
    buf = torch.zeros(numel, dtype=torch.float32)
    if pinned and numel:
        err = int(torch.cuda.cudart().cudaHostRegister(buf.data_ptr(), numel * 4, 0))
        if err != 0:
            raise RuntimeError(f"checkpoint.async_save: pinning {numel * 4 / 2**30:.2f} GiB of "
                               f"host memory failed (cudaError {err})")
    return buf


def _release_host_buffer(buf: torch.Tensor, pinned: bool) -> None:
    if pinned and buf.numel():
        torch.cuda.cudart().cudaHostUnregister(buf.data_ptr())


class CheckpointSaver:
    """Saves checkpoints of one rank, in the training thread or in the background.

    `state_numel`: the elements the rank writes (`save.written_numel`); the background
    saver allocates its staging buffer for them up front, so a run that lacks the host memory
    fails at start-up, not at its first save."""

    def __init__(self, root: Path, cfg: Config, topo: Topology, device: torch.device,
                 background: bool, state_numel: int = 0):
        self.root, self.cfg, self.topo = root, cfg, topo
        self._pool = ThreadPoolExecutor(1, thread_name_prefix="megalite-checkpoint") \
            if background else None
        self._pending: Optional[Future] = None
        self._pinned = device.type == "cuda"
        self._staging = _host_buffer(state_numel, self._pinned) if background else None

    def _staging_buffer(self, numel: int) -> torch.Tensor:
        """The first `numel` elements of the staging buffer (grown if needed)."""
        if self._staging is None or self._staging.numel() < numel:
            if self._staging is not None:
                _release_host_buffer(self._staging, self._pinned)
            self._staging = None
            self._staging = _host_buffer(numel, self._pinned)
        return self._staging[:numel]

    def save(self, engine, state: SavedState) -> Optional[Path]:
        """Collective: the engine's pieces and the run state's parts (`RunState.capture()`),
        at the step `state` records. In the training thread: returns the published directory.
        In the background: returns None once the snapshot is taken; `wait()` returns the
        directory."""
        keep = self.cfg.checkpoint.keep
        if self._pool is None:
            snap = ckpt.take_snapshot(engine, state, self.cfg, self.topo)
            return ckpt.write_snapshot(self.root, snap, self.cfg, self.topo, keep,
                                       self.topo.checkpoint_group)
        self.wait()  # one save in flight; its staging buffer is about to be overwritten
        snap = ckpt.take_snapshot(engine, state, self.cfg, self.topo,
                                  staging=self._staging_buffer)
        self._pending = self._pool.submit(ckpt.write_snapshot, self.root, snap, self.cfg,
                                          self.topo, keep, self.topo.checkpoint_group)
        return None

    def wait(self) -> Optional[Path]:
        """Block until the background save (if any) is published; raise its error."""
        pending, self._pending = self._pending, None
        return pending.result() if pending is not None else None

    def close(self) -> Optional[Path]:
        """Wait for the last save and stop the background thread (later saves, if any, run
        in the calling thread)."""
        try:
            return self.wait()
        finally:
            if self._pool is not None:
                self._pool.shutdown(wait=True)
                self._pool = None
            if self._staging is not None:
                _release_host_buffer(self._staging, self._pinned)
                self._staging = None
