"""Run a function on N real gloo ranks: free port, OMP_NUM_THREADS=1, bounded time, every
rank's failure surfaced with its traceback.

    results = run_ranks(fn, world_size=4, args=(...,))   # fn(rank, world_size, *args)

`fn` must be importable (a module-level function) because ranks are spawned processes. Each
rank initializes the default gloo process group before `fn` runs and destroys it after; the
return values (picklable) come back as a list indexed by rank.
"""
from __future__ import annotations

import multiprocessing as mp
import os
import socket
import traceback
from datetime import timedelta
from typing import Any, Callable, List, Sequence


class RankFailure(RuntimeError):
    pass


def free_port() -> int:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _entry(fn, rank, world_size, port, args, queue, timeout_s):
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
        queue.put((rank, True, result))
    except BaseException:
        queue.put((rank, False, traceback.format_exc()))


def run_ranks(fn: Callable[..., Any], world_size: int, args: Sequence[Any] = (),
              timeout_s: float = 300.0) -> List[Any]:
    ctx = mp.get_context("spawn")
    queue = ctx.Queue()
    port = free_port()
    procs = [ctx.Process(target=_entry, args=(fn, r, world_size, port, tuple(args), queue,
                                              timeout_s), daemon=True)
             for r in range(world_size)]
    for p in procs:
        p.start()
    results: dict = {}
    failures: List[str] = []
    try:
        for _ in range(world_size):
            try:
                rank, ok, value = queue.get(timeout=timeout_s)
            except Exception:
                missing = sorted(set(range(world_size)) - set(results))
                failures.append(f"rank(s) {missing} gave no result within {timeout_s:.0f}s")
                break
            if ok:
                results[rank] = value
            else:
                failures.append(f"rank {rank} failed:\n{value}")
                break  # the others may now hang on a collective; stop them
    finally:
        for p in procs:
            p.join(timeout=1 if failures else 30)
            if p.is_alive():
                p.kill()
                p.join()
    if failures:
        raise RankFailure("\n".join(failures))
    crashed = [r for r, p in enumerate(procs) if p.exitcode not in (0, None) and r not in results]
    if crashed:
        raise RankFailure(f"ranks {crashed} exited without a result")
    return [results[r] for r in range(world_size)]
