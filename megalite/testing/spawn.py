"""Run a function on N real gloo ranks (tests, benchmarks): free port, OMP_NUM_THREADS=1,
bounded time, every rank's failure surfaced with its traceback.

    results = run_ranks(fn, world_size=4, args=(...,))   # fn(rank, world_size, *args)

`fn` must be importable (a module-level function): ranks are started by multiprocessing's
forkserver, a process that imported torch and megalite's trainer once (`PRELOAD`), so a rank
costs a fork instead of an interpreter importing torch (seconds of CPU per rank); it starts
as clean as a spawned one (nothing of the caller's memory, which may hold threads and patches)
and runs in the caller's current directory, sys.path and environment. Each rank initializes
the default gloo process group before `fn` runs and destroys it after; the return values come
back as a list indexed by rank. They travel as `torch.save` bytes, so they may hold tensors (a
tensor sent through a multiprocessing queue as such is shared by file descriptor, which breaks
once the sending rank has exited).
"""
from __future__ import annotations

import contextlib
import io
import multiprocessing as mp
import os
import queue as queue_mod
import signal
import socket
import time
import traceback
from datetime import timedelta
from typing import Any, Callable, Dict, List, Optional, Sequence

# What the forkserver imports once, before forking any rank (single-threaded imports only).
PRELOAD = ["torch", "torch.distributed", "megalite.train.build"]


class RankFailure(RuntimeError):
    pass


def free_port() -> int:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


class _CallerStdio:
    """The caller's stdout and stderr (file descriptors 1 and 2 now) for a rank: a forked rank
    holds the forkserver's, which are the caller's as they were when it started (under pytest,
    the capture of whichever test was running then)."""

    def __reduce__(self):
        from multiprocessing import reduction

        return tuple, ((reduction.DupFd(1), reduction.DupFd(2)),)


def _entry(fn, rank, world_size, port, args, queue, timeout_s, environ, stdio):
    for fd, inherited in enumerate(stdio, start=1):
        received = inherited.detach()
        os.dup2(received, fd)
        os.close(received)
    os.environ.clear()  # the caller's, as at start (the forkserver holds its own from then)
    os.environ.update(environ)
    os.environ.update({"OMP_NUM_THREADS": "1", "MASTER_ADDR": "127.0.0.1",
                       "MASTER_PORT": str(port), "RANK": str(rank),
                       "WORLD_SIZE": str(world_size), "LOCAL_RANK": str(rank),
                       "LOCAL_WORLD_SIZE": str(world_size)})
    try:
        import torch
        import torch.distributed as dist

        torch.set_num_threads(1)
        dist.init_process_group("gloo", rank=rank, world_size=world_size,
                                timeout=timedelta(seconds=timeout_s))
        try:
            result = fn(rank, world_size, *args)
        finally:
            dist.destroy_process_group()
        buf = io.BytesIO()
        torch.save(result, buf)
        queue.put((rank, True, buf.getvalue()))
    except BaseException:
        queue.put((rank, False, traceback.format_exc()))


def _all_failures(queue, rank: int, trace: str, grace_s: float = 3.0) -> str:
    """The first failure and any others that arrive within `grace_s` (the root cause is often
    not the first to be reported: a peer's "connection closed" can beat it)."""
    failures = [f"rank {rank} failed:\n{trace}"]
    deadline = time.monotonic() + grace_s
    while time.monotonic() < deadline:
        try:
            other, ok, value = queue.get(timeout=max(0.0, deadline - time.monotonic()))
        except queue_mod.Empty:
            break
        if not ok:
            failures.append(f"rank {other} failed:\n{value}")
    return "\n".join(failures)


def _collect(procs, queue, world_size: int, timeout_s: float) -> Dict[int, Any]:
    """Results by rank; raises RankFailure on the first failed, silent-dead or late rank."""
    import torch

    results: Dict[int, Any] = {}
    deadline = time.monotonic() + timeout_s
    while len(results) < world_size:
        try:
            rank, ok, value = queue.get(timeout=1.0)
        except queue_mod.Empty:
            dead = [r for r, p in enumerate(procs)
                    if r not in results and not p.is_alive() and p.exitcode != 0]
            if dead:
                # A rank that died without a word (killed, segfault): give its queue a moment.
                time.sleep(1.0)
                if queue.empty():
                    raise RankFailure(f"rank(s) {dead} exited with code(s) "
                                      f"{[procs[r].exitcode for r in dead]} and no result")
            if time.monotonic() > deadline:
                missing = sorted(set(range(world_size)) - set(results))
                raise RankFailure(f"rank(s) {missing} gave no result within {timeout_s:.0f}s")
            continue
        if not ok:
            raise RankFailure(_all_failures(queue, rank, value))
        results[rank] = torch.load(io.BytesIO(value), weights_only=False)
    return results


def run_ranks(fn: Callable[..., Any], world_size: int, args: Sequence[Any] = (),
              timeout_s: float = 300.0, group_timeout_s: Optional[float] = None) -> List[Any]:
    """`timeout_s`: for the whole run; `group_timeout_s`: the default process group's
    collective timeout (as `parallel.timeout_s` sets it under torchrun; default timeout_s)."""
    ctx = mp.get_context("forkserver")
    ctx.set_forkserver_preload(PRELOAD)  # takes effect when the forkserver starts (once)
    queue = ctx.Queue()
    port = free_port()
    procs = [ctx.Process(target=_entry, args=(fn, r, world_size, port, tuple(args), queue,
                                              group_timeout_s or timeout_s, dict(os.environ),
                                              _CallerStdio()),
                         daemon=True)
             for r in range(world_size)]
    for p in procs:
        p.start()
    failed = True
    try:
        results = _collect(procs, queue, world_size, timeout_s)
        failed = False
    finally:
        for p in procs:  # after a failure the others may hang on a collective: stop them
            p.join(timeout=1 if failed else 30)
            if p.is_alive():
                p.kill()
                p.join()
            elif failed and p.exitcode == 255:  # how a rank reads once its forkserver died:
                with contextlib.suppress(OSError):  # it may still run, orphaned
                    os.kill(p.pid, signal.SIGKILL)
    return [results[r] for r in range(world_size)]
