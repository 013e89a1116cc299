"""Attention alone over a CP group, `megalite-bench cp`'s second table: one layer's causal
attention forward and backward at the benchmark's shapes (b, the model's query and KV heads,
the whole sequence split over cp ranks), by

  megalite allgather / ring   `megalite.parallel.context_attention.cp_attention` on this rank's
                              two load-balanced chunks (`context_shard.shard`), KV heads only
  torch context_parallel      `torch.distributed.tensor.experimental.context_parallel` around
                              `F.scaled_dot_product_attention(is_causal=True)` on the whole
                              q, k, v (K and V repeated to the query heads), which it shards
                              itself on entry (not restored on exit: they require grad by then), as
                              torch's tests call it; with the default
                              SDPA kernels and under `sdpa_kernel(MATH)`

each call from a barrier, the slowest rank's time, calls alternated (A B C C B A ...). A torch
variant is first tried once: where it raises (on CPU: no sharding strategy for the CPU flash
kernel; the math kernel mixes plain tensors and DTensors) its error is reported instead of a
time, on every rank alike (it fails before any collective), and the other contenders run on.
"""
from __future__ import annotations

import contextlib
import statistics
import time
from typing import Callable, Dict, List, Optional

import torch
import torch.distributed as dist
import torch.nn.functional as F

from megalite.parallel import context_shard
from megalite.parallel.context_attention import cp_attention


def _full_qkv(cfg, device: torch.device):
    """The whole sequence's q [b, hq, s, d], k and v [b, hk, s, d], alike on every rank."""
    m, b, s = cfg.model, cfg.train.micro_batch_size, cfg.train.seq_len
    d = m.n_embd // m.n_head
    g = torch.Generator().manual_seed(0)
    q, k, v = (torch.randn(b, heads, s, d, generator=g).to(device)
               for heads in (m.n_head, m.kv_heads, m.kv_heads))
    return q, k, v


def _megalite(q, k, v, topo, comm: str) -> Callable[[], None]:
    group = topo.cp_group
    local = [context_shard.shard(x, group.size, group.rank, dim=2) for x in (q, k, v)]

    def call():
        ql, kl, vl = (x.detach().requires_grad_() for x in local)
        cp_attention(ql, kl, vl, group, comm).sum().backward()
    return call


def _torch(q, k, v, topo, kernel: Optional[object]) -> Callable[[], None]:
    from torch.distributed.device_mesh import DeviceMesh
    from torch.distributed.tensor.experimental import context_parallel
    from torch.nn.attention import sdpa_kernel

    mesh = DeviceMesh.from_group(topo.cp_group.pg, q.device.type)
    repeat = q.shape[1] // k.shape[1]
    full = [q, k.repeat_interleave(repeat, dim=1), v.repeat_interleave(repeat, dim=1)]

    def call():
        bufs = [x.detach().clone() for x in full]
        with context_parallel(mesh, buffers=bufs, buffer_seq_dims=[2, 2, 2],
                              no_restore_buffers=set(bufs)), \
                (sdpa_kernel(kernel) if kernel is not None else contextlib.nullcontext()):
            ql, kl, vl = (x.requires_grad_() for x in bufs)
            F.scaled_dot_product_attention(ql, kl, vl, is_causal=True).sum().backward()
    return call


def _tried(call: Callable[[], None]) -> Optional[str]:
    """None where `call` runs, else its error's type and first line."""
    try:
        call()
    except Exception as e:  # noqa: BLE001 — any failure of torch's CP is the finding
        return f"{type(e).__name__}: {str(e).strip().splitlines()[0][:160]}"
    return None


def _alternate(calls: Dict[str, Callable[[], None]], steps: int) -> Dict[str, float]:
    names = list(calls)
    times: Dict[str, List[float]] = {n: [] for n in names}
    for i in range(steps):
        for name in (names if i % 2 == 0 else names[::-1]):
            dist.barrier()
            t0 = time.perf_counter()
            calls[name]()
            t = torch.tensor([time.perf_counter() - t0], dtype=torch.float64)
            dist.all_reduce(t, op=dist.ReduceOp.MAX)
            times[name].append(t.item())
    return {n: statistics.median(v) for n, v in times.items()}


def compare_attention(cfg, topo, steps: int) -> List[dict]:
    """The second table's rows on this rank of a CP world (`topo.cp_size` > 1)."""
    from torch.nn.attention import SDPBackend

    q, k, v = _full_qkv(cfg, torch.device("cpu"))
    calls = {f"megalite {c}": _megalite(q, k, v, topo, c) for c in ("allgather", "ring")}
    errors = {}
    for name, kernel in (("torch context_parallel", None),
                         ("torch context_parallel (MATH)", SDPBackend.MATH)):
        call = _torch(q, k, v, topo, kernel)
        errors[name] = _tried(call)
        if errors[name] is None:
            calls[name] = call
    for call in calls.values():  # each once before timing
        call()
    seconds = _alternate(calls, steps)
    shape = (f"q {tuple(q.shape)}, k/v {tuple(k.shape)} over {topo.cp_size} ranks")
    return [{"cp": topo.cp_size, "shape": shape, "name": n, "seconds": seconds.get(n),
             "error": errors.get(n)} for n in [*calls, *(n for n in errors if errors[n])]]
