"""The host worker of the optimizer offload (`megalite.parallel.offload`): one thread,
`megalite-offload`, that runs the host's tasks in the order they were queued, bound to the
engine's CUDA device; the training thread's waits on it are the step phase `offload_wait`.
"""
from __future__ import annotations

import contextlib
from concurrent.futures import Future, ThreadPoolExecutor
from typing import Callable, Optional

import torch

from megalite.utils.clock import bind_cuda_device


class HostWorker:
    """The offload's host thread (started at the first task, let go by `close`)."""

    def __init__(self, device: torch.device, timers=None):
        self.device = device
        self.cuda = device.type == "cuda"
        self.timers = timers  # the trainer's StepTimers: waits are timed as `offload_wait`
        self.timeline = None  # an OffloadTimeline: waits drawn as `wait` spans
        self._executor: Optional[ThreadPoolExecutor] = None

    def waiting(self, index: int = -1):
        """The context a wait of the training thread on the offload runs in (timed; on a
        timeline, a `wait` span labelled `index`: the range waited for)."""
        stack = contextlib.ExitStack()
        if self.timers is not None:
            stack.enter_context(self.timers.phase("offload_wait"))
        if self.timeline is not None:
            stack.enter_context(self.timeline.on_device("wait", index))
        return stack

    def submit(self, fn: Callable, *args) -> Future:
        """Queue `fn(*args)` on the host worker (one thread: tasks run in the order queued;
        each spreads over the rank's intra-op threads, as torch.set_num_threads gave them)."""
        if self._executor is None:  # on the engine's CUDA device (`bind_cuda_device`), not 0
            self._executor = ThreadPoolExecutor(1, thread_name_prefix="megalite-offload",
                                                initializer=bind_cuda_device,
                                                initargs=(self._cuda_index(),))
        return self._executor.submit(fn, *args)

    def _cuda_index(self) -> Optional[int]:
        """The index of the engine's CUDA device (None on CPU): the worker's event syncs,
        event destruction and stream switches run there; on a thread's default device 0
        they would make a CUDA context on GPU 0 from every other local rank."""
        if not self.cuda:
            return None
        return self.device.index if self.device.index is not None \
            else torch.cuda.current_device()

    def close(self) -> None:
        """Let the worker thread go once its queued tasks ran (the end of `fit`); a later
        task starts a new one."""
        if self._executor is not None:
            self._executor.shutdown(wait=True)
            self._executor = None

    def wait(self, future: Optional[Future], index: int = -1) -> None:
        """The CPU waits for a worker task (timed as offload_wait when it has to; `index`: the
        range's, for a timeline); a failed task raises here."""
        if future is None:
            return
        if not future.done():
            with self.waiting(index):
                future.result()
        future.result()
