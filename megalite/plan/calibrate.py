"""Measure the machine this runs on: the device profile the planner loads (the command is
`scripts/plan.py --calibrate [--output FILE] [overrides]`, `megalite.cli.calibrate`; the file
format `megalite.plan.profile_file`).

- Matmul rate at the model's shapes: the MLP's two products, [s·b, h] x [h, 4h] and
  [s·b, 4h] x [4h, h] (s·b = train.seq_len x train.micro_batch_size tokens per micro-batch), in
  every dtype the device computes in (CUDA: fp32, fp16, bf16 from compute capability 8.0 and
  fp8 from 8.9: `torch._scaled_mm` on e4m3 operands with unit scales, bf16 output, the
  product fp8.recipe runs — the casts are not in it; CPU: fp32 and bf16). A dtype's rate
  is the shapes' FLOPs over their best times (2·m·n·k FLOPs a product); under several
  ranks, the slowest rank's.
- Under torchrun with more than one rank: a short collective sweep (all-reduce, all-gather,
  reduce-scatter, send/recv around a ring) per group size, like nccl-tests, over nccl on CUDA
  and gloo on CPU. Intra-node groups are consecutive ranks of one node (LOCAL_WORLD_SIZE ranks
  a node, torchrun's order); inter-node groups take one rank per node, all local ranks at once,
  as DP groups across nodes load the network in training. Each link is
  latency + bus bytes / bus bandwidth, least-squares fitted to the sweep of its largest group.
  On one node, inter_node is a copy of intra_node, and the file's notes say it was not measured.
- A single process measures matmuls only: its links come from `table_links` (the device
  table) when it knows the device; otherwise it stops, saying how to measure them.
"""
from __future__ import annotations

import math
import os
import platform
import time
from datetime import timedelta
from typing import Callable, Dict, List, Optional, Sequence, Tuple

import torch
import torch.distributed as dist

from megalite.config.fp8 import FP8_CAPABILITY
from megalite.config.layout import PRECISION_DTYPES
from megalite.plan.calibrate_block import measure_block_overhead
from megalite.plan.calibrate_host import (
    COPY_BYTES,
    HBM_BYTES,
    measure_hbm_gbps,
    measure_host_adam,
    measure_host_link,
    rank_threads,
)
from megalite.plan.calibrate_links import fit_link, fit_ops, group_sizes, sweep_link
from megalite.plan.calibrate_mask import kernels_here, measure_mask_ratios

CPU_SIZES = (1 << 16, 1 << 20, 1 << 23)  # bytes per collective: 64 KiB, 1 MiB, 8 MiB
CUDA_SIZES = (1 << 20, 1 << 23, 1 << 26, 1 << 28)  # 1 MiB .. 256 MiB
# The device table's answer for a device name: (links as in the profile file, where they come
# from), or None for a device it does not know.
TableLinks = Callable[[str], Optional[Tuple[Dict[str, Dict[str, float]], str]]]


class CalibrationError(RuntimeError):
    pass


def matmul_shapes(n_embd: int, ffn_size: int, tokens: int) -> List[Tuple[int, int, int]]:
    """(m, n, k) of C[m, n] = A[m, k] @ B[k, n] for the MLP's up and down projections."""
    return [(tokens, ffn_size, n_embd), (tokens, n_embd, ffn_size)]


def device_dtypes(device: torch.device) -> List[str]:
    if device.type != "cuda":
        return ["fp32", "bf16"]
    capability = torch.cuda.get_device_capability(device)
    return ["fp32", "fp16"] + (["bf16"] if capability[0] >= 8 else []) \
        + (["fp8"] if tuple(capability) >= FP8_CAPABILITY else [])


def _sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def _product(m: int, n: int, k: int, dtype: str, device: torch.device) -> Callable[[], object]:
    """C[m, n] = A[m, k] @ B[k, n] in `dtype` (a key of PRECISION_DTYPES, or fp8: e4m3
    operands, B column-major as cuBLAS's FP8 kernels take it, unit fp32 scales, bf16 out)."""
    g = torch.Generator(device=device).manual_seed(0)
    a = torch.randn(m, k, generator=g, device=device)
    b = torch.randn(k, n, generator=g, device=device)
    if dtype != "fp8":
        a, b = a.to(PRECISION_DTYPES[dtype]), b.to(PRECISION_DTYPES[dtype])
        return lambda: a @ b
    e4m3, one = torch.float8_e4m3fn, torch.ones((), device=device)
    a8, b8 = a.to(e4m3), b.t().contiguous().to(e4m3).t()
    return lambda: torch._scaled_mm(a8, b8, one, one, out_dtype=torch.bfloat16)


def time_matmul(m: int, n: int, k: int, dtype: str, device: torch.device,
                budget_s: float = 0.2, max_timings: int = 8) -> float:
    """Best seconds per product (`_product`) over up to `max_timings` timings within about
    `budget_s`; a timing spans enough products (at least one) to last a millisecond, so that
    launch overhead on a GPU does not count as compute. fp32 on CUDA runs as torch is set
    (TF32 off by default, as in megalite's runs)."""
    product = _product(m, n, k, dtype, device)
    product()  # warm-up (kernel choice, BLAS threads, cuBLAS handle)
    _sync(device)
    t0 = time.perf_counter()
    product()
    _sync(device)
    calls = max(1, min(100, int(1e-3 / max(time.perf_counter() - t0, 1e-9))))
    best, start = math.inf, time.perf_counter()
    for _ in range(max_timings):
        t0 = time.perf_counter()
        for _ in range(calls):
            product()
        _sync(device)
        best = min(best, (time.perf_counter() - t0) / calls)
        if time.perf_counter() - start > budget_s:
            break
    return best


def measure_matmuls(shapes: Sequence[Tuple[int, int, int]], dtypes: Sequence[str],
                    device: torch.device) -> List[dict]:
    """One matmul_sweep entry per (shape, dtype): this process's rate."""
    out = []
    for dtype in dtypes:
        for m, n, k in shapes:
            seconds = time_matmul(m, n, k, dtype, device)
            out.append({"m": m, "n": n, "k": k, "dtype": dtype,
                        "tflops": 2 * m * n * k / seconds / 1e12})
    return out


def matmul_rates(sweep: Sequence[dict]) -> Dict[str, float]:
    """Per dtype: total FLOPs over total time of its shapes (a FLOP-weighted harmonic mean)."""
    flops: Dict[str, float] = {}
    seconds: Dict[str, float] = {}
    for e in sweep:
        f = 2 * e["m"] * e["n"] * e["k"]
        flops[e["dtype"]] = flops.get(e["dtype"], 0.0) + f
        seconds[e["dtype"]] = seconds.get(e["dtype"], 0.0) + f / (e["tflops"] * 1e12)
    return {d: flops[d] / seconds[d] / 1e12 for d in flops}


def device_name(device: torch.device) -> str:
    if device.type == "cuda":
        return torch.cuda.get_device_name(device)
    try:
        with open("/proc/cpuinfo") as f:
            model = next((ln.split(":", 1)[1].strip() for ln in f if ln.startswith("model name")),
                         None)
    except OSError:
        model = None
    return f"cpu: {model or platform.processor() or platform.machine()}"


def device_memory_bytes(device: torch.device, ranks_per_node: int) -> int:
    """A GPU's memory; on CPU the host's RAM divided among the ranks of the node."""
    if device.type == "cuda":
        return torch.cuda.get_device_properties(device).total_memory
    return os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES") // ranks_per_node


def slug(text: str) -> str:
    return "-".join("".join(c if c.isalnum() else " " for c in text.lower()).split())


def _slowest(values: List[float], device: torch.device) -> List[float]:
    """Per position, the least value over the ranks (the slowest rank's rate)."""
    t = torch.tensor(values, dtype=torch.float64, device=device)
    dist.all_reduce(t, op=dist.ReduceOp.MIN)
    return t.tolist()


def measure_links(per_node: int, device: torch.device) -> Tuple[dict, List[dict], List[str]]:
    """links, sweep entries and notes of a launch of several ranks."""
    world, backend = dist.get_world_size(), dist.get_backend()
    if world % per_node:
        raise CalibrationError(f"WORLD_SIZE={world} is not a multiple of LOCAL_WORLD_SIZE="
                               f"{per_node}: calibrate on nodes with the same number of ranks")
    sizes, reps = (CUDA_SIZES, 5) if device.type == "cuda" else (CPU_SIZES, 5)
    sweep, links, notes = [], {}, []
    for link, span in (("intra_node", per_node), ("inter_node", world // per_node)):
        if span < 2:
            continue
        entries = sweep_link(link, per_node, sizes, device, reps)
        widest = max(e["group_size"] for e in entries)
        links[link] = fit_link([e for e in entries if e["group_size"] == widest])
        per_op = fit_ops([e for e in entries if e["group_size"] == widest])
        if per_op:
            links.setdefault("op_links", {})[link] = per_op
        sweep += entries
        notes.append(f"{link}: measured over {backend}, groups of {group_sizes(span)} "
                     f"{'ranks of a node' if link == 'intra_node' else 'nodes'}, fitted to "
                     f"the groups of {widest} (latency + bus bytes / bus bandwidth)")
    op_links = links.pop("op_links", {})
    for name, other in (("intra_node", "inter_node"), ("inter_node", "intra_node")):
        if name not in op_links and other in op_links:  # as the link itself, below
            op_links[name] = dict(op_links[other])
    if op_links:
        links["op_links"] = op_links
    if "intra_node" not in links:  # one rank a node: its links were never exercised
        links["intra_node"] = dict(links["inter_node"])
        notes.append("intra_node: not measured (one rank a node): set equal to inter_node")
    if "inter_node" not in links:
        links["inter_node"] = dict(links["intra_node"])
        notes.append("inter_node: not measured (a single node): set equal to intra_node")
    return links, sweep, notes


def _tabled_links(name: str, table_links: Optional[TableLinks]) -> Tuple[dict, List[str]]:
    found = table_links(name) if table_links else None
    if found is None:
        raise CalibrationError(
            f"a single process measures matmuls only, and the device table has no links for "
            f"{name!r}: measure them by launching two or more ranks, e.g. torchrun "
            "--standalone --nproc_per_node=2 scripts/plan.py --calibrate")
    links, source = found
    return links, [f"links: not measured (a single process): from {source}"]


def _launch_device() -> torch.device:
    if torch.cuda.is_available():
        local = int(os.environ.get("LOCAL_RANK", "0"))
        torch.cuda.set_device(local)
        return torch.device("cuda", local)
    return torch.device("cpu")


def measure_profile(n_embd: int, ffn_size: int, tokens: int,
                    table_links: Optional[TableLinks] = None, block=None) -> dict:
    """The profile of this machine (every rank of a launch calls this; all get the same one).
    Under WORLD_SIZE > 1 without a process group, makes one (nccl on CUDA, gloo on CPU) and
    destroys it after. `block`: (ModelConfig, seq_len, micro_batch[, compile]) to also
    measure a block's time beyond its matmul FLOPs (`megalite.plan.calibrate_block`) and the
    document-masked attention kernel's rate beside it (`megalite.plan.calibrate_mask`). On CUDA
    also the HBM copy rate, the pinned host copies per direction and the host AdamW rate
    (`megalite.plan.calibrate_host`)."""
    world = int(os.environ.get("WORLD_SIZE", "1"))
    device = _launch_device()
    made = world > 1 and not dist.is_initialized()
    if made:
        dist.init_process_group("nccl" if device.type == "cuda" else "gloo",
                                timeout=timedelta(seconds=300),
                                **({"device_id": device} if device.type == "cuda" else {}))
    try:
        profile = _measure(device, n_embd, ffn_size, tokens, table_links)
        if device.type == "cuda":
            _measure_host(device, profile)
        if block is not None:
            profile["block_overhead"] = _block_overhead(device, profile, *block)
            profile["notes"].append(_block_note(profile["block_overhead"]))
            profile["document_mask"] = _document_masks(device, profile, *block[:3])
            profile["notes"] += [_mask_note(m) for m in profile["document_mask"]]
        return profile
    finally:
        if made:
            dist.destroy_process_group()


def _measure(device: torch.device, n_embd: int, ffn_size: int, tokens: int,
             table_links: Optional[TableLinks]) -> dict:
    several = dist.is_initialized() and dist.get_world_size() > 1
    per_node = int(os.environ.get("LOCAL_WORLD_SIZE", dist.get_world_size() if several else 1))
    if not several and device.type == "cuda":
        per_node = torch.cuda.device_count()
    name, dtypes = device_name(device), device_dtypes(device)
    if not several:  # before measuring: a device the table does not know stops here
        links, link_notes = _tabled_links(name, table_links)
    matmul_sweep = measure_matmuls(matmul_shapes(n_embd, ffn_size, tokens), dtypes, device)
    notes = [f"matmul: {', '.join(dtypes)} at the MLP shapes of n_embd={n_embd}, "
             f"ffn={ffn_size}, {tokens} tokens (train.seq_len x train.micro_batch_size); best "
             f"of up to 8 timings"
             + (f", the slowest of {dist.get_world_size()} ranks" if several else "")
             + (f", {torch.get_num_threads()} CPU threads a rank" if device.type == "cpu" else "")]
    if several:
        rates = _slowest([e["tflops"] for e in matmul_sweep], device)
        for e, rate in zip(matmul_sweep, rates):
            e["tflops"] = rate
        links, sweep, link_notes = measure_links(per_node, device)
    else:
        sweep = []
    op_links = links.pop("op_links", None)
    return {"name": f"calibrated-{slug(name)}", "device": name,
            "memory_bytes": device_memory_bytes(device, per_node),
            **({"op_links": op_links} if op_links else {}),
            "matmul_tflops": matmul_rates(matmul_sweep), "links": links,
            "gpus_per_node": per_node, "sweep": sweep, "matmul_sweep": matmul_sweep,
            "notes": notes + link_notes}


def _measure_host(device: torch.device, profile: dict) -> None:
    """hbm_gbps, host_link and host_adam into `profile` (CUDA; module docstring of
    calibrate_host): the slowest rank's rates; the node's host AdamW = the slowest rank's ×
    its ranks (all measuring at once)."""
    several = dist.is_initialized() and dist.get_world_size() > 1
    local = int(os.environ.get("LOCAL_WORLD_SIZE", dist.get_world_size() if several else 1))
    hbm = measure_hbm_gbps(device)
    link = measure_host_link(device)
    adam = measure_host_adam(rank_threads(local))
    rates = [hbm, link["h2d_gbps"], link["d2h_gbps"], adam["params_per_s"]]
    if several:
        rates = _slowest(rates, device)
    profile["hbm_gbps"] = rates[0]
    profile["host_link"] = {"h2d_gbps": rates[1], "d2h_gbps": rates[2]}
    profile["host_adam"] = {"params_per_s": rates[3] * local, "threads": adam["threads"] * local}
    profile["notes"].append(
        f"host: HBM {rates[0]:.0f} GB/s (a {HBM_BYTES >> 20} MiB device copy, read + write); "
        f"pinned copies {rates[1]:.1f} GB/s host -> device, {rates[2]:.1f} GB/s device -> host "
        f"({COPY_BYTES >> 20} MiB each); host AdamW ({adam['kind']}) "
        f"{rates[3]:.3g} parameters/s on {adam['threads']} threads a rank, x {local} ranks a "
        "node" + (" (the slowest rank's)" if several else ""))


def _block_overhead(device: torch.device, profile: dict, model, seq_len: int,
                    micro_batch: int, compile: bool = False) -> dict:
    """`measure_block_overhead` in the device's training dtype (CPU fp32, CUDA bf16 where it
    has it, else fp16); under several ranks (measuring at once, as they train), the fit of
    the rank with the most such time between the two token counts."""
    dtype = "fp32" if device.type != "cuda" else \
        "bf16" if "bf16" in profile["matmul_tflops"] else "fp16"
    out = measure_block_overhead(model, seq_len, micro_batch, dtype,
                                 profile["matmul_tflops"][dtype], device, compile)
    if dist.is_initialized() and dist.get_world_size() > 1:  # the slowest rank's fit
        mine = torch.tensor([out["fixed_s"], out["per_token_s"]], dtype=torch.float64,
                            device=device)
        fits = [torch.zeros_like(mine) for _ in range(dist.get_world_size())]
        dist.all_gather(fits, mine)
        tokens = sum(out["tokens"]) / 2
        out["fixed_s"], out["per_token_s"] = max(
            (f.tolist() for f in fits), key=lambda f: f[0] + f[1] * tokens)
    return out


def _block_note(b: dict) -> str:
    return (f"block_overhead: a block's forward + backward beyond its matmul FLOPs at the "
            f"{b['dtype']} rate, fitted at {b['tokens'][0]} and {b['tokens'][1]} tokens "
            f"(measured {b['seconds'][0] * 1e3:.3g} and {b['seconds'][1] * 1e3:.3g} ms): "
            f"{b['fixed_s'] * 1e6:.4g} us + {b['per_token_s'] * 1e9:.4g} ns a token "
            f"(width {b['n_embd']}, dropout {b['dropout']:g}, "
            f"{'compiled' if b['compiled'] else 'eager'})")


def _document_masks(device: torch.device, profile: dict, model, seq_len: int,
                    micro_batch: int) -> List[dict]:
    """`measure_mask_ratios` in the block's dtype, for every document-mask kernel a run of
    `model` can use on this device (`kernels_here`); this rank's."""
    dtype = profile["block_overhead"]["dtype"]
    capability = torch.cuda.get_device_capability(device) if device.type == "cuda" else None
    return measure_mask_ratios(model, seq_len, micro_batch, dtype,
                               profile["matmul_tflops"][dtype], device,
                               kernels_here(device, model.attn_pdrop, dtype, capability))


def _mask_note(m: dict) -> str:
    return (f"document_mask: {m['kernel']} with documents of {m['document_tokens']} tokens "
            f"({m['pairs']:.1%} of the causal pairs, work {m['work']:.1%}): attention "
            f"{m['masked_s'] * 1e3:.3g} ms masked, {m['causal_s'] * 1e3:.3g} ms causal; the "
            f"masked attention costs {m['ratio']:.3g}x its work at the matmul rate")
